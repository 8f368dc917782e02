"""Context parallelism's two calls: attention over a sequence split across devices, and the
loss of a split sequence. Generated code calls them through ``nbscaler.runtime.context``; the
cost model calls the same functions on fake tensors (``group=None``), which is why they live in
this leaf module, below both.

A plan that splits the sequence (``pas_config={"context_parallel": n}``) leaves every op but
attention and the loss on this device's chunks: device ``i`` of ``n`` holds chunks ``i`` and
``2n-1-i`` of ``2n`` (``nbscaler.blocks.MIRRORED``), so under a causal mask each device does the
same work. Attention needs every key:

- ``all_gather`` (Llama 3's way): the keys and values arrive whole, gathered by the generated
  code's ``all_gather_sum_grad`` (its backward reduce-scatters their gradients), and
  ``context_attention`` masks by position: a query at global position ``p`` sees keys ``<= p``.
- ``ring`` (Ring Attention; torchtitan's and Megatron-LM's way): the keys and values stay split.
  Each device computes its queries against the block in hand while it passes that block to the
  next device and receives the previous one's; after ``n`` steps every query has seen every key.
  The blocks are merged by their log-sum-exp (the online softmax), so nothing ``(T, T)`` is kept:
  the forward saves this device's queries, keys, values, output and log-sum-exp, and the backward
  passes the keys and values round the ring again with their gradients, which arrive home after
  ``n`` steps.

Both kinds compute each block one of two ways, chosen by what the call is, never by catching an
error (gathered keys are taken a device's block at a time, as the ring would bring them): on CPU,
without a mask, over mirrored chunks, they call PyTorch's fused CPU flash kernel
(``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward) per block, and does only the
work the causal mask leaves: the first step its own chunks under a causal mask; each later step,
with keys from a device before it, all its queries against the keys' first chunk (their second is
in every query's future), and with keys from a device after it, its second chunk of queries
against all the keys (its first chunk sees none of them). Anything else (an explicit mask, other
chunkings, other devices) computes every block in full with the mask written out (``_block``), the
math of the same online softmax.

``group=None`` is a ring of one device: the cost model calls it so on fake tensors, to learn
what the ring saves.

``context_cross_entropy`` is the mean cross-entropy of the whole sequence computed from this
device's tokens: its local sum over the count of counted tokens in the whole group (one
all-reduce of an integer). The devices' results are partial sums of the loss, which the generated
code's ``all_reduce`` completes.
"""

from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function

from nbscaler import blocks as strided
from nbscaler.blocks import Blocks
from nbscaler.layouts import ContextKind

Group = Optional[dist.ProcessGroup]


def positions(length: int, blocks: Blocks, parts: int, index: int, device=None) -> torch.Tensor:
    """The global positions of the rows device ``index`` of ``parts`` holds of an axis of ``length``."""
    return torch.cat([torch.arange(lo, hi, device=device) for lo, hi in strided.ranges(length, blocks, parts, index)])


