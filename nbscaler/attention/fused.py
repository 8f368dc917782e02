"""The ring, and gathered keys, on PyTorch's fused kernels: over mirrored chunks without a mask, each
block attended by a fused kernel with its log-sum-exp (``nbscaler.attention.kernels``: the CPU's
flash kernel, FlashAttention-2 or the memory-efficient kernel on a GPU) doing only the work the
causal mask leaves (``_fused_work``; ``nbscaler.attention`` explains when)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.distributed as dist
from torch.autograd import Function

from nbscaler import blocks as strided
from nbscaler.attention.kernels import block_backward, block_forward, has_block_kernels
from nbscaler.attention.online import (_Ring, _expand_heads, _fold_heads, _heads_inner, _merge, _place, ring_backward,
                                       ring_source)
from nbscaler.blocks import Blocks


def fused_ring(q: torch.Tensor, mask: Optional[torch.Tensor], blocks: Blocks) -> bool:
    """Whether the ring runs a fused kernel per block (see the module docstring)."""
    return mask is None and blocks == strided.MIRRORED and has_block_kernels(q)


def _halves(x: torch.Tensor, dim: int = -2) -> Tuple[torch.Tensor, torch.Tensor]:
    """A device's two mirrored chunks of a sequence axis."""
    return x.chunk(2, dim=dim)


def _fused_work(step: int, index: int, parts: int, is_causal: bool) -> str:
    """What ring step ``step`` of device ``index`` computes over mirrored chunks: ``"all"`` its queries
    against all the keys in hand (``"causal"``: masked, its own), ``"first_keys"`` against their first
    chunk, ``"last_queries"`` its second chunk of queries against all of them."""
    if not is_causal:
        return "all"
    if step == 0:
        return "causal"
    return "first_keys" if ring_source(index, step, parts) < index else "last_queries"


def _accumulated(x: torch.Tensor) -> torch.dtype:
    """The dtype the fused paths accumulate ``x``'s blocks in: float32, or ``x``'s own if finer."""
    return torch.promote_types(x.dtype, torch.float32)


def _fused_forward_step(q, kb, vb, work: str, scale: float, out, lse):
    """Merge one block's attention (keys and values with the queries' heads) into the float32
    accumulators ``out`` and ``lse``, doing the ``work`` its place leaves (``_fused_work``)."""
    if work == "first_keys":
        kb, vb = _halves(kb)[0], _halves(vb)[0]
    rows = _halves(q)[1] if work == "last_queries" else q
    o, l = block_forward(rows, kb, vb, work == "causal", scale)
    if work == "last_queries":
        h = q.shape[-2] // 2
        out[..., h:, :], lse[..., h:] = _merge(out[..., h:, :], lse[..., h:], o.to(out.dtype), l)
        return out, lse
    return _merge(out, lse, o.to(out.dtype), l)


def _fused_backward_step(dout, q, out, lse, kb, vb, work: str, scale: float, dq):
    """One block's share of the backward: added into ``dq`` (float32); returns the block's key and
    value gradients, over its whole length and with its own heads."""
    heads, h = q.shape[-3], q.shape[-2] // 2
    ke, ve = _expand_heads(kb, heads), _expand_heads(vb, heads)
    if work == "last_queries":
        gq, gk, gv = block_backward(_halves(dout)[1], _halves(q)[1], ke, ve, _halves(out)[1],
                                    _halves(lse, -1)[1].contiguous(), False, scale)
        dq[..., h:, :] += gq
    else:
        if work == "first_keys":
            ke, ve = _halves(ke)[0], _halves(ve)[0]
        gq, gk, gv = block_backward(dout, q, ke, ve, out, lse, work == "causal", scale)
        dq += gq
        if work == "first_keys":              # the keys' second chunk had no part in it
            gk, gv = (torch.cat([g, torch.zeros_like(g)], dim=-2) for g in (gk, gv))
    return _fold_heads(gk, kb.shape[-3]), _fold_heads(gv, vb.shape[-3])


class _FusedRingAttention(Function):
    """The ring on a fused kernel per block, over mirrored chunks without a mask (``fused_ring``)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale, group):
        parts, index = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
        ring = _Ring(group) if parts > 1 else None
        out = torch.zeros(q.shape, dtype=_accumulated(q), device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=_accumulated(q), device=q.device)
        kv = [k, v]
        for step in range(parts):
            if step < parts - 1:
                received, pending = ring.start(kv)           # the next block travels while this one computes
            kb, vb = (_expand_heads(t, q.shape[-3]) for t in kv)
            out, lse = _fused_forward_step(q, kb, vb, _fused_work(step, index, parts, is_causal), scale, out, lse)
            if step < parts - 1:
                _Ring.finish(pending)
                kv = received
        out = _heads_inner(out.to(q.dtype))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal, ctx.scale, ctx.group = is_causal, scale, group
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        parts, index = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
        ring = _Ring(group) if parts > 1 else None
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=_accumulated(q), device=q.device)

        def block_grads(step, kb, vb):
            work = _fused_work(step, index, parts, ctx.is_causal)
            return _fused_backward_step(dout, q, out, lse, kb, vb, work, scale, dq)

        dk, dv = ring_backward(ring, parts, k, v, block_grads)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


class _FusedGatheredAttention(Function):
    """Gathered keys and values on a fused kernel per block, over mirrored chunks without a mask:
    the ring's steps taken from the whole keys in hand, each device's block a slice, so only the
    work the causal mask leaves is done and no ``(Tq, T)`` mask is made or kept."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale, group):
        parts, index = _place(q, k, group, gathered=True)
        out = torch.zeros(q.shape, dtype=_accumulated(q), device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=_accumulated(q), device=q.device)
        for step in range(parts):
            source = ring_source(index, step, parts)
            kb, vb = (_expand_heads(strided.take(t, -2, strided.MIRRORED, parts, source), q.shape[-3]) for t in (k, v))
            out, lse = _fused_forward_step(q, kb, vb, _fused_work(step, index, parts, is_causal), scale, out, lse)
        out = _heads_inner(out.to(q.dtype))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.is_causal, ctx.scale, ctx.parts, ctx.index = is_causal, scale, parts, index
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        parts, index = ctx.parts, ctx.index
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=_accumulated(q), device=q.device)
        dk = torch.zeros(k.shape, dtype=_accumulated(k), device=k.device)
        dv = torch.zeros(v.shape, dtype=_accumulated(v), device=v.device)
        for step in range(parts):
            source = ring_source(index, step, parts)
            spans = strided.ranges(k.shape[-2], strided.MIRRORED, parts, source)
            kb, vb = (strided.take(t, -2, strided.MIRRORED, parts, source) for t in (k, v))
            work = _fused_work(step, index, parts, ctx.is_causal)
            gk, gv = _fused_backward_step(dout, q, out, lse, kb, vb, work, ctx.scale, dq)
            for full, grad in ((dk, gk), (dv, gv)):
                for (lo, hi), piece in zip(spans, _halves(grad)):
                    full[..., lo:hi, :] += piece
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
