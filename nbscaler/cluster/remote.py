"""``RemoteModule``: a parallel module that lives on the ranks of a cluster, driven from a notebook.

>>> pm = cl.parallelize(model, {'x': x, 'y': y}, 'tp', ComputeConfig(2, 2))   # doctest: +SKIP
>>> result = pm.train(lambda step, unit: make_batch(step, unit), steps=100,
...                   optimizer_fn=torch.optim.AdamW, lr=1e-3)                 # doctest: +SKIP
>>> result.steps.pivot(index="step", columns="rank", values="loss").plot()   # doctest: +SKIP

The module itself never comes back to the notebook: every rank holds its own shard, and the
notebook holds a handle with the module's name. What comes back is data: losses, step times and
memory as pandas DataFrames, and whatever ``after_backward`` or ``infer`` return.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence

import pandas as pd
import torch
from tqdm.auto import tqdm

from nbscaler.cluster import training
from nbscaler.config import ComputeConfig
from nbscaler.schedule import Timeline

STEP_COLUMNS = ["rank", "unit", "step", "loss", "t_start", "t_end", "step_time", "loss_scale", "skipped", "compile_s"]
SCHEDULE_COLUMNS = ["rank", "step", "stage", "micro", "phase", "t_start", "t_end"]


@dataclass
class TrainResult:
    """What ``RemoteModule.train`` brings back.

    - ``steps``: one row per rank and step: ``rank, unit, step, loss, t_start, t_end, step_time``
      (wall-clock seconds), ``loss_scale`` (the scale the step's backward used; NaN without a loss
      scaler), ``skipped`` (whether the optimizer skipped the step: a gradient overflowed, and
      every rank skips it alike) and ``compile_s`` (seconds of the step spent in ``torch.compile``,
      part of ``step_time``; NaN for a module that runs eagerly, see ``ComputeConfig.compile``).
      Ranks of one unit report the same loss.
    - ``memory``: one row per rank: ``rank, device``, the first step's memory in the columns
      ``plan.summary()`` predicts (``param_bytes, grad_bytes, optimizer_bytes, buffer_bytes,
      activation_bytes, peak_bytes``, counted by ``MemoryMeter``; on CUDA also
      ``cuda_max_allocated_bytes``), and the process's ``peak_rss_bytes, peak_device_bytes`` (the
      last only on GPUs).
    - ``schedule``: for pipelined modules, one row per pipeline block each rank ran:
      ``rank, step, stage, micro, phase, t_start, t_end`` (phase ``F`` or ``B``; wall-clock
      seconds, from when the block's inputs had arrived). Empty without a pipeline.
    - ``probes``: ``probes[rank][i]`` is what ``after_backward`` returned at the i-th step of
      this call on ``rank`` (empty lists without ``after_backward``).
    """

    steps: pd.DataFrame
    memory: pd.DataFrame
    schedule: pd.DataFrame
    probes: List[List[Any]] = field(default_factory=list)

    @property
    def losses(self) -> pd.DataFrame:
        """Loss by step (rows) and rank (columns), ready to plot."""
        return self.steps.pivot(index="step", columns="rank", values="loss")

    def timeline(self, step: int) -> Timeline:
        """The measured pipeline timeline of ``step``: makespan, bubble fraction, rows to draw."""
        blocks = self.schedule[self.schedule["step"] == step]
        if blocks.empty:
            raise ValueError(f"no pipeline blocks for step {step}: the module has no pipeline, or the step "
                             f"was not trained in this call (steps here: {sorted(set(self.steps['step']))}).")
        return Timeline.from_rows(blocks.to_dict("records"), nranks=self.steps["rank"].nunique())


class Ranks(Protocol):
    """What a ``RemoteModule`` needs of the cluster it lives on (``Cluster`` is one)."""

    world_size: int
    single_host: bool

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> List[Any]: ...

    def call(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
             *, on_report: Optional[Callable[[List[Dict[str, Any]]], None]] = None) -> List[Any]: ...


@dataclass(frozen=True)
class RemoteModule:
    """Handle to the parallel module called ``name`` on every rank of ``cluster``."""

    cluster: Ranks
    name: str
    compute_config: ComputeConfig

    @classmethod
    def create(cls, cluster: Ranks, module: Any, dummy_forward_args: Dict[str, Any], pas_policy: Any,
               compute_config: ComputeConfig, name: Optional[str], parallelize_kwargs: Dict[str, Any]) -> "RemoteModule":
        """Parallelize on every rank; see ``Cluster.parallelize``."""
        if compute_config.runtime_ngpus != cluster.world_size:
            raise ValueError(
                f"compute_config.runtime_ngpus={compute_config.runtime_ngpus} but the cluster has "
                f"{cluster.world_size} ranks: use runtime_ngpus={cluster.world_size}, or a Cluster with "
                f"n={compute_config.runtime_ngpus}.")
        if "load_module" in parallelize_kwargs:
            raise ValueError("a module parallelized on a cluster is always loaded on its ranks; to compile "
                             "only, call nbscaler.parallelize(..., load_module=False) in the notebook.")
        module_class = module if isinstance(module, type) else type(module)
        name = name or parallelize_kwargs.get("instance_name") or module_class.__name__
        kwargs = dict(parallelize_kwargs)
        # Files reach the other hosts only if rank 0 sends them; on one host they are already there.
        kwargs.setdefault("broadcast_strategy", "none" if cluster.single_host else "all")
        cluster.run(training.parallelize_here, name, module, dummy_forward_args, pas_policy, compute_config, kwargs)
        return cls(cluster, name, compute_config)

    def train(self, data: training.DataFn, steps: int,
              optimizer_fn: Optional[Callable[..., torch.optim.Optimizer]] = None, *,
              loss_fn: Optional[training.LossFn] = None, after_backward: Optional[training.AfterBackward] = None,
              progress: bool = True, on_report: Optional[Callable[[List[Dict[str, Any]]], None]] = None,
              **optimizer_kwargs: Any) -> TrainResult:
        """Train ``steps`` optimizer steps on every rank.

        Args:
            data: ``data(step, unit) -> batch``, called on the ranks. ``step`` counts on across
                calls; ``unit`` is the data-parallel copy the rank belongs to.
            steps: optimizer steps to take.
            optimizer_fn: optimizer class or factory, built with ``nbscaler.build_optimizer`` and
                ``optimizer_kwargs``. Needed on the first call; later calls keep the optimizer
                (and its state, loss scale included) unless given a new one. Mixed precision goes
                in these keywords: ``master_dtype=torch.float32`` for a module parallelized with
                ``module_dtype=torch.bfloat16``; for fp16 also ``scaler=LossScaler()``
                (``nbscaler.runtime.scaler``), whose scale each rank then applies to its losses.
            loss_fn: ``loss_fn(output, batch) -> scalar`` when the module does not return its loss.
            after_backward: ``after_backward(module, optimizer, step)`` runs on every rank once the
                gradients are summed, before the optimizer steps; its return values come back in
                ``TrainResult.probes``.
            progress: show a progress bar that follows the slowest rank.
            on_report: called with every rank's latest ``{'done': steps, 'loss': loss}`` while the
                ranks train (about every 50 ms), e.g. to draw live loss curves.
        """
        bar = tqdm(total=steps, desc=f"train {self.name}", unit="step", disable=not progress)
        try:
            per_rank = self.cluster.call(
                training.train_here,
                (self.name, data, steps, optimizer_fn, optimizer_kwargs, loss_fn, after_backward),
                on_report=lambda reports: _advance(bar, reports, on_report))
        finally:
            bar.close()
        return TrainResult(
            steps=pd.DataFrame([row for r in per_rank for row in r["steps"]], columns=STEP_COLUMNS),
            memory=pd.DataFrame([r["memory"] for r in per_rank]),
            schedule=pd.DataFrame([row for r in per_rank for row in r["schedule"]], columns=SCHEDULE_COLUMNS),
            probes=[r["probes"] for r in per_rank])

    def infer(self, batch: Any) -> List[Any]:
        """Run ``batch`` through the module in eval mode on every rank; element ``r`` is rank ``r``'s output.

        ``batch`` is sent to every rank as is, or, when callable, each rank uses ``batch(unit)``.
        Ranks of one unit return the same output.
        """
        return self.cluster.run(training.infer_here, self.name, batch)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> List[Any]:
        """``fn(module, *args, **kwargs)`` on every rank, with this rank's parallel module."""
        return self.cluster.run(_with_module, self.name, fn, args, kwargs)


def _with_module(name: str, fn: Callable[..., Any], args: tuple, kwargs: Dict[str, Any]) -> Any:
    return fn(training.held_module(name).module, *args, **kwargs)


def _advance(bar: tqdm, reports: List[Dict[str, Any]],
             on_report: Optional[Callable[[List[Dict[str, Any]]], None]] = None) -> None:
    """Move the bar to the slowest rank, show rank 0's latest loss, and pass the reports on."""
    if on_report is not None:
        on_report(reports)
    done = min(report.get("done", 0) for report in reports)
    if done > bar.n:
        bar.update(done - bar.n)
        if "loss" in reports[0]:
            bar.set_postfix(loss=f"{reports[0]['loss']:.4g}")
