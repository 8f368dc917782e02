"""``Reducer``: sums the gradients of replicated parameters across data-parallel ranks.

Gradients are packed into flat buckets of about ``bucket_mb`` megabytes, so that a model with
hundreds of small parameters costs a few large all-reduces rather than hundreds of small ones.
Hooks see each flat bucket before and after the all-reduce; a classic use is scaling down before
the sum and back up after it, to keep fp16 gradients from overflowing.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
import torch.distributed as dist

GradHook = Callable[["Reducer", torch.Tensor], None]


class Reducer:
    def __init__(self, params: List[torch.nn.Parameter], group: Optional[dist.ProcessGroup],
                 bucket_mb: float = 25.0):
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.pre_hooks: List[GradHook] = []
        self.post_hooks: List[GradHook] = []
        self.buckets: List[List[torch.nn.Parameter]] = []
        limit, size = bucket_mb * 2**20, 0
        for p in self.params:
            nbytes = p.numel() * p.element_size()
            if not self.buckets or size + nbytes > limit or p.dtype != self.buckets[-1][0].dtype:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += nbytes

    @property
    def world_size(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @torch.no_grad()
    def sync(self) -> None:
        """All-reduce (sum) every gradient over the group, running the hooks on each bucket."""
        for bucket in self.buckets:
            for p in bucket:
                if p.grad is None:          # every rank must send the same bucket layout
                    p.grad = torch.zeros_like(p)
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            for hook in self.pre_hooks:
                hook(self, flat)
            if self.group is not None:
                dist.all_reduce(flat, group=self.group)
            for hook in self.post_hooks:
                hook(self, flat)
            offset = 0
            for p in bucket:
                n = p.numel()
                p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
                offset += n
