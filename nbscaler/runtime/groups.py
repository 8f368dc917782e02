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

import weakref
from datetime import timedelta
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import torch.distributed as dist

from nbscaler.schedule.grid import RankGrid

_GROUPS: Dict[Tuple[int, ...], Callable[[], Any]] = {}
# The default group the cached groups were made from, and its collective timeout, which they share.
_WORLD: Optional["weakref.ref[dist.ProcessGroup]"] = None
_TIMEOUT: Optional[timedelta] = None


def _weak(group: Any) -> Callable[[], Any]:
    """A weak reference to ``group``; to ``new_group``'s answer for a non-member (a plain int
    marker, which cannot be referenced weakly and holds nothing), a function returning it."""
    return weakref.ref(group) if isinstance(group, dist.ProcessGroup) else (lambda: group)


class WeakGroup:
    """An attribute that holds a process group (or None) by weak reference, for objects such as a
    reducer that outlive the group when a script destroys it and exits (see the module docstring).

    >>> class Reducer:
    ...     group = WeakGroup()
    >>> r = Reducer(); r.group = None; print(r.group)
    None
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_weak_" + name

    def __get__(self, obj: Any, owner: Optional[type] = None) -> Any:
        if obj is None:
            return self
        ref = getattr(obj, self.slot)
        if ref is None:
            return None
        group = ref()
        if group is None:
            raise RuntimeError("this object's process group was destroyed (destroy_process_group): "
                               "initialise the process group again and parallelize again to use it.")
        return group

    def __set__(self, obj: Any, group: Optional[dist.ProcessGroup]) -> None:
        setattr(obj, self.slot, None if group is None else _weak(group))


def get_group(ranks: Sequence[int]) -> Optional[dist.ProcessGroup]:
    """The group of ``ranks``; ``None`` for a single rank (collectives over it are no-ops)."""
    ranks = tuple(sorted(ranks))
    if len(ranks) <= 1 or not dist.is_initialized():
        return None
    _forget_groups_of_an_old_world()
    if ranks not in _GROUPS:
        group = dist.new_group(list(ranks), timeout=_TIMEOUT)      # torch's registry holds it
        _GROUPS[ranks] = _weak(group)
        return group
    return _GROUPS[ranks]()


def reset() -> None:
    """Forget every group (after ``destroy_process_group``)."""
    global _WORLD, _TIMEOUT
    _GROUPS.clear()
    _WORLD = _TIMEOUT = None


def _forget_groups_of_an_old_world() -> None:
    """Empty the cache when the default group is not the one its groups were made from."""
    global _WORLD, _TIMEOUT
    world = dist.group.WORLD
    if _WORLD is None or world is not _WORLD():
        _GROUPS.clear()
        _WORLD, _TIMEOUT = weakref.ref(world), _timeout_of(world)


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


def strided_ranks(rank: int, stride: int, world_size: int) -> Tuple[int, ...]:
    """``rank % stride`` and every ``stride``-th rank after it."""
    return tuple(range(rank % stride, world_size, stride))


def ensure_groups(grid: RankGrid, device_sets: Sequence[Sequence[int]] = ()) -> None:
    """Create, on every rank and in one fixed order, every group a plan can use
    (``RankGrid.groups``: each device set of each unit, each whole unit, each data-parallel set and,
    with ZeRO, the groups that shard optimizer state and those that hold the same shard)."""
    for ranks in grid.groups(device_sets):
        get_group(ranks)
