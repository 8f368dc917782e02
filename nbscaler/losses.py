"""The loss of a split batch, sequence or vocabulary: each device computes its own part of it.

Where a plan splits the tokens of a mean cross-entropy over a group (the batch under ``data`` and
expert parallelism, the sequence under context parallelism), gathering the ``(N, C)`` logits would
bring every device all of them, a vocabulary wide. ``split_cross_entropy`` instead divides this
device's sum by the count of counted tokens in the whole group (one all-reduce of an integer): the
devices' results are partial sums of the loss, which the generated code's ``all_reduce`` completes,
and each device's backward starts from its own logits' part.

Where the logits are split by their classes too (an output head split by vocabulary, Megatron-LM's
way), ``vocab_cross_entropy`` computes each device's part of each token's loss without gathering
them (``nbscaler.runtime.vocab`` explains it), and ``split_cross_entropy`` sums those parts.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function
from torch.autograd.function import once_differentiable

__all__ = ["split_cross_entropy", "vocab_cross_entropy"]

Group = Optional[dist.ProcessGroup]
REDUCTIONS = ("mean", "sum", "none")


def split_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: Optional[dist.ProcessGroup],
                        ignore_index: int = -100, vocab_start: Optional[int] = None,
                        vocab_group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """This device's part of the mean cross-entropy of the group's tokens (the parts sum to it);
    ``group=None`` counts this device's tokens alone (the cost model's fake call). With
    ``vocab_start``, ``logits`` hold the classes ``vocab_start ..`` of the whole, split over
    ``vocab_group`` too (``vocab_cross_entropy``): the parts then sum over both groups."""
    if vocab_start is None:
        total = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
    else:
        total = vocab_cross_entropy(logits, targets, vocab_start, vocab_group, ignore_index, "sum")
    count = (targets != ignore_index).sum()
    if group is not None:
        count = count.clone()
        dist.all_reduce(count, group=group)
    return total / count.clamp(min=1)


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