def _allowed(q_pos: torch.Tensor, k_pos: torch.Tensor, is_causal: bool,
             mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Which keys each query sees: a boolean ``(..., Tq, Tk)`` (``None``: all), or an additive float
    mask when the model gave one."""
    causal = k_pos[None, :] <= q_pos[:, None] if is_causal else None
    if mask is None:
        return causal
    if mask.dtype == torch.bool:
        return mask if causal is None else mask & causal
    return mask if causal is None else mask.masked_fill(~causal, float("-inf"))


def _mask_columns(mask: Optional[torch.Tensor], cols: torch.Tensor) -> Optional[torch.Tensor]:
    """The columns ``cols`` of a mask whose last axis is the whole sequence (a broadcast axis of 1 stays)."""
    if mask is None or mask.shape[-1] == 1:
        return mask
    return mask.index_select(-1, cols)


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Keys or values with fewer heads than the queries (grouped-query attention), repeated to match."""
    return x if x.shape[-3] == heads else x.repeat_interleave(heads // x.shape[-3], dim=-3)


def _block(q, k, v, allowed, scale) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` over one block of keys: its output and log-sum-exp (``-inf`` on rows that see none)."""
    s = (q @ _expand_heads(k, q.shape[-3]).transpose(-2, -1)) * scale            # (B, h, Tq, Tk)
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf")) if allowed.dtype == torch.bool else s + allowed
    lse = torch.logsumexp(s, dim=-1)                                              # (B, h, Tq)
    p = torch.exp(s - lse.unsqueeze(-1).clamp(min=torch.finfo(s.dtype).min)).nan_to_num(0.0)
    return p @ _expand_heads(v, q.shape[-3]), lse


def _merge(out, lse, block_out, block_lse):
    """Two partial attentions of the same queries as one (the online softmax)."""
    new = torch.logaddexp(lse, block_lse)
    keep = torch.exp(lse - new).nan_to_num(0.0).unsqueeze(-1)
    take = torch.exp(block_lse - new).nan_to_num(0.0).unsqueeze(-1)
    return out * keep + block_out * take, new


class _Ring:
    """Pass tensors to the next device of ``group`` and receive the previous device's, in the background."""

    def __init__(self, group: Group):
        self.group = group
        size = dist.get_world_size(group)
        me = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (me + 1) % size)
        self.prev = dist.get_global_rank(group, (me - 1) % size)

    def start(self, tensors: List[torch.Tensor]):
        tensors = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev, self.group) for r in received]
        return received, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(pending) -> None:
        for work in pending:
            work.wait()


def fused_ring(q: torch.Tensor, mask: Optional[torch.Tensor], blocks: Blocks) -> bool:
    """Whether the ring runs PyTorch's fused CPU flash kernel per block (see the module docstring)."""
    return mask is None and blocks == strided.MIRRORED and q.device.type == "cpu"


_FLASH_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_FLASH_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


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
    return "first_keys" if (index - step) % parts < index else "last_queries"


def _accumulated(x: torch.Tensor) -> torch.dtype:
    """The dtype the fused paths accumulate ``x``'s blocks in: float32, or ``x``'s own if finer."""
    return torch.promote_types(x.dtype, torch.float32)


def _heads_inner(out: torch.Tensor) -> torch.Tensor:
    """``out`` ``(..., h, T, d)`` laid out in memory as ``(..., T, h, d)``, as SDPA's kernels return it:
    the model's ``out.transpose(1, 2).reshape(B, T, C)`` is then a view, not a copy kept for the backward."""
    return out.transpose(-3, -2).contiguous().transpose(-3, -2) if out.dim() >= 3 else out


def _place(q: torch.Tensor, k: torch.Tensor, group: Group, gathered: bool) -> Tuple[int, int]:
    """``(parts, index)``: how many devices share the sequence and which this one is. Gathered
    keys say the count themselves (whole keys over this device's queries), so that the cost
    model's call without a group (device 0) takes the same steps as the ranks do."""
    index = 0 if group is None else dist.get_rank(group)
    if gathered:
        return k.shape[-2] // q.shape[-2], index
    return (1, 0) if group is None else (dist.get_world_size(group), index)


def _fused_forward_step(q, kb, vb, work: str, scale: float, out, lse):
    """Merge one block's attention (keys and values with the queries' heads) into the float32
    accumulators ``out`` and ``lse``, doing the ``work`` its place leaves (``_fused_work``)."""
    if work == "first_keys":
        kb, vb = _halves(kb)[0], _halves(vb)[0]
    rows = _halves(q)[1] if work == "last_queries" else q
    o, l = _FLASH_CPU(rows, kb, vb, 0.0, work == "causal", scale=scale)
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
        gq, gk, gv = _FLASH_CPU_BACKWARD(_halves(dout)[1], _halves(q)[1], ke, ve, _halves(out)[1],
                                         _halves(lse, -1)[1].contiguous(), 0.0, False, scale=scale)
        dq[..., h:, :] += gq
    else:
        if work == "first_keys":
            ke, ve = _halves(ke)[0], _halves(ve)[0]
        gq, gk, gv = _FLASH_CPU_BACKWARD(dout, q, ke, ve, out, lse, 0.0, work == "causal", scale=scale)
        dq += gq
        if work == "first_keys":              # the keys' second chunk had no part in it
            gk, gv = (torch.cat([g, torch.zeros_like(g)], dim=-2) for g in (gk, gv))
    return _fold_heads(gk, kb.shape[-3]), _fold_heads(gv, vb.shape[-3])


class _FusedRingAttention(Function):
    """The ring on the fused CPU flash kernel, over mirrored chunks without a mask (``fused_ring``)."""

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
        travelling = [k, v, torch.zeros(k.shape, dtype=_accumulated(k), device=k.device),
                      torch.zeros(v.shape, dtype=_accumulated(v), device=v.device)]   # a block and its gradients
        for step in range(parts):
            kb, vb, dkb, dvb = travelling
            work = _fused_work(step, index, parts, ctx.is_causal)
            gk, gv = _fused_backward_step(dout, q, out, lse, kb, vb, work, scale, dq)
            dkb.add_(gk)
            dvb.add_(gv)
            if parts > 1:                                   # the gradients go on; after n steps they are home
                send = travelling if step < parts - 1 else travelling[2:]
                received, pending = ring.start(send)
                _Ring.finish(pending)
                travelling = received if step < parts - 1 else [kb, vb, *received]
        return dq.to(q.dtype), travelling[2].to(k.dtype), travelling[3].to(v.dtype), None, None, None


class _FusedGatheredAttention(Function):
    """Gathered keys and values on the fused CPU flash kernel, over mirrored chunks without a mask:
    the ring's steps taken from the whole keys in hand, each device's block a slice, so only the
    work the causal mask leaves is done and no ``(Tq, T)`` mask is made or kept."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal, scale, group):
        parts, index = _place(q, k, group, gathered=True)
        out = torch.zeros(q.shape, dtype=_accumulated(q), device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=_accumulated(q), device=q.device)
        for step in range(parts):
            source = (index - step) % parts
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
            source = (index - step) % parts
            spans = strided.ranges(k.shape[-2], strided.MIRRORED, parts, source)
            kb, vb = (strided.take(t, -2, strided.MIRRORED, parts, source) for t in (k, v))
            work = _fused_work(step, index, parts, ctx.is_causal)
            gk, gv = _fused_backward_step(dout, q, out, lse, kb, vb, work, ctx.scale, dq)
            for full, grad in ((dk, gk), (dv, gv)):
                for (lo, hi), piece in zip(spans, _halves(grad)):
                    full[..., lo:hi, :] += piece
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


class _RingAttention(Function):
    """The ring in plain products, for any mask, chunking or device; ``gathered``: the keys and
    values are whole already, and each step takes the block a ring would bring from them."""

    @staticmethod
    def forward(ctx, q, k, v, mask, is_causal, scale, blocks, group, gathered=False):
        parts, index = _place(q, k, group, gathered)
        length = q.shape[-2] * parts
        q_pos = positions(length, blocks, parts, index, q.device)
        ring = _Ring(group) if parts > 1 and not gathered else None
        out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype, device=q.device)
        kv = [k, v]
        for step in range(parts):
            source = (index - step) % parts
            if ring is not None and step < parts - 1:
                received, pending = ring.start(kv)           # the next block travels while this one computes
            kb, vb = [strided.take(t, -2, blocks, parts, source) for t in (k, v)] if gathered else kv
            k_pos = positions(length, blocks, parts, source, q.device)
            allowed = _allowed(q_pos, k_pos, is_causal, _mask_columns(mask, k_pos))
            out, lse = _merge(out, lse, *_block(q, kb, vb, allowed, scale))
            if ring is not None and step < parts - 1:
                _Ring.finish(pending)
                kv = received
        out = _heads_inner(out)
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.is_causal, ctx.scale, ctx.blocks, ctx.group, ctx.gathered = is_causal, scale, blocks, group, gathered
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, mask = ctx.saved_tensors
        group, scale, blocks, gathered = ctx.group, ctx.scale, ctx.blocks, ctx.gathered
        parts, index = _place(q, k, group, gathered)
        length = q.shape[-2] * parts
        q_pos = positions(length, blocks, parts, index, q.device)
        ring = _Ring(group) if parts > 1 and not gathered else None
        delta = (dout * out).sum(-1, keepdim=True)                                 # (B, h, Tq, 1)
        dq = torch.zeros_like(q)
        dk, dv = (torch.zeros_like(k), torch.zeros_like(v)) if gathered else (None, None)
        travelling = [k, v, torch.zeros_like(k), torch.zeros_like(v)]             # a block and its gradients
        for step in range(parts):
            source = (index - step) % parts
            if gathered:
                kb, vb = (strided.take(t, -2, blocks, parts, source) for t in (k, v))
                dkb, dvb = torch.zeros_like(kb), torch.zeros_like(vb)
            else:
                kb, vb, dkb, dvb = travelling
            k_pos = positions(length, blocks, parts, source, q.device)
            allowed = _allowed(q_pos, k_pos, ctx.is_causal, _mask_columns(mask, k_pos))
            heads = q.shape[-3]
            s = (q @ _expand_heads(kb, heads).transpose(-2, -1)) * scale
            if allowed is not None:
                s = s.masked_fill(~allowed, float("-inf")) if allowed.dtype == torch.bool else s + allowed
            p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)                  # this block's softmax share
            ds = p * (dout @ _expand_heads(vb, heads).transpose(-2, -1) - delta)
            dq = dq + (ds @ _expand_heads(kb, heads)) * scale
            dkb = dkb + _fold_heads((ds.transpose(-2, -1) @ q) * scale, kb.shape[-3])
            dvb = dvb + _fold_heads(p.transpose(-2, -1) @ dout, vb.shape[-3])
            if gathered:                                    # this block's rows of the whole keys' gradients
                for full, grad in ((dk, dkb), (dv, dvb)):
                    spans = strided.ranges(length, blocks, parts, source)
                    for (lo, hi), piece in zip(spans, grad.split([hi - lo for lo, hi in spans], dim=-2)):
                        full[..., lo:hi, :] += piece
                continue
            travelling = [kb, vb, dkb, dvb]
            if parts > 1:                                   # the gradients go on; after n steps they are home
                send = travelling if step < parts - 1 else travelling[2:]
                received, pending = ring.start(send)
                _Ring.finish(pending)
                travelling = received if step < parts - 1 else [kb, vb, *received]
        if gathered:
            return dq, dk, dv, None, None, None, None, None, None
        return dq, travelling[2], travelling[3], None, None, None, None, None, None


def _fold_heads(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of ``_expand_heads``: each key head's share summed over the query heads it served."""
    if grad.shape[-3] == heads:
        return grad
    *lead, h, t, d = grad.shape
    return grad.reshape(*lead, heads, h // heads, t, d).sum(-3)


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                      dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                      enable_gqa: bool = False, *, kind: str, blocks: Blocks, group: Group) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of this device's queries, at their global positions.

    ``q`` ``(..., h, Tq, d)`` holds this device's rows of the sequence (``blocks``, of the devices of
    ``group``); ``attn_mask`` its rows too, with every key column. Under ``kind='all_gather'`` ``k``
    and ``v`` are whole; under ``'ring'`` they are this device's rows, passed round the group.
    """
    if dropout_p:
        raise ValueError("context_attention: attention dropout under context parallelism is not supported; "
                         "set the attention's dropout to 0 or plan without context_parallel.")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if kind == ContextKind.RING:
        if fused_ring(q, attn_mask, blocks):
            return _FusedRingAttention.apply(q, k, v, is_causal, scale, group)
        return _RingAttention.apply(q, k, v, attn_mask, is_causal, scale, blocks, group)
    if fused_ring(q, attn_mask, blocks):
        return _FusedGatheredAttention.apply(q, k, v, is_causal, scale, group)
    return _RingAttention.apply(q, k, v, attn_mask, is_causal, scale, blocks, group, True)


def context_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: Group,
                          ignore_index: int = -100) -> torch.Tensor:
    """This device's part of the mean cross-entropy of the group's tokens (the parts sum to it)."""
    total = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
    count = (targets != ignore_index).sum()
    if group is not None:
        count = count.clone()
        dist.all_reduce(count, group=group)
    return total / count.clamp(min=1)
