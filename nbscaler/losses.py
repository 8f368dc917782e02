"""The loss of a split batch or sequence: each device computes its own tokens' part of the mean.

Where a plan splits the tokens of a mean cross-entropy over a group (the batch under ``data`` and
expert parallelism, the sequence under context parallelism), gathering the ``(N, C)`` logits would
bring every device all of them, a vocabulary wide. ``split_cross_entropy`` instead divides this
device's sum by the count of counted tokens in the whole group (one all-reduce of an integer): the
devices' results are partial sums of the loss, which the generated code's ``all_reduce`` completes,
and each device's backward starts from its own logits' part.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["split_cross_entropy"]


def split_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group: Optional[dist.ProcessGroup],
                        ignore_index: int = -100) -> torch.Tensor:
    """This device's part of the mean cross-entropy of the group's tokens (the parts sum to it);
    ``group=None`` counts this device's tokens alone (the cost model's fake call)."""
    total = F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")
    count = (targets != ignore_index).sum()
    if group is not None:
        count = count.clone()
        dist.all_reduce(count, group=group)
    return total / count.clamp(min=1)
