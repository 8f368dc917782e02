"""Process groups, created once per rank set and shared by every parallel module of the process.

``torch.distributed.new_group`` is collective: every rank must call it, in the same order, for every
group, member or not. Modules therefore ask for all their groups in a fixed order, and this cache
makes a second request for the same ranks free (and not collective).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import torch.distributed as dist

_GROUPS: Dict[Tuple[int, ...], Optional[dist.ProcessGroup]] = {}


def unit_ranks(unit: int, devices: Sequence[int], plan_ngpus: int) -> Tuple[int, ...]:
    """The runtime ranks that play plan ``devices`` in data-parallel unit ``unit``."""
    return tuple(unit * plan_ngpus + d for d in devices)


def get_group(ranks: Sequence[int]) -> Optional[dist.ProcessGroup]:
    """The group of ``ranks``; ``None`` for a single rank (collectives over it are no-ops)."""
    ranks = tuple(sorted(ranks))
    if len(ranks) <= 1 or not dist.is_initialized():
        return None
    if ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(list(ranks))
    return _GROUPS[ranks]


def reset() -> None:
    """Forget every group (after ``destroy_process_group``)."""
    _GROUPS.clear()


def dp_ranks(device: int, plan_ngpus: int, runtime_ngpus: int) -> Tuple[int, ...]:
    """The ranks that hold the same shard (plan ``device``) in every unit."""
    return tuple(u * plan_ngpus + device for u in range(runtime_ngpus // plan_ngpus))


def ensure_groups(plan_ngpus: int, runtime_ngpus: int, device_sets: Sequence[Sequence[int]] = ()) -> None:
    """Create, on every rank and in one fixed order, every group a plan can use: each device set of
    each unit, each whole unit, and each data-parallel set of ranks."""
    units = runtime_ngpus // plan_ngpus
    for u in range(units):
        for devices in device_sets:
            get_group(unit_ranks(u, devices, plan_ngpus))
        get_group(unit_ranks(u, range(plan_ngpus), plan_ngpus))
    for d in range(plan_ngpus):
        get_group(dp_ranks(d, plan_ngpus, runtime_ngpus))
