"""ZeRO stage 3, fully sharded data parallelism: parameters live as shards and are gathered a unit
at a time.

Under stages 1 and 2 (``nbscaler.runtime.zero``) every data-parallel rank stores every parameter.
Under stage 3 the ``N`` ranks of a ZeRO group each store ``1/N`` of each *unit* (a repeated layer,
or the rest of the model: ``nbscaler.policy.shard_units``), as one flat shard that is also what
the optimizer updates (or, with master copies, an fp32 copy of it: the module-dtype shard is then
not kept at all). The unit's parameters are views of one flat tensor whose storage exists only
while the unit is *gathered*:

1. ``unshard(unit, prefetch)``, where the generated forward reaches the unit: all-gather every
   rank's shard into the flat tensor (in the parameters' dtype: bf16 for a bf16 model), then start
   the all-gather of ``prefetch``, the unit that runs next, without waiting for it;
2. ``reshard(unit, *outputs)``, after the unit's last op in the forward: free the flat tensor's
   storage, and pass what leaves the unit through an autograd function whose backward gathers the
   unit again (and starts gathering the unit that ran before it) before autograd reaches its ops;
3. as the backward makes a unit's gradients, the unit is freed again and they are
   reduce-scattered (the stage-2 hooks of ``ZeroReducer``) into the shard's gradient.

A unit that the forward does not free (the rest of the model, which runs at its start and at its
end; every unit under ``zero_reshard_after_forward=False``) stays gathered until the backward has
reduced its gradients for every forward that gathered it. ``sync`` (before the optimizer step)
reduces what is left and frees every unit, so the step updates shards only and the next forward
gathers the updated values. A unit whose backward has begun stays gathered until its gradients are
reduced, even where a forward in between would free it: a zero-bubble schedule runs the next
micro-batch's forward between a backward's ``B`` (input gradients) and its ``W`` (weight gradients).

Every rank of a ZeRO group runs the same gathers and reduce-scatters in the same order (the same
generated code and the same backward), as the collectives require.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from nbscaler.runtime.reducer import Bucket
from nbscaler.runtime.zero import ZeroReducer


def _free(flat: torch.Tensor) -> None:
    flat.untyped_storage().resize_(0)


def _allocate(flat: torch.Tensor) -> None:
    storage = flat.untyped_storage()
    if storage.nbytes() == 0:
        storage.resize_(flat.numel() * flat.element_size())


def _all_gather_in_place(flat: torch.Tensor, mine: torch.Tensor, group: dist.ProcessGroup) -> Any:
    """Start gathering every rank's slice of ``flat`` into ``flat``, ``mine`` (this rank's slice, a
    view of ``flat``) the input; returns the work to wait for."""
    # torch 2.13 names all_gather_into_tensor all_gather_single, and the old name warns
    gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    return gather(flat, mine, group=group, async_op=True)


class _GatherBeforeBackward(torch.autograd.Function):
    """The identity on a unit's outputs, whose backward gathers the unit's parameters again."""

    @staticmethod
    def forward(ctx: Any, units: "ShardedUnits", unit: str, *tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        ctx.units, ctx.unit = units, unit
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        ctx.units.before_backward(ctx.unit)
        return (None, None) + grads


class ShardedUnits(ZeroReducer):
    """A ``ZeroReducer`` whose buckets are units, stored as shards and gathered on demand.

    ``units``: unit name -> its parameters (the generated ``shard_units`` table, in the order the
    forward first runs them); ``group``, ``zero_group``, ``replica_group``, ``shares``: as
    ``ZeroReducer``'s.
    """

    def __init__(self, units: Dict[str, List[torch.nn.Parameter]], group: Optional[dist.ProcessGroup],
                 zero_group: Optional[dist.ProcessGroup], replica_group: Optional[dist.ProcessGroup],
                 fill: Optional[Callable[[List[torch.nn.Parameter]], None]] = None,
                 shares: Optional[Dict[int, float]] = None):
        self.fill = fill
        groups: List[List[torch.nn.Parameter]] = []
        self.unit_buckets: Dict[str, List[int]] = {}
        for unit, params in units.items():
            by_dtype: Dict[torch.dtype, List[torch.nn.Parameter]] = {}
            for p in params:
                if p.requires_grad:
                    by_dtype.setdefault(p.dtype, []).append(p)
            self.unit_buckets[unit] = list(range(len(groups), len(groups) + len(by_dtype)))
            groups += list(by_dtype.values())
        super().__init__([p for g in groups for p in g], group, zero_group, replica_group, stage=3, groups=groups,
                         shares=shares)
        self.fill = None                     # what it read is in the shards now
        self.unit_of_bucket = {i: unit for unit, indexes in self.unit_buckets.items() for i in indexes}
        self.gathered: Dict[str, bool] = {}
        self.pending: Dict[str, List[Tuple[Any, torch.Tensor]]] = {}   # unit -> (work, sent shard)
        self.forwards: Dict[str, int] = {unit: 0 for unit in units}   # forwards not yet backed
        self.reduced: Dict[str, int] = {unit: 0 for unit in units}    # buckets reduced this backward
        self.backing: Dict[str, int] = {unit: 0 for unit in units}    # backwards begun, gradients not yet reduced
        self.released: set = set()           # units the forward frees (``reshard``)
        self.order: List[str] = []           # units in the order the forward gathers them
        self.gathered_bytes = self.most_gathered_bytes = 0     # what ``MemoryMeter`` reads
        for unit in units:                   # built gathered (the flats of ``flatten_params``): freed
            self._free_unit(unit)
        self.gathered_bytes = self.most_gathered_bytes = 0

    # -- building: one unit in memory at a time --------------------------------------------------
    @torch.no_grad()
    def _flatten(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's flat tensor with its parameters as views: filled from ``fill`` (the weights
        source, read for this bucket only) or from the parameters' own values where they have any."""
        first = bucket.params[0]
        flat = torch.zeros(self._padded(bucket), dtype=first.dtype, device=first.device)
        for p, offset in zip(bucket.params, bucket.offsets):
            part = flat[offset:offset + p.numel()]
            if p.untyped_storage().nbytes():
                part.copy_(p.detach().reshape(-1))
            p.data = part.view_as(p)
        if self.fill is not None:
            self.fill(bucket.params)
        return flat

    def _shard(self, flat: torch.Tensor, begin: int, length: int) -> torch.nn.Parameter:
        """This rank's slice of ``flat`` in storage of its own; the flat tensor is freed at once, so
        building holds one bucket whole at a time."""
        shard = torch.nn.Parameter(flat[begin:begin + length].clone())
        _free(flat)
        return shard

    # -- gathering and freeing ------------------------------------------------------------------
    def _start_gather(self, unit: str) -> None:
        """Issue the all-gathers of ``unit``'s buckets without waiting for them.

        Each gathers in place: this rank's shard is first written (cast to the parameters' dtype)
        into its own slice of the flat tensor, which is then the all-gather's input, so no send
        buffer (a copy of the shard) is held while the gather is in flight."""
        if self.gathered.get(unit) or unit in self.pending:
            return
        works = []
        with torch.no_grad():
            for index in self.unit_buckets[unit]:
                flat, shard = self.flats[index], self.slots[index][0]
                _allocate(flat)
                self._count(flat.untyped_storage().nbytes())
                mine = flat.chunk(self.zero_size)[self.zero_rank]
                mine.copy_(shard.detach())
                if self.zero_group is None:
                    continue
                works.append((_all_gather_in_place(flat, mine, self.zero_group), mine))
        self.pending[unit] = works

    def _wait(self, unit: str) -> None:
        """``unit`` gathered: wait for its all-gathers, issuing them first if nobody has."""
        if self.gathered.get(unit):
            return
        self._start_gather(unit)
        for work, _ in self.pending.pop(unit):
            work.wait()
        self.gathered[unit] = True

    def _free_unit(self, unit: str) -> None:
        if unit in self.pending:             # a prefetch nobody used: finish it before freeing its buffer
            self._wait(unit)
        for index in self.unit_buckets[unit]:
            self._count(-self.flats[index].untyped_storage().nbytes())
            _free(self.flats[index])
        self.gathered[unit] = False

    def _count(self, nbytes: int) -> None:
        self.gathered_bytes += nbytes
        self.most_gathered_bytes = max(self.most_gathered_bytes, self.gathered_bytes)

    def take_most_gathered(self) -> int:
        """The most bytes gathered at once since the last call (or construction), starting over."""
        most, self.most_gathered_bytes = self.most_gathered_bytes, self.gathered_bytes
        return most

    def stored_shards(self) -> List[torch.nn.Parameter]:
        """The shards kept in the parameters' dtype: this rank's stored parameters (none where the
        optimizer updates master copies, which take the shards' place)."""
        return [shard for shard, _ in self.slots if id(shard) not in self.masters]

    def unshard(self, unit: str, prefetch: Optional[str] = None) -> None:
        """Where the forward reaches ``unit``: gather its parameters, then start gathering ``prefetch``."""
        if unit not in self.order:
            self.order.append(unit)
        if torch.is_grad_enabled():
            self.forwards[unit] += 1
        self._wait(unit)
        if prefetch is not None:
            self._start_gather(prefetch)

    def reshard(self, unit: str, *outputs: torch.Tensor) -> Tuple[torch.Tensor, ...]:
        """After ``unit``'s forward: free its parameters; ``outputs`` come back through the hook that
        gathers them again for the backward."""
        self.released.add(unit)
        if not self.backing[unit]:          # a split backward's W still to run keeps it gathered
            self._free_unit(unit)
        grads = [i for i, t in enumerate(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not grads or not torch.is_grad_enabled():
            return tuple(outputs)
        hooked = _GatherBeforeBackward.apply(self, unit, *(outputs[i] for i in grads))
        out = list(outputs)
        for i, t in zip(grads, hooked):
            out[i] = t
        return tuple(out)

    def before_backward(self, unit: str) -> None:
        """The backward reached ``unit``'s outputs: gather it, and start gathering the unit before it."""
        self.backing[unit] += 1
        self._wait(unit)
        at = self.order.index(unit) if unit in self.order else 0
        if at > 0:
            self._start_gather(self.order[at - 1])

    def free_all(self) -> None:
        """Free every gathered unit (after a forward without gradients, and before the optimizer step)."""
        for unit in self.unit_buckets:
            if self.gathered.get(unit) or unit in self.pending:
                self._free_unit(unit)

    def gather_all(self) -> None:
        """Gather every unit (to read or write whole local parameters: a state dict)."""
        for unit in self.unit_buckets:
            self._wait(unit)

    # -- gradients ------------------------------------------------------------------------------
    def _reduce_bucket(self, index: int) -> None:
        """Reduce-scatter bucket ``index``'s gradients; once it is the last of its unit's, free the
        unit first when this backward was its last use, so that the gathered parameters are gone
        before the reduction's buffers (the flat gradients, the received slice) are made."""
        unit = self.unit_of_bucket[index]
        self.reduced[unit] += 1
        if self.reduced[unit] == len(self.unit_buckets[unit]):
            self.reduced[unit] = 0
            self.forwards[unit] = max(self.forwards[unit] - 1, 0)
            self.backing[unit] = max(self.backing[unit] - 1, 0)
            if not self.backing[unit] and (unit in self.released or self.forwards[unit] == 0):
                self._free_unit(unit)
        super()._reduce_bucket(index)

    def sync(self) -> None:
        """Reduce the gradients the backward left (``ZeroReducer.sync``), then free every unit."""
        super().sync()
        self._forget()
        self.free_all()

    def zero_grad(self) -> None:
        super().zero_grad()
        self._forget()

    def _forget(self) -> None:
        """A new step: no forward waits for its backward."""
        for unit in self.unit_buckets:
            self.forwards[unit] = self.reduced[unit] = self.backing[unit] = 0

    # -- what the optimizer sees ----------------------------------------------------------------
    @torch.no_grad()
    def refresh_masters(self) -> None:
        """After new values were written into the gathered parameters (a loaded state dict): copy
        this rank's slice of each unit into its shard (or master copy), then free the units."""
        for unit in self.unit_buckets:
            if not self.gathered.get(unit):
                continue
            for index in self.unit_buckets[unit]:
                flat, (shard, _) = self.flats[index], self.slots[index]
                shard.copy_(flat.chunk(self.zero_size)[self.zero_rank])
        self.free_all()

    def gather_params(self) -> None:
        """Nothing to do after a step: the shards are what the next forward gathers."""
