"""The pieces every context-parallel attention is made of: global positions and the mask they
make, one block of keys attended with its log-sum-exp, two partial attentions merged (the online
softmax), and the ring that passes blocks between the devices of a group."""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from nbscaler import blocks as strided
from nbscaler.blocks import Blocks

Group = Optional[dist.ProcessGroup]


def positions(length: int, blocks: Blocks, parts: int, index: int, device=None) -> torch.Tensor:
    """The global positions of the rows device ``index`` of ``parts`` holds of an axis of ``length``."""
    return torch.cat([torch.arange(lo, hi, device=device) for lo, hi in strided.ranges(length, blocks, parts, index)])


def ring_source(index: int, step: int, parts: int) -> int:
    """Whose block device ``index`` of ``parts`` has in hand at ring step ``step`` (its own at step 0)."""
    return (index - step) % parts


def held_chunks(length: int, blocks: Blocks, parts: int, index: int) -> List[Tuple[int, int, int]]:
    """``(chunk, start, stop)`` of each piece of an axis of ``length`` device ``index`` of ``parts``
    holds, the chunks numbered in the axis's equal cut into ``parts * units(blocks)``."""
    size = length // (parts * strided.units(blocks))
    return [(lo // size if size else 0, lo, hi) for lo, hi in strided.ranges(length, blocks, parts, index)]


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


def _fold_heads(grad: torch.Tensor, heads: int) -> torch.Tensor:
    """The gradient of ``_expand_heads``: each key head's share summed over the query heads it served."""
    if grad.shape[-3] == heads:
        return grad
    *lead, h, t, d = grad.shape
    return grad.reshape(*lead, heads, h // heads, t, d).sum(-3)


def ring_backward(ring: Optional[_Ring], parts: int, k: torch.Tensor, v: torch.Tensor,
                  block_grads: Callable[[int, torch.Tensor, torch.Tensor], Tuple[torch.Tensor, torch.Tensor]]
                  ) -> List[torch.Tensor]:
    """The gradients of this device's keys and values, the ring walked again: at each step the block
    in hand moves on while ``block_grads(step, k_block, v_block)`` computes its share, and the
    block's gradients so far, received from the previous device, take that share and move on too;
    after ``parts`` steps each block's gradients are home. Both passes run while a step computes:
    only the last, home, is waited for alone (``ring=None``: one device)."""
    kv, acc, pending_acc, received_acc = [k, v], None, None, None
    for step in range(parts):
        if ring is not None and step < parts - 1:
            next_kv, pending_kv = ring.start(kv)             # the block moves on while its share computes
        gk, gv = block_grads(step, kv[0], kv[1])
        if step == 0:
            acc = [gk, gv]
        else:                                                # the block's gradients from the previous device
            _Ring.finish(pending_acc)
            acc = [received_acc[0] + gk, received_acc[1] + gv]
        if ring is not None:
            received_acc, pending_acc = ring.start(acc)
        if ring is not None and step < parts - 1:
            _Ring.finish(pending_kv)
            kv = next_kv
    if ring is None:
        return acc
    _Ring.finish(pending_acc)
    return received_acc
