"""ZeRO stage 1: split the optimizer state over the ranks that hold the same part of the model.

Without ZeRO every data-parallel rank keeps a whole optimizer state (for Adam, two more copies of
its parameters) and makes the same update as all the others. With ZeRO the ``N`` ranks of a *ZeRO
group* split the work:

1. ``sync``: each flat gradient bucket is padded to a multiple of ``N`` and *reduce-scattered*
   over the group, so rank ``i`` receives the summed gradient of slice ``i`` only. With
   ``zero_ngroups > 1`` the data-parallel ranks form several ZeRO groups, each holding a whole
   copy of the state, and the slice is then summed across them too (the *replica* group).
2. ``optimizer.step()`` updates slice ``i`` (a flat parameter, the *shard*), so the optimizer
   state it creates is ``1/N`` of the full one.
3. ``gather_params``: the updated shards are all-gathered back into the full parameters.

The shards are working copies: ``sync`` refreshes them from the parameters, so loading a
checkpoint into the module (or changing a parameter by hand) needs no extra step.

Nothing here looks at which device holds which part of the model: the groups are the
data-parallel ranks of one plan device, and the buckets hold whatever parameters that device has.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from nbscaler.runtime.reducer import Bucket, Reducer, Slot


def _size_rank(group: Optional[dist.ProcessGroup]):
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


@torch.no_grad()
def _read_params(slot: Slot) -> None:
    """Copy the current parameter values into a shard (padding stays zero)."""
    shard, segments = slot
    for s in segments:
        shard[s.offset:s.offset + s.length].copy_(s.param.detach().reshape(-1)[s.start:s.start + s.length])


class ZeroReducer(Reducer):
    """A ``Reducer`` whose optimizer parameters are this rank's slices of the gradient buckets.

    ``group``: every data-parallel rank of this plan device (gradients are summed over all of them);
    ``zero_group``: the ranks that split the state; ``replica_group``: the ranks, one per ZeRO
    group, that hold the same slice.
    """

    def __init__(self, params: List[torch.nn.Parameter], group: Optional[dist.ProcessGroup],
                 zero_group: Optional[dist.ProcessGroup], replica_group: Optional[dist.ProcessGroup],
                 bucket_mb: float = 25.0):
        super().__init__(params, group, bucket_mb)
        self.zero_group, self.replica_group = zero_group, replica_group
        self.zero_size, zero_rank = _size_rank(zero_group)
        self.slots: List[Slot] = []
        for bucket in self.buckets:
            length = self._padded(bucket) // self.zero_size
            begin = zero_rank * length
            first = bucket.params[0]
            shard = torch.nn.Parameter(torch.zeros(length, dtype=first.dtype, device=first.device))
            self.slots.append((shard, bucket.segments(begin, begin + length)))
            _read_params(self.slots[-1])

    def _padded(self, bucket: Bucket) -> int:
        return -(-bucket.numel // self.zero_size) * self.zero_size

    def _reduce(self, flat: torch.Tensor) -> torch.Tensor:
        if self.zero_group is None:
            piece = flat
        else:
            piece = torch.empty(flat.numel() // self.zero_size, dtype=flat.dtype, device=flat.device)
            dist.reduce_scatter(piece, list(flat.chunk(self.zero_size)), group=self.zero_group)
        if self.replica_group is not None:
            dist.all_reduce(piece, group=self.replica_group)
        return piece

    def _deliver(self, index: int, reduced: torch.Tensor) -> None:
        _read_params(self.slots[index])
        self.slots[index][0].grad = reduced

    def optimizer_slots(self) -> List[Slot]:
        return self.slots

    @torch.no_grad()
    def gather_params(self) -> None:
        for bucket, (shard, _) in zip(self.buckets, self.slots):
            if self.zero_group is None:
                bucket.set_params(shard)
                continue
            flat = torch.empty(self._padded(bucket), dtype=shard.dtype, device=shard.device)
            dist.all_gather(list(flat.chunk(self.zero_size)), shard.detach(), group=self.zero_group)
            bucket.set_params(flat)

    @property
    def copies(self) -> int:
        return _size_rank(self.replica_group)[0]
