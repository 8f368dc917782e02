"""The correctness check of a run: the same training in this one process, and how far a run is from it.

A parallel run must reproduce single-process training. Gradients are summed over the micro-batches
of a step and over the data-parallel units (see the design notes), so the reference sums the losses
of every unit's micro-batches before one backward, and a rank's loss is compared with its unit's
share of that sum.
"""

from __future__ import annotations

import copy
from typing import Callable, List

import pandas as pd
import torch

from nbscaler.widgets.explorer.model import ModelSpec

MATCH_RTOL = 1e-5
"""Relative error under which a run's losses count as equal to one process's (fp32)."""


def single_process_losses(spec: ModelSpec, steps: int, units: int, nmicros: int,
                          optimizer_fn: Callable[..., torch.optim.Optimizer], lr: float) -> List[List[float]]:
    """``losses[step][unit]``: each unit's loss, summed over its micro-batches, trained in this process."""
    model = copy.deepcopy(spec.module).train()
    optimizer = optimizer_fn(model.parameters(), lr=lr)
    data = spec.data(nmicros)
    losses = []
    for step in range(steps):
        per_unit = [_unit_loss(spec, model, data(step, unit)) for unit in range(units)]
        torch.stack(per_unit).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append([loss.item() for loss in per_unit])
    return losses


def _unit_loss(spec: ModelSpec, model: torch.nn.Module, batch) -> torch.Tensor:
    if spec.end2end:
        return torch.stack([model(micro) for micro in batch]).sum()
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
