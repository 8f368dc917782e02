"""ZeRO stages 1 and 2: split optimizer state (and gradients) over the ranks that hold the same part
of the model.

Without ZeRO every data-parallel rank keeps a whole optimizer state (for Adam, two more copies of
its parameters) and makes the same update as all the others. With ZeRO the ``N`` ranks of a *ZeRO
group* split the work. The parameters of each gradient bucket are stored end to end in one flat
tensor, padded to a multiple of ``N`` (the parameters become views of it), and rank ``i`` owns
slice ``i`` of it:

1. *reduce*: a bucket's gradients are packed into one flat tensor and *reduce-scattered* over the
   group, so rank ``i`` receives the summed gradient of slice ``i`` only, and the full gradients
   are freed. With ``zero_ngroups > 1`` the data-parallel ranks form several ZeRO groups, each
   holding a whole copy of the state, and the slice is then summed across them too (the *replica*
   group). Stage 1 reduces every bucket when the optimizer steps; stage 2 reduces each bucket as
   soon as the backward has produced all of its gradients, so the full gradients of the model
   never exist at once.
2. ``optimizer.step()`` updates slice ``i``: the optimizer's parameter, the *shard*, is a view of
   the flat parameters, so the update lands in the module's own parameters and the optimizer state
   it creates is ``1/N`` of the full one.
3. ``gather_params``: every rank's updated slice is all-gathered into the flat parameters.

Per rank that is the parameters, ``1/N`` of the gradients (after the step) and ``1/N`` of the
optimizer state, and no second copy of anything. At its peak a rank holds more gradients than that
(``nbscaler.columns.StepMoment``): under stage 1 all of them from the end of the backward until the
step reduces them; under stage 2 the full gradients of the buckets the backward is producing,
which is all of them for a model that fits in one bucket (``ComputeConfig.reduce_bucket_bytes``
sets the size). With master copies (``set_precision``:
bf16 parameters, fp32 masters) the shard is instead an fp32 copy of slice ``i``: the reduced
gradient lands on it unrounded, the optimizer updates it, and ``gather_params`` all-gathers it
back in the parameters' dtype; the copy is ``1/N`` of the parameters, as the state is.

Nothing here looks at which device holds which part of the model: the groups are the
data-parallel ranks of one plan device, and the buckets hold whatever parameters that device has.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Set

import torch
import torch.distributed as dist

from nbscaler.config import DEFAULT_BUCKET_BYTES
from nbscaler.runtime.collectives import reduce_scatter_into
from nbscaler.runtime.groups import WeakGroup
from nbscaler.runtime.reducer import Bucket, Reducer, Slot


def _size_rank(group: Optional[dist.ProcessGroup]):
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


@torch.no_grad()
def flatten_params(bucket: Bucket, size: int) -> torch.Tensor:
    """Move the bucket's parameters into one zero-padded flat tensor of ``size`` elements and make
    each parameter a view of its part; returns the flat tensor."""
    first = bucket.params[0]
    flat = torch.zeros(size, dtype=first.dtype, device=first.device)
    for p, offset in zip(bucket.params, bucket.offsets):
        part = flat[offset:offset + p.numel()]
        part.copy_(p.detach().reshape(-1))
        p.data = part.view_as(p)
    return flat


class ZeroReducer(Reducer):
    """A ``Reducer`` whose optimizer parameters are this rank's slices of the flat bucket parameters.

    ``group``: every data-parallel rank of this plan device (gradients are summed over all of them);
    ``zero_group``: the ranks that split the state; ``replica_group``: the ranks, one per ZeRO
    group, that hold the same slice; ``stage``: 1 or 2 (see the module docstring); ``shares``:
    ``id(param) -> factor`` for parameters whose whole gradient several ranks of the ZeRO group
    hold, each sending that share of it (``nbscaler.runtime.grad_sync.zero_over_stage_shares``).

    Under stage 2 every data-parallel rank must run the same backwards (as with DDP): the
    reduce-scatters run inside them.
    """

    zero_group = WeakGroup()
    replica_group = WeakGroup()

    def __init__(self, params: List[torch.nn.Parameter], group: Optional[dist.ProcessGroup],
                 zero_group: Optional[dist.ProcessGroup], replica_group: Optional[dist.ProcessGroup],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, stage: int = 1,
                 groups: Optional[List[List[torch.nn.Parameter]]] = None,
                 shares: Optional[Dict[int, float]] = None):
        super().__init__(params, group, bucket_bytes, groups)
        self.zero_group, self.replica_group, self.stage = zero_group, replica_group, stage
        # id(param) -> the share of its gradient this rank sends, where several ranks of the ZeRO
        # group hold the same whole gradient (``nbscaler.runtime.grad_sync``): their shares sum to it
        self.shares: Dict[int, float] = dict(shares or {})
        self.zero_size, self.zero_rank = _size_rank(zero_group)
        self.flats: List[torch.Tensor] = []
        self.slots: List[Slot] = []
        for bucket in self.buckets:
            flat = self._flatten(bucket)
            length = flat.numel() // self.zero_size
            begin = self.zero_rank * length
            self.flats.append(flat)
            self.slots.append((self._shard(flat, begin, length), bucket.segments(begin, begin + length)))
        self.produced: List[Set[int]] = [set() for _ in self.buckets]    # params with a gradient to reduce
        if stage >= 2:
            for index, bucket in enumerate(self.buckets):
                for p in bucket.params:
                    p.register_post_accumulate_grad_hook(self._on_gradient(index))

    def _padded(self, bucket: Bucket) -> int:
        return -(-bucket.numel // self.zero_size) * self.zero_size

    def _flatten(self, bucket: Bucket) -> torch.Tensor:
        """The bucket's flat tensor, its parameters made views of it (``flatten_params``)."""
        return flatten_params(bucket, self._padded(bucket))

    def _shard(self, flat: torch.Tensor, begin: int, length: int) -> torch.nn.Parameter:
        """This rank's slice of ``flat``: a view, so the update lands in the parameters."""
        return torch.nn.Parameter(flat[begin:begin + length])

    @torch.no_grad()
    def _make_masters(self) -> None:
        """Each shard's master copy takes its place as the optimizer's parameter."""
        for index, (shard, segments) in enumerate(self.slots):
            dtype = self.precision.master_of(shard.dtype)
            if dtype is not None:
                master = torch.nn.Parameter(shard.detach().to(dtype))
                self.slots[index] = (master, segments)
                self.masters[id(master)] = master

    @torch.no_grad()
    def refresh_masters(self) -> None:
        for flat, (shard, _) in zip(self.flats, self.slots):
            if id(shard) in self.masters:
                shard.copy_(flat.chunk(self.zero_size)[self.zero_rank])

    # -- reducing ---------------------------------------------------------------------------------
    def _on_gradient(self, index: int):
        """The stage-2 hook of bucket ``index``: reduce the bucket once all its gradients are in."""
        bucket, produced = self.buckets[index], self.produced[index]

        def hook(param: torch.nn.Parameter) -> None:
            if id(param) in produced:        # a new backward before the bucket was complete
                self._reduce_bucket(index)
            produced.add(id(param))
            if len(produced) == len(bucket.params):
                self._reduce_bucket(index)
        return hook

    @torch.no_grad()
    def _reduce_bucket(self, index: int) -> None:
        """Reduce-scatter the bucket's gradients, add this rank's slice to its shard's gradient and
        free the full gradients."""
        for observe in self.observers:
            observe()
        bucket = self.buckets[index]
        flat = bucket.flat_grads(self._padded(bucket), self.reduce_dtype(bucket))
        for p, offset in zip(bucket.params, bucket.offsets):
            if id(p) in self.shares:
                flat[offset:offset + p.numel()] *= self.shares[id(p)]
        for p in bucket.params:
            p.grad = None
        for hook in self.pre_hooks:
            hook(self, flat)
        reduced = self._reduce(flat)
        for hook in self.post_hooks:
            hook(self, reduced)
        shard = self.slots[index][0]
        reduced = reduced.to(shard.dtype)
        shard.grad = reduced if shard.grad is None else shard.grad.add_(reduced)
        self.produced[index].clear()

    def check_views(self) -> None:
        """Raise unless every parameter still lives in its bucket's flat tensor (``module.to(...)``
        or ``.half()`` after construction gives parameters new storage the optimizer never sees)."""
        for bucket, flat in zip(self.buckets, self.flats):
            where = flat.untyped_storage().data_ptr()
            if any(p.untyped_storage().data_ptr() != where for p in bucket.params):
                raise RuntimeError(
                    "a parameter of this ZeRO module was given new storage after it was built (module.to(), "
                    ".half() or assigning .data?), so the optimizer would update a stale copy; convert the "
                    "model before compiling instead (parallelize(..., module_dtype=...)).")

    def sync(self) -> None:
        """Reduce what is left: every bucket under stage 1; under stage 2 the buckets the backward
        did not complete (some parameters got no gradient) or never reached."""
        self.check_views()
        for index, (shard, _) in enumerate(self.slots):
            if self.stage == 1 or self.produced[index] or shard.grad is None:
                self._reduce_bucket(index)

    def _reduce(self, flat: torch.Tensor) -> torch.Tensor:
        if self.zero_group is None:
            piece = flat
        else:
            piece = torch.empty(flat.numel() // self.zero_size, dtype=flat.dtype, device=flat.device)
            reduce_scatter_into(piece, flat, self.zero_group)
        if self.replica_group is not None:
            dist.all_reduce(piece, group=self.replica_group)
        return piece

    def zero_grad(self) -> None:
        """Forget the shards' gradients and what the backward produced (with the module's)."""
        for shard, _ in self.slots:
            shard.grad = None
        for produced in self.produced:
            produced.clear()

    # -- what the optimizer sees ----------------------------------------------------------------
    def optimizer_slots(self) -> List[Slot]:
        return self.slots

    @torch.no_grad()
    def gather_params(self) -> None:
        for flat, (shard, _) in zip(self.flats, self.slots):
            if self.zero_group is None:
                if id(shard) in self.masters:        # else the shard is the flat tensor: already in place
                    flat.copy_(shard)
                continue
            mine = shard.detach().to(flat.dtype, copy=True)
            dist.all_gather(list(flat.chunk(self.zero_size)), mine, group=self.zero_group)

    @property
    def copies(self) -> int:
        return _size_rank(self.replica_group)[0]
