"""Timed blocks: the one row format of predicted and measured pipeline timelines.

The simulator predicts when each block runs; the runtime measures it. Both produce rows
``(rank, stage, micro, phase, t_start, t_end)``, so a notebook can put the two on the same axes and
compute the same numbers from either, for instance the bubble fraction.

A predicted timeline may also hold the collectives a rank runs beside its blocks
(``Timeline.collectives``): ZeRO stage 3's all-gathers and reduce-scatters, each named with its
unit (``cost.fsdp``), whose waits a block's time includes; and the data-parallel gradient
synchronisation (``sync=True``: each bucket's all-reduce, or ZeRO's reduce-scatter and the
all-gather after the optimizer step, ``cost.timing.sync_spans``), whose exposed part follows the
blocks; and a context-parallel attention's ring passes, or the all-gathers of its keys and values
(``cost.context_calls``), at the attention's place in its blocks; and an expert-parallel op's
all-to-alls (``cost.expert_calls``), where the op runs them. None changes a block count, the
makespan or the bubble.

>>> line = Timeline.from_rows([
...     {"rank": 0, "stage": 0, "micro": 0, "phase": "F", "t_start": 0.0, "t_end": 1.0},
...     {"rank": 1, "stage": 1, "micro": 0, "phase": "F", "t_start": 1.0, "t_end": 2.0},
... ])
>>> line.makespan, line.bubble_fraction
(2.0, 0.5)
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping, Optional

from nbscaler.schedule.block import Block, Phase


@dataclass(frozen=True)
class TimedBlock:
    """Block ``(stage, micro, phase)`` ran on ``rank`` from ``t_start`` to ``t_end`` (seconds, or cost units)."""

    rank: int
    stage: int
    micro: int
    phase: Phase
    t_start: float
    t_end: float

    @property
    def block(self) -> Block:
        return Block(self.stage, self.micro, self.phase)

    @property
    def duration(self) -> float:
        return self.t_end - self.t_start


@dataclass(frozen=True)
class CollectiveBlock:
    """A collective ``rank`` runs beside its compute during block ``(stage, micro, phase)``:
    ``kind`` (``'all_gather'``, ``'reduce_scatter'`` or ``'all_reduce'``) of ZeRO stage 3's ``unit``,
    from ``t_start`` to ``t_end``; ``waited_s``: the seconds the rank waits for it (its exposed
    part; 0 where the compute hides it).

    ``sync``: one bucket of the data-parallel gradient synchronisation instead (``unit`` names the
    bucket, ``'bucket 0'`` holding the first parameters; ``'partial 0'`` a bucket of partial
    gradients summed inside the unit); its block is the rank's last, and what it waits for comes
    after the blocks, in the step's exposed synchronisation (``DeviceStep.sync_s``).

    ``context``: a collective of a context-parallel attention instead (``cost.context_calls``):
    ``kind`` ``'ring_pass'`` for one step of its ring (``unit`` says which, and whose keys and
    values it brings), or the all-gather of its keys or values and the reduce-scatter of their
    gradients. ``kind`` ``'expert_exchange'`` or ``'expert_counts'`` (``context`` False): an
    expert-parallel op's all-to-all of its rows or of its per-expert counts (``cost.expert_calls``)."""

    rank: int
    stage: int
    micro: int
    phase: Phase
    kind: str
    unit: str
    t_start: float
    t_end: float
    waited_s: float
    sync: bool = False
    context: bool = False

    @property
    def duration(self) -> float:
        return self.t_end - self.t_start


@dataclass(frozen=True)
class Timeline:
    """The timed blocks of one pipeline step on ``nranks`` ranks.

    Time is measured from the earliest start, so measured timelines with wall-clock stamps and
    simulated ones starting at 0 give the same ``makespan`` and ``bubble_fraction``.
    """

    blocks: tuple[TimedBlock, ...]
    nranks: int
    collectives: tuple[CollectiveBlock, ...] = ()

    @classmethod
    def from_rows(cls, rows: Iterable[Mapping[str, Any]], nranks: Optional[int] = None) -> "Timeline":
        """A timeline from telemetry rows (dicts, or ``DataFrame.to_dict('records')``).

        ``nranks`` defaults to one more than the largest rank seen; pass it when a rank may have
        recorded nothing, since its idle time counts towards the bubble.
        """
        blocks = tuple(TimedBlock(**{name: row[name] for name in TimedBlock.__dataclass_fields__}) for row in rows)
        if nranks is None:
            nranks = max((b.rank for b in blocks), default=-1) + 1
        return cls(blocks, nranks)

    def to_rows(self) -> list[dict[str, Any]]:
        """One dict per timed block, ready for ``pandas.DataFrame(timeline.to_rows())``."""
        return [asdict(b) for b in self.blocks]

    def collective_rows(self) -> list[dict[str, Any]]:
        """One dict per collective beside the blocks (``collectives``), for a ``DataFrame``."""
        return [asdict(c) for c in self.collectives]

    @functools.cached_property              # a sweep asks it several times per configuration
    def makespan(self) -> float:
        """Time from the first start to the last end."""
        if not self.blocks:
            return 0.0
        return max(b.t_end for b in self.blocks) - min(b.t_start for b in self.blocks)

    @property
    def busy_time(self) -> float:
        """Total time the ranks spent running blocks, summed over ranks."""
        return sum(b.duration for b in self.blocks)

    @property
    def bubble_fraction(self) -> float:
        """The share of rank time spent idle: ``idle / (nranks * makespan)`` (never below 0: the busy
        time's rounding may pass the makespan's by a hair, which would print as -0%)."""
        capacity = self.nranks * self.makespan
        return max(0.0, (capacity - self.busy_time) / capacity) if capacity > 0 else 0.0
