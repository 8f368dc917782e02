"""Expert parallelism: the experts split over the devices of a group, and every pair (token,
expert) sent to the device that holds its expert and back.

Device ``r`` of ``N`` holds experts ``r*E/N .. (r+1)*E/N - 1`` (dim 0 of ``w1``, ``w3``, ``w2``)
and routes its own tokens. A step is four all-to-alls, two forward and two backward:

- **dropless** (``expert_parallel_dropless``): the pairs sorted by expert are already grouped by
  the device that holds their expert. One all-to-all of the per-expert counts tells every device
  how many rows come from whom; the rows go out in one all-to-all with those split sizes (a
  different number each step), each device multiplies what it got, regrouped by expert, with one
  grouped product per weight, and the results go back the same way, reversed. The backward
  sends the rows' gradients along the same paths.
- **capacity** (``expert_parallel_capacity``): each device fills its ``(E, b*capacity, d)``
  buffers as in one process (capacity per sequence: what is dropped is decided before anything
  is sent), and the experts' share of them travels in one all-to-all of equal, fixed sizes.

What each device computes for each pair is what one process computes for it, so the result is
one process's, to the order of floating-point sums. ``group=None`` is a group of one device. The
cost model calls the functions on fake tensors with a ``PlannedGroup``, which stands in for the
group's size and this device's place: its exchanges make what a routing that loads every expert
alike would send (capacity routing sends exactly that, whatever the routing), or under dropless
routing what the busiest device of a routing ``imbalance`` times the mean gets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Tuple, Union

import torch
import torch.distributed as dist
from torch.autograd import Function

from nbscaler.experts.grouped import batched_swiglu, grouped_swiglu
from nbscaler.experts.routing import (capacity_combine, capacity_dispatch, capacity_experts, dropless_combine,
                                      dropless_dispatch, dropless_experts)


@dataclass(frozen=True)
class PlannedGroup:
    """A group of ``size`` devices of which this is ``rank``, for calls on fake tensors (see above).
    ``imbalance``: the rows this device gets over the balanced share (dropless routing; the busiest
    device of a real routing, ``Recipe.expert_imbalance``)."""

    size: int
    rank: int
    imbalance: float = 1.0


Group = Union[None, dist.ProcessGroup, PlannedGroup]


class _Exchange(Function):
    """Rows to the devices of a group: ``send[j]`` of them to device ``j``, ``receive[j]`` from it;
    the backward sends the gradients back along the same paths."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, send: List[int], receive: List[int], group) -> torch.Tensor:
        ctx.send, ctx.receive, ctx.group = send, receive, group
        return _exchange(rows, send, receive, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.receive, ctx.send, ctx.group), None, None, None


def _exchange(rows: torch.Tensor, send: List[int], receive: List[int], group: Group) -> torch.Tensor:
    out = rows.new_empty((sum(receive),) + tuple(rows.shape[1:]))
    if not isinstance(group, PlannedGroup):
        dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=receive, input_split_sizes=send, group=group)
    return out


def _size_rank(group: Group) -> Tuple[int, int]:
    if group is None:
        return 1, 0
    if isinstance(group, PlannedGroup):
        return group.size, group.rank
    return dist.get_world_size(group), dist.get_rank(group)


