"""The ring in plain products (``_block``, ``_merge``), for any mask, chunking or device; with
``gathered``, the keys and values are whole already and each step takes the block a ring would bring."""

from __future__ import annotations

import torch
from torch.autograd import Function

from nbscaler import blocks as strided
from nbscaler.attention.online import (_Ring, _allowed, _block, _expand_heads, _fold_heads, _heads_inner,
                                       _mask_columns, _merge, _place, positions, ring_backward, ring_source)


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
            source = ring_source(index, step, parts)
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
        heads = q.shape[-3]

        def block_grads(step, kb, vb):
            """This block's share of the keys' and values' gradients; its share of the queries' into dq."""
            k_pos = positions(length, blocks, parts, ring_source(index, step, parts), q.device)
            allowed = _allowed(q_pos, k_pos, ctx.is_causal, _mask_columns(mask, k_pos))
            s = (q @ _expand_heads(kb, heads).transpose(-2, -1)) * scale
            if allowed is not None:
                s = s.masked_fill(~allowed, float("-inf")) if allowed.dtype == torch.bool else s + allowed
            p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)                  # this block's softmax share
            ds = p * (dout @ _expand_heads(vb, heads).transpose(-2, -1) - delta)
            dq.add_((ds @ _expand_heads(kb, heads)) * scale)
            return (_fold_heads((ds.transpose(-2, -1) @ q) * scale, kb.shape[-3]),
                    _fold_heads(p.transpose(-2, -1) @ dout, vb.shape[-3]))

        if not gathered:
            dk, dv = ring_backward(ring, parts, k, v, block_grads)
            return dq, dk, dv, None, None, None, None, None, None
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for step in range(parts):                           # each block's rows of the whole keys' gradients
            source = ring_source(index, step, parts)
            spans = strided.ranges(length, blocks, parts, source)
            grads = block_grads(step, *(strided.take(t, -2, blocks, parts, source) for t in (k, v)))
            for full, grad in zip((dk, dv), grads):
                for (lo, hi), piece in zip(spans, grad.split([hi - lo for lo, hi in spans], dim=-2)):
                    full[..., lo:hi, :] += piece
        return dq, dk, dv, None, None, None, None, None, None
