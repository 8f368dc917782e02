"""The rank grid: every question of the form "which ranks?" answered in one place.

A run has ``runtime_ngpus`` ranks cut into *units* of ``plan_ngpus`` consecutive ranks; each unit
holds one whole copy of the model, and rank ``r`` plays plan device ``r % plan_ngpus`` of unit
``r // plan_ngpus``. Ranks playing the same plan device in different units hold the same shard:
they are data-parallel copies and sum their gradients. Under ZeRO those copies are cut into
``zero_ngroups`` runs of consecutive units, and each run splits the optimizer state once. Under
context parallelism every device of a stage holds the same weights too (each computes their
gradients on its part of the sequence), so ZeRO then splits over those devices of every unit of
the run as well (``zero_over_stage``), as torchtitan's FSDP shards over its data- and
context-parallel ranks together.
With a pipeline, :attr:`RankGrid.pipeline` says where the stages sit among a unit's plan devices
(:class:`~nbscaler.schedule.geometry.PipelineGeometry`).

Like torchtitan's ``ParallelDims``, the grid is a small frozen object that checks itself; the
config builds it (``ComputeConfig.grid``) and the runtime, the planner and the cost model ask it.

>>> grid = RankGrid(plan_ngpus=2, runtime_ngpus=8, zero_ngroups=2)
>>> grid.units, grid.unit_of(5), grid.device_of(5)
(4, 2, 1)
>>> grid.dp_ranks(1)            # plan device 1 in every unit
(1, 3, 5, 7)
>>> grid.zero_ranks(5), grid.zero_replica_ranks(5)
((5, 7), (1, 5))
>>> RankGrid(plan_ngpus=2, runtime_ngpus=8, zero_ngroups=2, zero_over_stage=True).zero_ranks(5)
(4, 5, 6, 7)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, List, Optional, Tuple

from nbscaler.schedule.geometry import PipelineGeometry

Ranks = Tuple[int, ...]


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class RankGrid:
    """How ``runtime_ngpus`` ranks play the ``plan_ngpus`` devices of a plan.

    Attributes:
        plan_ngpus: devices of one copy of the model (a unit).
        runtime_ngpus: ranks in total, a multiple of ``plan_ngpus``.
        zero_ngroups: the groups ZeRO cuts each device's data-parallel ranks into; ``None``
            without ZeRO.
        pipeline: where the stages sit inside a unit; ``None`` without a pipeline.
        zero_over_stage: ZeRO also splits over the devices of each stage, which hold the same
            weights and sum their gradients (context parallelism); the reduce-scatter then makes
            that sum too.
        tensor_neighbours: under ``zero_over_stage``, a stage's devices are context-parallel groups
            of this many tensor-parallel neighbours, each holding its own slice of the weights: ZeRO
            then spans the devices at the same place in every group, which hold the same slice.
    """

    plan_ngpus: int
    runtime_ngpus: int
    zero_ngroups: Optional[int] = None
    pipeline: Optional[PipelineGeometry] = None
    zero_over_stage: bool = False
    tensor_neighbours: int = 1

    @staticmethod
    def problem(plan_ngpus: int, runtime_ngpus: int, zero_ngroups: Optional[int] = None) -> Optional[Tuple[str, str]]:
        """``(field, what is wrong and the fix)`` when these counts make no grid, else ``None``.
        ``ComputeConfig`` asks this when it checks itself, and so does the grid.

        >>> RankGrid.problem(2, 3)[0]
        'runtime_ngpus'
        """
        for name, value in (("plan_ngpus", plan_ngpus), ("runtime_ngpus", runtime_ngpus),
                            ("zero_ngroups", 1 if zero_ngroups is None else zero_ngroups)):
            if not _positive(value):
                return name, "it must be a positive integer."
        if runtime_ngpus % plan_ngpus:
            return "runtime_ngpus", (
                f"it must be a multiple of plan_ngpus={plan_ngpus} (each unit holds one whole copy of the plan); "
                f"use e.g. runtime_ngpus={plan_ngpus * max(1, runtime_ngpus // plan_ngpus)}.")
        units = runtime_ngpus // plan_ngpus
        if zero_ngroups is not None and units % zero_ngroups:
            return "zero_ngroups", (f"it must divide the number of data-parallel units ({units} = runtime_ngpus // "
                                    "plan_ngpus).")
        return None

    def __post_init__(self) -> None:
        problem = self.problem(self.plan_ngpus, self.runtime_ngpus, self.zero_ngroups)
        if problem is not None:
            name, fix = problem
            raise ValueError(f"RankGrid.{name}={getattr(self, name)!r} is invalid: {fix}")
        if self.pipeline is not None and self.pipeline.plan_ngpus != self.plan_ngpus:
            raise ValueError(f"RankGrid: the pipeline is laid out on {self.pipeline.plan_ngpus} plan devices, "
                             f"the grid has plan_ngpus={self.plan_ngpus}; build both from one config.")
        width = self.pipeline.tp if self.pipeline is not None else self.plan_ngpus
        if not _positive(self.tensor_neighbours) or width % self.tensor_neighbours:
            raise ValueError(f"RankGrid.tensor_neighbours={self.tensor_neighbours!r} must divide the {width} devices "
                             "of a stage into tensor-parallel groups.")
        if self.zero_over_stage and self.zero_ngroups is None:
            raise ValueError("RankGrid.zero_over_stage=True needs ZeRO groups: give zero_ngroups as well.")
        if self.zero_over_stage and self.pipeline is not None and self.pipeline.copy_groups():
            raise ValueError(f"RankGrid: '{self.pipeline.schedule.name}' keeps two copies of each stage, and ZeRO over "
                             "a stage's devices assumes one: use another scheduler with context parallelism and ZeRO.")

    # -- units and devices --------------------------------------------------------------------
    @property
    def units(self) -> int:
        """Data-parallel copies of the plan."""
        return self.runtime_ngpus // self.plan_ngpus

    def unit_of(self, rank: int) -> int:
        """The unit (copy of the model) ``rank`` belongs to; its ranks get the same input."""
        return rank // self.plan_ngpus

    def device_of(self, rank: int) -> int:
        """The plan device ``rank`` plays (ranks with equal devices hold equal shards)."""
        return rank % self.plan_ngpus

    def rank_of(self, unit: int, device: int) -> int:
        """The rank that plays plan ``device`` in ``unit``."""
        return unit * self.plan_ngpus + device

    def unit_ranks(self, unit: int, devices: Optional[Iterable[int]] = None) -> Ranks:
        """The ranks that play plan ``devices`` (by default all of them) in ``unit``."""
        devices = range(self.plan_ngpus) if devices is None else devices
        return tuple(self.rank_of(unit, d) for d in devices)

    def stage_group(self, stage: Optional[int]) -> Ranks:
        """The plan devices that run ``stage`` (every plan device without a pipeline, or for
        ``stage`` None: an op outside the stages)."""
        if self.pipeline is None or stage is None:
            return tuple(range(self.plan_ngpus))
        return self.pipeline.stage_group(stage)

    # -- data parallelism and ZeRO ------------------------------------------------------------
    def dp_ranks(self, device: int) -> Ranks:
        """The ranks that hold plan ``device``'s shard, one in every unit: they sum gradients."""
        return tuple(self.rank_of(u, device) for u in range(self.units))

    def same_weight_devices(self, device: int) -> Ranks:
        """The plan devices of a unit whose weights ZeRO treats as one copy with ``device``'s: the
        devices of its stage under ``zero_over_stage`` (without a pipeline, all of them), else
        ``device`` alone."""
        if not self.zero_over_stage:
            return (device,)
        if self.pipeline is None:
            stage = tuple(range(self.plan_ngpus))
        else:
            stage = self.pipeline.group_of([self.pipeline.pipeline_device(device)])
        t = self.tensor_neighbours
        return stage[stage.index(device) % t::t]

    @property
    def zero_units(self) -> int:
        """How many consecutive units one ZeRO group spans."""
        if self.zero_ngroups is None:
            raise ValueError("this grid has no ZeRO groups: build it with zero_ngroups (use_zero=True).")
        return self.units // self.zero_ngroups

    @property
    def zero_group_size(self) -> int:
        """How many ranks split one copy of the optimizer state under ZeRO."""
        return self.zero_units * len(self.same_weight_devices(0))

    def zero_ranks(self, rank: int) -> Ranks:
        """The ranks that split ``rank``'s optimizer state between them under ZeRO: in the run of
        ``zero_units`` consecutive units that holds ``rank``, those playing ``rank``'s plan device
        (and, under ``zero_over_stage``, the other devices of its stage), unit by unit."""
        size = self.zero_units
        first = self.unit_of(rank) // size * size
        devices = self.same_weight_devices(self.device_of(rank))
        return tuple(self.rank_of(u, d) for u in range(first, first + size) for d in devices)

    def zero_replica_ranks(self, rank: int) -> Ranks:
        """The ranks that hold the same ZeRO shard as ``rank``: one in each of the ``zero_ngroups`` groups."""
        size = self.zero_units
        return self.dp_ranks(self.device_of(rank))[self.unit_of(rank) % size::size]

    # -- every group --------------------------------------------------------------------------
    def groups(self, device_sets: Iterable[Iterable[int]] = ()) -> List[Ranks]:
        """Every rank set a plan can use, in one fixed order (creating process groups is
        collective, so every rank must create them in the same order): each device set of each
        unit, each whole unit, each data-parallel set and, with ZeRO, each ZeRO group and each
        set of ranks holding the same ZeRO shard."""
        device_sets = [tuple(devices) for devices in device_sets]
        out: List[Ranks] = []
        for u in range(self.units):
            out += [self.unit_ranks(u, devices) for devices in device_sets]
            out.append(self.unit_ranks(u))
        out += [self.dp_ranks(d) for d in range(self.plan_ngpus)]
        if self.zero_ngroups is not None:
            for rank in range(self.runtime_ngpus):
                out += [self.zero_ranks(rank), self.zero_replica_ranks(rank)]
        return out
