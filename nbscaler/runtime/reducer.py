"""``Reducer``: sums the gradients of replicated parameters across data-parallel ranks.

Gradients are packed into flat buckets of about ``bucket_mb`` megabytes, so that a model with
hundreds of small parameters costs a few large all-reduces rather than hundreds of small ones.
Hooks see each flat bucket before and after the all-reduce; a classic use is scaling down before
the sum and back up after it, to keep fp16 gradients from overflowing.

A reducer also says what the optimizer updates: here every parameter whole (``optimizer_slots``);
``nbscaler.runtime.zero.ZeroReducer`` hands out slices of the buckets instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

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

    def flat_grads(self, size: int) -> torch.Tensor:
        """The gradients end to end, zero-padded to ``size`` elements (a missing gradient is zeros,
        because every rank must send the same layout)."""
        first = self.params[0]
        flat = torch.zeros(size, dtype=first.dtype, device=first.device)
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
                 bucket_mb: float = 25.0):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.pre_hooks: List[GradHook] = []
        self.post_hooks: List[GradHook] = []
        # Called when a bucket's gradients are all held, just before a reduce that frees them
        # (ZeRO's): the most gradients a rank holds, where ``MemoryMeter`` counts them.
        self.observers: List[Callable[[], None]] = []
        self.buckets: List[Bucket] = []
        limit, size, current = bucket_mb * 2**20, 0, []
        for p in self.params:
            nbytes = p.numel() * p.element_size()
            if current and (size + nbytes > limit or p.dtype != current[0].dtype):
                self.buckets.append(Bucket(current))
                current, size = [], 0
            current.append(p)
            size += nbytes
        if current:
            self.buckets.append(Bucket(current))

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
            return
        for i, bucket in enumerate(self.buckets):
            flat = bucket.flat_grads(self._padded(bucket))
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
        self.buckets[index].set_grads(reduced)

    def zero_grad(self) -> None:
        """Forget gradient state kept outside the parameters (none here; ZeRO keeps shards)."""

    def optimizer_slots(self) -> List[Slot]:
        """What the optimizer updates on this rank, and which parameter elements each entry holds."""
        return [(p, [Segment(p, 0, p.numel(), 0)]) for p in self.params]

    def gather_params(self) -> None:
        """After a step, bring parameters up to date from what the optimizer updated (nothing to do
        when it updated the parameters themselves)."""

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
