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
  It lives in ``nbscaler.losses`` beside the loss of a split sequence, which calls it where the
  sequence and the vocabulary are both split (tensor parallelism inside context parallelism).

Generated code calls them where a plan splits an embedding by rows or a cross-entropy by classes
(``nbscaler.ir.layer_rules.vocab_parallel``) with ``start``, the first vocabulary entry the device holds.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd import Function

from nbscaler.losses import REDUCTIONS, vocab_cross_entropy

__all__ = ["REDUCTIONS", "vocab_cross_entropy", "vocab_embedding"]


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
