"""The runs table: every compile and cluster run of an Explorer session, as one DataFrame.

A ``Run`` is one plan the user compiled (or re-placed and trained), with the training outcome once
it ran on the cluster. ``runs_frame`` lays the runs out one per row; every number comes from the
plan (predicted, columns ending in ``_predicted``) or the cluster's telemetry (measured).
``compile_s`` is the plan's compile (trace, place, cost); ``torch_compile_s`` the seconds the slowest rank
spent in ``torch.compile`` while it trained, for a run with ``torch_compile`` on (``ComputeConfig.compile``).
``peak_bytes`` is the runtime's own count in the cost model's categories, where the ranks report
it; ``peak_rss_bytes`` is the whole process (Python, torch, buffers), always reported.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import pandas as pd
import torch

from nbscaler.columns import SummaryColumn as C
from nbscaler.planning import Plan
from nbscaler.policy.builtin import SEQUENCE_PARALLEL
from nbscaler.policy.context import context_kind
from nbscaler.policy.experts import expert_parallel, expert_tensor_parallel_size
from nbscaler.recipe import Recipe
from nbscaler.widgets.explorer.knobs import Knobs, context_label, recompute_of
from nbscaler.widgets.explorer.trainer import TrainOutcome

RUN_COLUMNS = ["run", "model", "policy", "plan_ngpus", "runtime_ngpus", "stages", "nmicros", "scheduler", "zero",
               "sequence_parallel", "context_parallel", "expert_parallel", "expert_tensor_parallel", "recompute",
               "torch_compile", "compile_s", "torch_compile_s", "step_s_predicted", "step_s", "bubble_predicted", "bubble", "peak_bytes_predicted", "peak_bytes",
               "peak_rss_bytes", "losses_match", "loss_rel_err"]


EXPLORER_RECIPE = Recipe(optimizer=torch.optim.SGD)
"""The Explorer's recipe unless given one: it trains small models against a single-process oracle
with plain SGD (``oracle.single_process_losses``), and predicts for what it trains."""


@dataclass
class Run:
    """One plan of the session and, once trained, its outcome on the cluster."""

    id: int
    model: str
    knobs: Knobs
    plan: Plan
    compile_s: float
    optimizer_fn: Any = torch.optim.SGD
    recipe: Optional[Recipe] = None              # what the prediction assumes (default: optimizer_fn's)
    outcome: Optional[TrainOutcome] = None

    @functools.cached_property
    def predicted(self) -> Dict[str, Any]:
        """The plan's own figures: compute settings, step time, bubble and peak memory per rank."""
        plan = self.plan
        summary = plan.summary(recipe=self.recipe or Recipe(optimizer=self.optimizer_fn))
        schedule = plan.schedule
        return {
            "plan_ngpus": plan.config.plan_ngpus, "runtime_ngpus": plan.config.runtime_ngpus,
            "stages": schedule.nstages if schedule is not None else 1,
            "nmicros": plan.config.pipeline_nmicros if schedule is not None else 1,
            "scheduler": plan.config.scheduler if schedule is not None else "",
            "zero": plan.config.use_zero,
            "sequence_parallel": bool(plan.config.pas_config.get(SEQUENCE_PARALLEL, False)),
            "context_parallel": context_label(plan.config.context_parallel, context_kind(plan.config)),
            "expert_parallel": expert_parallel(plan.config),
            "expert_tensor_parallel": expert_tensor_parallel_size(plan.config),
            "recompute": recompute_of(plan.config)[0],
            "torch_compile": plan.config.compile,
            "step_s_predicted": float(summary[C.STEP_TIME_S].max()),
            "bubble_predicted": plan.timeline().bubble_fraction,
            "peak_bytes_predicted": [int(v) for v in summary.sort_values(C.RANK)[C.PEAK_BYTES]],
        }

    def row(self) -> Dict[str, Any]:
        outcome = self.outcome
        return {
            "run": self.id, "model": self.model, "policy": self.knobs.policy_label, "compile_s": self.compile_s,
            **self.predicted,
            "torch_compile_s": outcome.torch_compile_s if outcome else None,
            "step_s": outcome.step_s if outcome else None,
            "bubble": outcome.bubble if outcome else None,
            "peak_bytes": outcome.per_rank("peak_bytes") if outcome else None,
            "peak_rss_bytes": outcome.per_rank("peak_rss_bytes") if outcome else None,
            "losses_match": outcome.losses_match if outcome else None,
            "loss_rel_err": outcome.rel_err if outcome else None,
        }


def runs_frame(runs: List[Run]) -> pd.DataFrame:
    """One row per run, columns ``RUN_COLUMNS``, indexed by run id."""
    return pd.DataFrame([run.row() for run in runs], columns=RUN_COLUMNS).set_index("run")