def _splits(counts: torch.Tensor, rows: int, n: int, mine: int,
            group: Group) -> Tuple[torch.Tensor, List[int], List[int]]:
    """The pairs this device gets of each of its experts from each device (``(n * mine,)``, by
    source), and how many of its ``rows`` it sends to each device and gets from each, given
    ``counts`` ``(n * mine,)``, the pairs it sends each device for each of that device's experts:
    the counts exchanged, or under a ``PlannedGroup`` as many rows every way (``imbalance`` times
    as many in)."""
    if isinstance(group, PlannedGroup):
        send = [rows // n] * n
        return counts, send, [math.ceil(r * group.imbalance) for r in send]
    arriving = torch.empty_like(counts)
    dist.all_to_all_single(arriving, counts, group=group)
    return arriving, counts.view(n, mine).sum(1).tolist(), arriving.view(n, mine).sum(1).tolist()


def _to_each_part(rows: torch.Tensor, sizes: List[int], parts: int) -> torch.Tensor:
    """``rows``, grouped by expert group (``sizes``), with each group's once for every device of the
    group (``parts`` of them, each holding its share of the experts' hidden units): autograd sums
    their gradients back. With one part, ``rows`` themselves (no copy)."""
    if parts == 1:
        return rows
    return torch.cat([group for group in rows.split(sizes) for _ in range(parts)])


def _sum_parts(returned: torch.Tensor, sizes: List[int], parts: int) -> torch.Tensor:
    """The rows back from every device, each expert group's ``parts`` partial sums added."""
    if parts == 1:
        return returned
    back = returned.split(sizes)
    return torch.cat([sum(back[g * parts:(g + 1) * parts]) for g in range(len(back) // parts)])


def expert_parallel_dropless(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor,
                             w3: torch.Tensor, w2: torch.Tensor, *, group: Group,
                             hidden_parts: int = 1) -> torch.Tensor:
    """``dropless_experts`` of this device's tokens with this device's experts ``w1``, ``w3``
    ``(E/G, d, h/P)``, ``w2`` ``(E/G, h/P, d)``, the pairs of other experts sent to their devices.
    With ``hidden_parts=P`` the group's ``N`` devices are ``G = N/P`` expert groups of ``P``
    devices, each holding ``1/P`` of its experts' hidden units: a pair goes to every device of its
    expert's group, and the ``P`` partial sums that come back are added."""
    n, _ = _size_rank(group)
    if n == 1:
        return dropless_experts(x, weights, experts, w1, w3, w2)
    mine, groups = w1.shape[0], n // hidden_parts                              # experts on each device
    routed = dropless_dispatch(x, experts, mine * groups)
    counts = routed.counts.view(groups, mine).repeat_interleave(hidden_parts, 0).reshape(-1)   # per device, its experts'
    arriving, send, receive = _splits(counts, routed.rows.shape[0] * hidden_parts, n, mine, group)
    sizes = send[::hidden_parts]                                               # rows per expert group
    rows = _Exchange.apply(_to_each_part(routed.rows, sizes, hidden_parts), send, receive, group)
    expert = torch.arange(mine, device=x.device).repeat(n).repeat_interleave(arriving, output_size=sum(receive))
    by_expert = expert.argsort(stable=True)                                    # regrouped expert by expert
    offsets = arriving.view(n, mine).sum(0).cumsum(0).to(torch.int32)
    out = grouped_swiglu(rows[by_expert], w1, w3, w2, offsets)
    out = out[by_expert.argsort()]                                             # back in the order received
    returned = _sum_parts(_Exchange.apply(out, receive, send, group), send, hidden_parts)
    return dropless_combine(returned, routed, weights, x)


def expert_parallel_capacity(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor,
                             w3: torch.Tensor, w2: torch.Tensor, capacity: int, *, group: Group,
                             hidden_parts: int = 1) -> torch.Tensor:
    """``capacity_experts`` of this device's sequences with this device's experts, each device's
    buffers for other experts sent to their devices (to every device of their group with
    ``hidden_parts``, as above)."""
    n, _ = _size_rank(group)
    if n == 1:
        return capacity_experts(x, weights, experts, w1, w3, w2, capacity)
    mine, groups = w1.shape[0], n // hidden_parts
    placed = capacity_dispatch(x, experts, mine * groups, capacity)           # buffer (E, b*capacity, d)
    slots, d = placed.buffer.shape[1], placed.buffer.shape[2]
    equal = [mine * slots] * n
    out = placed.buffer.reshape(-1, d)
    if hidden_parts > 1:                                                       # each group's buffers to all its devices
        out = out.view(groups, 1, mine * slots, d).expand(groups, hidden_parts, mine * slots, d).reshape(-1, d)
    arrived = _Exchange.apply(out, equal, equal, group)                        # (N sources * E/G * slots, d)
    arrived = arrived.view(n, mine, slots, d).transpose(0, 1).reshape(mine, n * slots, d)
    out = batched_swiglu(arrived, w1, w3, w2)                                  # (E/G, N * slots, d)
    out = out.view(mine, n, slots, d).transpose(0, 1).reshape(-1, d)
    returned = _Exchange.apply(out, equal, equal, group)
    if hidden_parts > 1:                                                       # each group's partial sums added
        returned = returned.view(groups, hidden_parts, mine * slots, d).sum(1)
    return capacity_combine(returned.view(groups * mine, slots, d), placed, weights, x)
