"""Where a schedule's pipeline devices sit among a unit's plan devices.

A unit has ``plan_ngpus`` plan devices and a schedule has ``ndevices`` pipeline devices; each
pipeline device is a group of ``tp = plan_ngpus // ndevices`` plan devices that run its stages
together with tensor parallelism (``tp == 1`` for plain pipelines). Plan device ``d`` plays pipeline
device ``d // tp`` with tensor-parallel index ``d % tp``, and talks to the plan devices with the
same index in the neighbouring stages.

>>> g = PipelineGeometry(build_schedule('1f1b', nstages=2, nmicros=4), plan_ngpus=4)
>>> g.tp, g.stage_group(1), g.pipeline_device(3)
(2, (2, 3), 1)

Chimera's view: under ``chimera_direct`` every stage has a copy on the pipeline running the other
way, and each plan device of a stage's group sums its gradients with the devices holding the same
slice of the copy (:meth:`PipelineGeometry.stage_copies`).

>>> chimera = PipelineGeometry(build_schedule('chimera_direct', nstages=4, nmicros=4), plan_ngpus=4)
>>> chimera.stages_of(0), chimera.view_of(3, 0), chimera.stage_copies(0), chimera.copy_groups()
((0, 3), 3, {0: (0, 3)}, [(0, 3), (1, 2)])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from nbscaler.schedule.pipeline import PipelineSchedule


@dataclass(frozen=True)
class PipelineGeometry:
    schedule: PipelineSchedule
    plan_ngpus: int

    @classmethod
    def from_config(cls, cfg, train: bool = True) -> "PipelineGeometry":
        """The geometry a ``ComputeConfig`` asks for: its scheduler with ``pipeline_nstages`` stages
        (when unset, as many as the scheduler puts on ``plan_ngpus`` devices) and
        ``pipeline_nmicros`` micro-batches, on the pipeline devices the scheduler spreads them
        over (``pipeline_nstages // pipeline_virtual_stages`` where the config gives the latter). With ``train=False``, the same placement running forwards only."""
        from nbscaler.schedule.schedulers import build_schedule, scheduler_spec
        spec = scheduler_spec(cfg.scheduler)
        virtual = cfg.virtual_stages
        nstages = cfg.pipeline_nstages if cfg.pipeline_nstages != -1 else spec.default_nstages(cfg.plan_ngpus, virtual)
        schedule = build_schedule(cfg.scheduler, nstages, cfg.pipeline_nmicros,
                                  spec.ndevices(nstages, cfg.plan_ngpus, virtual))
        return cls(schedule if train else schedule.forward_only(), cfg.plan_ngpus)

    def __post_init__(self) -> None:
        if self.plan_ngpus % self.schedule.ndevices:
            raise ValueError(f"plan_ngpus={self.plan_ngpus} devices cannot be shared evenly by the "
                             f"{self.schedule.ndevices} pipeline devices of '{self.schedule.name}'.")

    @property
    def tp(self) -> int:
        return self.plan_ngpus // self.schedule.ndevices

    def pipeline_device(self, plan_device: int) -> int:
        """The pipeline device that plan device ``plan_device`` helps to play."""
        return plan_device // self.tp

    def tp_index(self, plan_device: int) -> int:
        """``plan_device``'s position inside its pipeline device's tensor-parallel group."""
        return plan_device % self.tp

    def plan_device(self, pipeline_device: int, tp_index: int) -> int:
        return pipeline_device * self.tp + tp_index

    def group_of(self, pipeline_devices) -> Tuple[int, ...]:
        """The plan devices of a set of pipeline devices."""
        return tuple(d * self.tp + i for d in sorted(pipeline_devices) for i in range(self.tp))

    def stage_group(self, stage: int) -> Tuple[int, ...]:
        """The plan devices that run ``stage`` on the first pipeline (how the graph places it)."""
        return self.group_of(self.schedule.placements[0][stage])

    def view_of(self, stage: Optional[int], plan_device: int) -> int:
        """The plan device whose share of ``stage`` ``plan_device`` runs: itself when it is in the
        stage's group (``stage`` None: the whole graph), else (chimera's view: its copy of the
        stage belongs to the pipeline running the other way) the device at its tensor-parallel
        position in the group that holds the stage on the first pipeline, as the graph places it."""
        if stage is None:
            return plan_device
        group = self.stage_group(stage)
        return plan_device if plan_device in group else group[self.tp_index(plan_device)]

    def stages_of(self, plan_device: int) -> Tuple[int, ...]:
        """The stages plan device ``plan_device`` runs (two under ``chimera_direct``)."""
        return self.schedule.stages_of(self.pipeline_device(plan_device))

    def stage_copies(self, stage: int) -> Dict[int, Tuple[int, ...]]:
        """``{position in the stage group: plan devices}`` holding copies of the same slice of
        ``stage`` on different pipelines (``chimera_direct``): their gradients add up. Empty
        when the stage has one copy."""
        holders = sorted({self.group_of(p[stage]) for p in self.schedule.placements})
        if len(holders) < 2:
            return {}
        return {position: tuple(sorted(h[position] for h in holders)) for position in range(len(holders[0]))}

    def copy_groups(self) -> List[Tuple[int, ...]]:
        """Every set of plan devices that holds copies of one stage slice (see :meth:`stage_copies`)."""
        return sorted({devices for s in range(self.schedule.nstages) for devices in self.stage_copies(s).values()})
