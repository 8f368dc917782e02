"""Train a compiled plan on a ``Cluster`` and bring back what the views draw as measured.

``train_on_cluster`` parallelizes the plan's model on the cluster's ranks under the plan's policy
and config, trains it, and checks the losses against the same training in this process. It
returns a ``TrainOutcome``: the cluster's ``TrainResult``, the measured timeline / memory / losses
as a ``Measured`` for the views, and the figures of the runs table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import pandas as pd
import torch

from nbscaler.cluster import Cluster, TrainResult
from nbscaler.planning import Plan
from nbscaler.widgets.base import Measured
from nbscaler.widgets.explorer.model import ModelSpec
from nbscaler.widgets.explorer.oracle import MATCH_RTOL, single_process_losses, worst_relative_error

ReportHandler = Callable[[List[Dict[str, Any]]], None]


@dataclass
class TrainSettings:
    """How the Explorer trains: steps, optimizer and learning rate."""

    steps: int = 5
    lr: float = 0.05
    optimizer_fn: Callable[..., torch.optim.Optimizer] = torch.optim.SGD

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps={self.steps!r}: train at least one step.")
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr!r}: the learning rate must be positive.")


@dataclass
class TrainOutcome:
    """A finished cluster run: telemetry, the one-process reference, and the run's figures."""

    result: TrainResult
    reference: List[List[float]]          # [step][unit] loss of the same training in one process
    rel_err: float                         # worst relative loss error against the reference
    measured: Measured

    @property
    def losses_match(self) -> bool:
        return self.rel_err <= MATCH_RTOL

    @property
    def step_s(self) -> float:
        """Median step time of the slowest rank, leaving out the first step (warm-up) when there are more."""
        per_step = self.result.steps.groupby("step")["step_time"].max()
        return float(per_step.iloc[1:].median() if len(per_step) > 1 else per_step.iloc[0])

    @property
    def torch_compile_s(self) -> Optional[float]:
        """Seconds the slowest rank spent in ``torch.compile`` over the run (its steps include them);
        ``None`` when the ranks ran eagerly."""
        compile_s = self.result.steps["compile_s"]
        if compile_s.isna().all():
            return None
        return float(self.result.steps.groupby("rank")["compile_s"].sum().max())

    @property
    def bubble(self) -> Optional[float]:
        """Measured bubble fraction of the last step (pipelines only)."""
        if self.result.schedule.empty:
            return None
        return self.result.timeline(int(self.result.steps["step"].max())).bubble_fraction

    def per_rank(self, column: str) -> Optional[List[int]]:
        """A column of the measured memory table, rank by rank (``None`` where the ranks did not report it)."""
        memory = self.result.memory.sort_values("rank")
        if column not in memory or memory[column].isna().any():
            return None
        return [int(v) for v in memory[column]]


def train_on_cluster(cluster: Cluster, spec: ModelSpec, plan: Plan, settings: TrainSettings, gen_savedir: str,
                     instance_name: str, on_report: Optional[ReportHandler] = None) -> TrainOutcome:
    """Parallelize ``spec``'s module on ``cluster`` as ``plan`` says, train it, and check it."""
    cfg = plan.config
    if cluster.world_size != cfg.runtime_ngpus:
        raise ValueError(f"the cluster has {cluster.world_size} ranks but the plan runs on runtime_ngpus="
                         f"{cfg.runtime_ngpus}: set the runtime devices to {cluster.world_size}, or give the "
                         f"Explorer a Cluster(n={cfg.runtime_ngpus}).")
    remote = cluster.parallelize(spec.module, spec.dummy_args, plan.policy, cfg, gen_savedir=gen_savedir,
                                 reuse="override", instance_name=instance_name)
    nmicros = cfg.pipeline_nmicros if cfg.use_pipeline else 1
    result = remote.train(spec.data(nmicros), settings.steps, settings.optimizer_fn, loss_fn=spec.loss_fn,
                          progress=False, on_report=on_report, lr=settings.lr)
    reference = single_process_losses(spec, settings.steps, cfg.units, nmicros, settings.optimizer_fn, settings.lr)
    return TrainOutcome(result, reference, worst_relative_error(result.steps, reference), measured_of(result))


def measured_of(result: TrainResult) -> Measured:
    """The run's telemetry as the views take it: the last step's timeline (from 0), memory, losses."""
    timeline = None
    if not result.schedule.empty:
        last = result.timeline(int(result.steps["step"].max()))
        timeline = pd.DataFrame(last.to_rows())
        start = timeline["t_start"].min()
        timeline[["t_start", "t_end"]] -= start
    return Measured(timeline=timeline, memory=result.memory,
                    losses=result.steps[["step", "rank", "loss"]].reset_index(drop=True))
