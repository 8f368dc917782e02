"""The two ends of a language model split by vocabulary across devices, as Megatron-LM splits them.

- ``vocab_embedding``: a lookup in an embedding table split by rows (Megatron-LM's
  VocabParallelEmbedding). Each device looks up the tokens its rows hold and gives zeros for the
  others, so the devices' outputs are partial sums of the whole lookup; the ``all_reduce`` that
  follows in the generated code (``nbscaler.runtime.collectives``) sums them. It communicates nothing.
- ``vocab_cross_entropy``: the cross-entropy of logits split by columns, as the output head's
  column-parallel linear leaves them (Megatron-LM's vocabulary-parallel cross-entropy). The logits
  are never gathered: the devices all-reduce each row's maximum and its sum of exponentials (two
  numbers a row), and each device's result is its part of the loss (the log of the sum on the first
  device, minus the target's logit on the device that holds it), so the ``all_reduce`` that follows
  sums the parts into the loss. The backward needs no communication: each device's gradient is its
  columns of ``softmax - one_hot(target)``. The plan's collectives list that ``all_reduce`` of the
  parts, not the two inside (two numbers a row, as a synchronised BatchNorm's statistics are not listed).

Generated code calls them where a plan splits an embedding by rows or a cross-entropy by classes
(``nbscaler.ir.layer_rules.vocab_parallel``) with ``start``, the first vocabulary entry the device holds.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function
from torch.autograd.function import once_differentiable

Group = Optional[dist.ProcessGroup]
REDUCTIONS = ("mean", "sum", "none")


class _VocabEmbedding(Function):
    """Saves only the tokens, as ``F.embedding`` does: the masks are recomputed in the backward,
    so a split table keeps the activations of a whole one."""

    @staticmethod
    def forward(ctx, tokens: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
        local = tokens - start                                               # (B, T)
        outside = (local < 0) | (local >= weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), weight)             # (B, T, d)
        ctx.save_for_backward(tokens)
        ctx.start, ctx.rows = start, weight.shape[0]
        return out.masked_fill_(outside.unsqueeze(-1), 0.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (tokens,) = ctx.saved_tensors
        local = tokens - ctx.start
        inside = (local >= 0) & (local < ctx.rows)
        grad_weight = grad.new_zeros(ctx.rows, grad.shape[-1])
        grad_weight.index_add_(0, local[inside], grad[inside])
        return None, grad_weight, None


def vocab_embedding(tokens: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """The lookup of ``tokens`` in rows ``start .. start + len(weight)`` of an embedding table split
    by rows (the vocabulary) across devices: zeros for tokens held elsewhere, so the devices'
    outputs sum to the whole lookup (an ``all_reduce`` follows). No communication of its own."""
    return _VocabEmbedding.apply(tokens, weight, start)


def _held(target: torch.Tensor, start: int, cols: int):
    """Where each row's target sits among this device's columns: ``(index, held)``, the column
    (0 where another device holds the target) and whether this device holds it."""
    local = target - start                                                   # (N,)
    held = (local >= 0) & (local < cols)
    return local.masked_fill(~held, 0).unsqueeze(-1), held                   # (N, 1), (N,)


def _all_reduce(x: torch.Tensor, op: dist.ReduceOp, group: Group) -> torch.Tensor:
    if group is not None:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabCrossEntropy(Function):
    """Saves the local softmax and the targets, as ``F.cross_entropy`` saves its local log-softmax:
    a device's activations are its share of a whole cross-entropy's."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, start: int, group: Group,
                ignore_index: int, reduction: str) -> torch.Tensor:
        sums = torch.promote_types(logits.dtype, torch.float32)        # bf16 logits: sums in fp32
        peak = _all_reduce(logits.detach().amax(dim=-1), dist.ReduceOp.MAX, group)   # (N,) the row's maximum
        exp = (logits.detach() - peak.unsqueeze(-1)).exp_()                          # (N, v)
        total = _all_reduce(exp.sum(-1, dtype=sums), dist.ReduceOp.SUM, group)       # (N,)
        index, held = _held(target, start, logits.shape[-1])
        picked = (logits.detach().gather(-1, index).squeeze(-1).to(sums) - peak.to(sums)).masked_fill_(~held, 0.0)
        parts = (total.log() if start == 0 else torch.zeros_like(total)) - picked   # (N,) this device's part
        valid = target != ignore_index
        parts = parts.masked_fill_(~valid, 0.0)
        softmax = exp.div_(total.unsqueeze(-1).to(exp.dtype))
        ctx.save_for_backward(softmax, target)
        ctx.start, ctx.ignore_index, ctx.reduction = start, ignore_index, reduction
        if reduction == "none":
            return parts.to(logits.dtype)
        loss = parts.sum()
        return (loss / valid.sum() if reduction == "mean" else loss).to(logits.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        softmax, target = ctx.saved_tensors
        valid = target != ctx.ignore_index
        scale = grad / valid.sum() if ctx.reduction == "mean" else grad               # () or (N,)
        per_row = (scale * valid).to(softmax.dtype)                                    # (N,)
        index, held = _held(target, ctx.start, softmax.shape[-1])
        grad_logits = softmax * per_row.unsqueeze(-1)                                  # (N, v)
        grad_logits.scatter_add_(-1, index, -(per_row * held).unsqueeze(-1))
        return grad_logits, None, None, None, None, None


def vocab_cross_entropy(logits: torch.Tensor, target: torch.Tensor, start: int, group: Group,
                        ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """This device's part of ``F.cross_entropy(logits, target)`` for ``logits`` that hold columns
    (classes) ``start .. start + logits.shape[-1]`` of the whole, across the devices of ``group``.

    ``logits`` is ``(N, v)`` and ``target`` the ``(N,)`` class indices, the same on every device;
    rows whose target is ``ignore_index`` count for nothing (and, under ``"mean"``, are left out of
    the count). The parts of the devices sum to the whole cross-entropy (an ``all_reduce``
    follows), which equals one process's; the gradient of the sum reaches each device's columns.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not a cross-entropy reduction: use one of {REDUCTIONS}")
    return _VocabCrossEntropy.apply(logits, target, start, group, ignore_index, reduction)
