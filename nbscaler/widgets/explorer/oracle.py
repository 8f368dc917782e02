"""The correctness check of a run: the same training in this one process, and how far a run is from it.

A parallel run must reproduce single-process training. Gradients are summed over the micro-batches
of a step and over the data-parallel units (see the design notes), so the reference sums the losses
of every unit's micro-batches before one backward, and a rank's loss is compared with its unit's
share of that sum.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Callable, List

import pandas as pd
import torch

from nbscaler.reference import MATCH_RTOL, call_model, reference_run
from nbscaler.widgets.explorer.model import ModelSpec

__all__ = ["MATCH_RTOL", "single_process_losses", "worst_relative_error"]


def single_process_losses(spec: ModelSpec, steps: int, units: int, nmicros: int,
                          optimizer_fn: Callable[..., torch.optim.Optimizer], lr: float) -> List[List[float]]:
    """``losses[step][unit]``: each unit's loss, summed over its micro-batches, trained in this
    process (``nbscaler.reference.reference_run`` on a copy of ``spec``'s module)."""
    model = copy.deepcopy(spec.module).train()
    nmicros = nmicros if spec.end2end else 1
    run = reference_run(model, optimizer_fn(model.parameters(), lr=lr),
                        lambda step, unit: spec.batches(step, unit, nmicros), steps=steps, units=units,
                        loss_of=call_model if spec.end2end else functools.partial(_loss_of_forward, spec))
    return run.unit_losses()


def _loss_of_forward(spec: ModelSpec, model: torch.nn.Module, batch: Any) -> torch.Tensor:
    """A forward-argument module's loss: its output, or ``spec.loss_fn`` of it."""
    output = model(**batch)
    return spec.loss_fn(output, batch) if spec.loss_fn is not None else output


def worst_relative_error(steps: pd.DataFrame, reference: List[List[float]]) -> float:
    """The largest ``|loss - reference| / |reference|`` over the ranks and steps of a run's ``steps``
    table (columns ``rank, unit, step, loss``); steps are counted from the run's first."""
    first = steps["step"].min()
    expected = [reference[step - first][unit] for step, unit in zip(steps["step"], steps["unit"])]
    want = torch.tensor(expected, dtype=torch.float64)
    got = torch.tensor(steps["loss"].tolist(), dtype=torch.float64)
    return float(((got - want).abs() / want.abs().clamp_min(1e-30)).max())
