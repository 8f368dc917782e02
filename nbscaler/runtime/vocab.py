"""A lookup in an embedding table split by rows (the vocabulary) across devices, as Megatron-LM's
VocabParallelEmbedding: each device looks up the tokens its rows hold and gives zeros for the
others, so the devices' outputs are partial sums of the whole lookup. Generated code calls
``vocab_embedding`` where ``tp`` splits an embedding by rows, and the ``all_reduce`` that follows
(``nbscaler.runtime.collectives``) sums them; this module itself communicates nothing.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd import Function


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
