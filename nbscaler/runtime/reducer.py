"""``Reducer``: sums the gradients of replicated parameters across data-parallel ranks.

Gradients are packed into flat buckets of at most ``bucket_bytes`` (``ComputeConfig.reduce_bucket_bytes``,
by ``nbscaler.config.split_buckets``), so that a model with hundreds of small parameters costs a few
large all-reduces rather than hundreds of small ones, and the packed copy in the reduction dtype
exists one bucket at a time, not for the whole model.
Hooks see each flat bucket before and after the all-reduce; a classic use is scaling down before
the sum and back up after it, to keep fp16 gradients from overflowing.

A reducer also says what the optimizer updates: here every parameter whole (``optimizer_slots``);
``nbscaler.runtime.zero.ZeroReducer`` hands out slices of the buckets instead.

Mixed precision (``set_precision``): gradients are summed in the precision's reduction dtype, and
where it asks for master copies (bf16 parameters, fp32 masters) the optimizer updates a copy of
each parameter in the master dtype: the summed gradient goes to the copy, unrounded, the module's
own gradient is freed, and ``gather_params`` copies the updated values back into the parameters.
Gradients are accumulated over micro-batches in the module's dtype (autograd adds them into the
parameters' ``.grad``); only the sum across ranks and everything after it is in higher precision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from nbscaler.config import DEFAULT_BUCKET_BYTES, split_buckets
from nbscaler.recipe import AS_HELD, Recipe
from nbscaler.runtime.groups import WeakGroup

GradHook = Callable[["Reducer", torch.Tensor], None]


@dataclass(eq=False)
class Segment:
    """Elements ``[start, start + length)`` of ``param`` (flattened), stored from ``offset`` on in an
    optimizer parameter. A whole parameter is one segment; a ZeRO shard is a run of them."""

    param: torch.nn.Parameter
    start: int
    length: int
    offset: int


Slot = Tuple[torch.nn.Parameter, List[Segment]]     # an optimizer parameter and what it holds


class Bucket:
    """Parameters of one dtype whose gradients travel together as one flat tensor."""

    def __init__(self, params: List[torch.nn.Parameter]):
        self.params = params
        self.offsets: List[int] = []
        self.numel = 0
        for p in params:
            self.offsets.append(self.numel)
            self.numel += p.numel()

    @property
    def dtype(self) -> torch.dtype:
        return self.params[0].dtype

    def flat_grads(self, size: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """The gradients end to end in ``dtype`` (default: the parameters'), zero-padded to ``size``
        elements (a missing gradient is zeros, because every rank must send the same layout)."""
        first = self.params[0]
        flat = torch.zeros(size, dtype=dtype or first.dtype, device=first.device)
        for p, offset in zip(self.params, self.offsets):
            if p.grad is not None:
                flat[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
        return flat

    def set_grads(self, flat: torch.Tensor) -> None:
        for p, offset in zip(self.params, self.offsets):
            if p.grad is None:
                p.grad = torch.empty_like(p)
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))

    def set_params(self, flat: torch.Tensor) -> None:
        for p, offset in zip(self.params, self.offsets):
            p.detach().copy_(flat[offset:offset + p.numel()].view_as(p))

    def segments(self, begin: int, end: int) -> List[Segment]:
        """The parts of this bucket's parameters that fall in flat elements ``[begin, end)``."""
        out = []
        for p, offset in zip(self.params, self.offsets):
            lo, hi = max(begin, offset), min(end, offset + p.numel())
            if lo < hi:
                out.append(Segment(p, lo - offset, hi - lo, lo - begin))
        return out


class Reducer:
    group = WeakGroup()          # the ranks gradients are summed over; None: this rank alone

    def __init__(self, params: List[torch.nn.Parameter], group: Optional[dist.ProcessGroup],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, groups: Optional[List[List[torch.nn.Parameter]]] = None):
        """``groups``: the buckets, each a list of parameters of one dtype, where the caller decides
        them (ZeRO-3's units); else ``params`` cut by ``bucket_bytes``."""
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.pre_hooks: List[GradHook] = []
        self.post_hooks: List[GradHook] = []
        # Called when a bucket's gradients are all held, just before a reduce that frees them
        # (ZeRO's): the most gradients a rank holds, where ``MemoryMeter`` counts them.
        self.observers: List[Callable[[], None]] = []
        self.precision: Recipe = AS_HELD
        self.masters: Dict[int, torch.nn.Parameter] = {}     # id(param) -> its master copy
        if groups is not None:
            self.buckets = [Bucket(g) for g in groups if g]
            return
        sizes = [(p.numel() * p.element_size(), p.dtype) for p in self.params]
        self.buckets = [Bucket([self.params[i] for i in run]) for run in split_buckets(sizes, bucket_bytes)]

    def set_precision(self, precision: Recipe, masters: bool = True) -> None:
        """Sum gradients in ``precision``'s reduction dtype and, with ``masters``, let the optimizer
        update master copies of the parameters (call before the optimizer reads ``optimizer_slots``)."""
        self.precision = precision
        if masters:
            self._make_masters()

    @torch.no_grad()
    def _make_masters(self) -> None:
        self.masters = {id(p): torch.nn.Parameter(p.detach().to(dtype)) for p in self.params
                        if (dtype := self.precision.master_of(p.dtype)) is not None}

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Copy the parameters into their master copies (after new weights were loaded into them)."""
        for p in self.params:
            if id(p) in self.masters:
                self.masters[id(p)].copy_(p)

    def reduce_dtype(self, bucket: Bucket) -> torch.dtype:
        return self.precision.reduce_dtype(bucket.dtype)

    @property
    def world_size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @torch.no_grad()
    def sync(self) -> None:
        """Sum every gradient over the group, running the hooks on each flat bucket.

        Over a single rank (no group) and with no hooks the sum is the gradient itself, so nothing
        is copied: packing every gradient into a bucket and back would cost two passes over them
        each step (a pipeline stage without data parallelism paid that for nothing).
        """
        if self.group is None and not self.pre_hooks and not self.post_hooks:
            for p in self.params:
                if id(p) in self.masters and p.grad is not None:
                    self._to_master(p, p.grad)
            return
        for i, bucket in enumerate(self.buckets):
            flat = bucket.flat_grads(self._padded(bucket), self.reduce_dtype(bucket))
            for hook in self.pre_hooks:
                hook(self, flat)
            reduced = self._reduce(flat)
            for hook in self.post_hooks:
                hook(self, reduced)
            self._deliver(i, reduced)

    def _padded(self, bucket: Bucket) -> int:
        return bucket.numel

    def _reduce(self, flat: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            dist.all_reduce(flat, group=self.group)
        return flat

    def _deliver(self, index: int, reduced: torch.Tensor) -> None:
        bucket = self.buckets[index]
        if not self.masters:
            bucket.set_grads(reduced)
            return
        for p, offset in zip(bucket.params, bucket.offsets):
            self._to_master(p, reduced[offset:offset + p.numel()].view_as(p))

    def _to_master(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """``grad`` becomes the master copy's gradient; the parameter's own is freed."""
        master = self.masters[id(param)]
        master.grad = grad.to(master.dtype)
        param.grad = None

    def zero_grad(self) -> None:
        """Forget gradient state kept outside the parameters: the master copies' gradients."""
        for master in self.masters.values():
            master.grad = None

    def optimizer_slots(self) -> List[Slot]:
        """What the optimizer updates on this rank, and which parameter elements each entry holds."""
        return [(self.masters.get(id(p), p), [Segment(p, 0, p.numel(), 0)]) for p in self.params]

    @torch.no_grad()
    def gather_params(self) -> None:
        """After a step, bring parameters up to date from what the optimizer updated: from the
        master copies (nothing to do when it updated the parameters themselves)."""
        for p in self.params:
            if id(p) in self.masters:
                p.copy_(self.masters[id(p)])

    @property
    def copies(self) -> int:
        """How many ranks of the group hold the same optimizer values as this one."""
        return self.world_size

    def grad_sq_sum(self, weight: Callable[[torch.nn.Parameter], float]) -> torch.Tensor:
        """This rank's share of the squared global gradient norm (float64, on the CPU).

        Each optimizer element counts ``weight(param) / copies`` times its square, so summing the
        shares of all ranks counts every element of the model once when ``weight`` is one over the
        number of devices of a unit that hold the element.
        """
        total = torch.zeros((), dtype=torch.float64)
        for slot, segments in self.optimizer_slots():
            if slot.grad is None:
                continue
            flat = slot.grad.detach().reshape(-1)
            for s in segments:
                piece = flat[s.offset:s.offset + s.length]
                total += weight(s.param) * piece.double().pow(2).sum().cpu()
        return total / self.copies
