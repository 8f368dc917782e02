"""The two routings, each cut where expert parallelism sends the rows to their experts' devices
and back (``nbscaler.experts.parallel``): what a device does before (``*_dispatch``), the experts'
products (``nbscaler.experts.grouped``), and what it does after (``*_combine``). In one process the
two halves meet directly; the registered ops are those."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from nbscaler.experts.grouped import batched_swiglu, grouped_swiglu
from nbscaler.experts.log import record
from nbscaler.ir.registry import register_op


class Sorted(NamedTuple):
    """A device's (token, expert) pairs sorted by expert: ``rows (n*k, d)`` the pairs' tokens in
    that order, ``order`` the pairs' places before sorting, ``token`` each row's token, ``counts``
    ``(E,)`` the pairs each expert gets."""

    rows: torch.Tensor
    order: torch.Tensor
    token: torch.Tensor
    counts: torch.Tensor


def dropless_dispatch(x: torch.Tensor, experts: torch.Tensor, n_experts: int) -> Sorted:
    """Sort the pairs of ``x`` ``(n, d)`` and ``experts`` ``(n, k)`` by expert."""
    k = experts.shape[1]
    flat = experts.reshape(-1)                                                 # (n*k,) pair -> expert
    order = flat.argsort(stable=True)                                          # pairs sorted by expert
    token = order // k                                                         # (n*k,) row -> token
    counts = torch.zeros(n_experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    record(counts)
    return Sorted(x[token], order, token, counts)


def dropless_combine(rows: torch.Tensor, routed: Sorted, weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Each token's sum of its experts' rows, weighted by the router: ``(n, d)``."""
    rows = rows * weights.reshape(-1)[routed.order].unsqueeze(-1).to(rows.dtype)
    return torch.zeros_like(x).index_add(0, routed.token, rows)


@register_op("n d^, n k^, n k^, e^ d^ h+, e^ d^ h+, e^ h+ d^ -> n d^", name="dropless_experts")
def dropless_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor,
                     w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``sum_j weights[t, j] * expert[experts[t, j]](x[t])`` for every token ``t`` (rows of ``x``).

    ``x`` ``(n, d)``; ``weights`` ``(n, k)`` the router's weights of the chosen experts;
    ``experts`` ``(n, k)`` their indices; ``w1``, ``w3`` ``(E, d, h)``; ``w2`` ``(E, h, d)``.
    """
    routed = dropless_dispatch(x, experts, w1.shape[0])
    offsets = routed.counts.cumsum(0).to(torch.int32)                          # each expert's run ends here
    return dropless_combine(grouped_swiglu(routed.rows, w1, w3, w2, offsets), routed, weights, x)


class Slotted(NamedTuple):
    """A device's pairs placed in capacity buffers: ``buffer (E, b*capacity, d)``, ``where`` each
    pair's row of it (0 for a dropped pair), ``token`` each pair's token, ``kept`` whether it fits."""

    buffer: torch.Tensor
    where: torch.Tensor
    token: torch.Tensor
    kept: torch.Tensor


def capacity_dispatch(x: torch.Tensor, experts: torch.Tensor, n_experts: int, capacity: int) -> Slotted:
    """Place the pairs of ``x`` ``(b, t, d)`` and ``experts`` ``(b, t, k)`` in each expert's
    buffer, the first ``capacity`` of each sequence in token order."""
    b, t, k = experts.shape
    chosen = F.one_hot(experts.reshape(b, t * k), n_experts)                   # (b, t*k, E)
    slot = ((chosen.cumsum(1) - 1) * chosen).sum(-1)                           # (b, t*k) place in its expert's queue
    kept = (slot < capacity).reshape(-1)
    record(chosen.sum((0, 1)), (chosen * kept.view(b, t * k, 1)).sum((0, 1)))
    seq = torch.arange(b, device=x.device).unsqueeze(1)                        # (b, 1)
    # pair -> its row of the (E * b * capacity) buffer; a dropped pair adds a zero row to row 0
    where = ((experts.reshape(b, t * k) * b + seq) * capacity + slot.clamp(max=capacity - 1)).reshape(-1)
    where = torch.where(kept, where, torch.zeros_like(where))
    token = (seq * t + torch.arange(t * k, device=x.device) // k).reshape(-1)  # (b*t*k,) pair -> token
    rows = x.reshape(b * t, -1)[token] * kept.unsqueeze(-1).to(x.dtype)
    buffer = x.new_zeros(n_experts * b * capacity, x.shape[-1]).index_add(0, where, rows)
    return Slotted(buffer.view(n_experts, b * capacity, -1), where, token, kept)


def capacity_combine(out: torch.Tensor, placed: Slotted, weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Each token's sum of its kept pairs' rows of ``out`` ``(E, b*capacity, d)``, weighted by the router."""
    b, t, d = x.shape
    back = out.reshape(-1, d)[placed.where]                                    # (b*t*k, d)
    back = back * (weights.reshape(-1) * placed.kept).unsqueeze(-1).to(back.dtype)
    return x.new_zeros(b * t, d).index_add(0, placed.token, back).view(b, t, d)


@register_op("b t^ d^, b t^ k^, b t^ k^, e^ d^ h+, e^ d^ h+, e^ h+ d^ -> b t^ d^", name="capacity_experts")
def capacity_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor,
                     w3: torch.Tensor, w2: torch.Tensor, capacity: int) -> torch.Tensor:
    """As ``dropless_experts``, but each expert serves at most ``capacity`` (token, expert) pairs of
    each sequence, the first in token order; the others are dropped.

    ``x`` ``(b, t, d)``; ``weights``, ``experts`` ``(b, t, k)``; the weights as in ``dropless_experts``.
    """
    placed = capacity_dispatch(x, experts, w1.shape[0], capacity)
    return capacity_combine(batched_swiglu(placed.buffer, w1, w3, w2), placed, weights, x)
