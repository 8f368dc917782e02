"""Process groups, created once per rank set and shared by every parallel module of the process.

``torch.distributed.new_group`` is collective: every rank must call it, in the same order, for every
group, member or not. Modules therefore ask for all their groups in a fixed order, and this cache
makes a second request for the same ranks free (and not collective).

The cache belongs to one default process group. When that group is destroyed and a new one is
initialised (a notebook cluster does so after a rank failed, a collective timed out or a cell was
interrupted), the groups made from the old one are unusable, so the cache notices the new default
group and starts again empty instead of handing out groups that are no longer registered.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Dict, Optional, Sequence, Tuple

import torch.distributed as dist

_GROUPS: Dict[Tuple[int, ...], Optional[dist.ProcessGroup]] = {}
# The default group the cached groups were made from, and its collective timeout, which they share.
_WORLD: Optional[dist.ProcessGroup] = None
_TIMEOUT: Optional[timedelta] = None


def unit_ranks(unit: int, devices: Sequence[int], plan_ngpus: int) -> Tuple[int, ...]:
    """The runtime ranks that play plan ``devices`` in data-parallel unit ``unit``."""
    return tuple(unit * plan_ngpus + d for d in devices)


def get_group(ranks: Sequence[int]) -> Optional[dist.ProcessGroup]:
    """The group of ``ranks``; ``None`` for a single rank (collectives over it are no-ops)."""
    ranks = tuple(sorted(ranks))
    if len(ranks) <= 1 or not dist.is_initialized():
        return None
    _forget_groups_of_an_old_world()
    if ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(list(ranks), timeout=_TIMEOUT)
    return _GROUPS[ranks]


def reset() -> None:
    """Forget every group (after ``destroy_process_group``)."""
    global _WORLD, _TIMEOUT
    _GROUPS.clear()
    _WORLD = _TIMEOUT = None


def _forget_groups_of_an_old_world() -> None:
    """Empty the cache when the default group is not the one its groups were made from."""
    global _WORLD, _TIMEOUT
    world = dist.group.WORLD
    if world is not _WORLD:
        _GROUPS.clear()
        _WORLD, _TIMEOUT = world, _timeout_of(world)


def _timeout_of(group: dist.ProcessGroup) -> Optional[timedelta]:
    """The collective timeout ``group`` was created with.

    ``new_group`` does not inherit it: without this, a collective of a subgroup would wait for a
    missing peer for torch's default (30 minutes) instead of the timeout the job asked for.
    """
    for device in group._device_types:
        options = getattr(group._get_backend(device), "options", None)
        if options is not None and getattr(options, "_timeout", None) is not None:
            return options._timeout
    return None


def dp_ranks(device: int, plan_ngpus: int, runtime_ngpus: int) -> Tuple[int, ...]:
    """The ranks that hold the same shard (plan ``device``) in every unit."""
    return tuple(u * plan_ngpus + device for u in range(runtime_ngpus // plan_ngpus))


def zero_ranks(rank: int, plan_ngpus: int, runtime_ngpus: int, zero_ngroups: int) -> Tuple[int, ...]:
    """The ranks that split ``rank``'s optimizer state between them under ZeRO.

    The data-parallel ranks of ``rank``'s plan device are cut into ``zero_ngroups`` runs of
    consecutive units; each run shards the state once, so every run holds a whole copy.
    """
    same_shard = dp_ranks(rank % plan_ngpus, plan_ngpus, runtime_ngpus)
    size = len(same_shard) // zero_ngroups
    first = (rank // plan_ngpus) // size * size
    return same_shard[first:first + size]


def zero_replica_ranks(rank: int, plan_ngpus: int, runtime_ngpus: int, zero_ngroups: int) -> Tuple[int, ...]:
    """The ranks that hold the same ZeRO shard as ``rank``: one in each of the ``zero_ngroups`` groups."""
    same_shard = dp_ranks(rank % plan_ngpus, plan_ngpus, runtime_ngpus)
    size = len(same_shard) // zero_ngroups
    position = (rank // plan_ngpus) % size
    return same_shard[position::size]


def strided_ranks(rank: int, stride: int, world_size: int) -> Tuple[int, ...]:
    """``rank % stride`` and every ``stride``-th rank after it."""
    return tuple(range(rank % stride, world_size, stride))


def ensure_groups(plan_ngpus: int, runtime_ngpus: int, device_sets: Sequence[Sequence[int]] = (),
                  zero_ngroups: Optional[int] = None) -> None:
    """Create, on every rank and in one fixed order, every group a plan can use: each device set of
    each unit, each whole unit, each data-parallel set of ranks and, with ZeRO (``zero_ngroups``
    given), the groups that shard optimizer state and the groups that hold the same shard."""
    units = runtime_ngpus // plan_ngpus
    for u in range(units):
        for devices in device_sets:
            get_group(unit_ranks(u, devices, plan_ngpus))
        get_group(unit_ranks(u, range(plan_ngpus), plan_ngpus))
    for d in range(plan_ngpus):
        get_group(dp_ranks(d, plan_ngpus, runtime_ngpus))
    if zero_ngroups is not None:
        for rank in range(runtime_ngpus):
            get_group(zero_ranks(rank, plan_ngpus, runtime_ngpus, zero_ngroups))
            get_group(zero_replica_ranks(rank, plan_ngpus, runtime_ngpus, zero_ngroups))
