"""What a prediction on this machine assumes, said in lines: ``plan.assumed()``.

A plan priced here (``plan.summary()``, ``plan.timeline()``, no ``hardware`` or
``Hardware.local()``) rests on things a reader cannot see in its numbers. Each becomes one line,
which the summary carries (``summary.attrs['assumed']``), ``plan.explain()`` prints and the views
show under the table or chart:

- the backend its collectives are priced for: the one its ranks will run on this host
  (``comm_model.local_choice``, the runtime's rule), gloo with fewer GPUs than ranks;
- collectives at their uncalibrated defaults, where no ranks have calibrated them here yet
  (``cost.calibration``), with how to calibrate them;
- more ranks than cores: the ranks take turns on the cores, and a rank waits for a peer that the
  operating system has not scheduled yet at every collective and pipeline send. The calibrations
  time those waits with every rank busy, as a tensor-parallel or data-parallel step keeps them; a
  pipeline's ranks idle in their bubbles, and a step of small ops keeps its ranks closer in step
  than the calibration's compute does, so the prediction can be several times the measured step.

A plan priced on a target assumes none of these (nothing runs here): its lines are empty.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, List, Optional

from nbscaler.cost import comm_model
from nbscaler.cost.hardware import Hardware

if TYPE_CHECKING:
    from nbscaler.planning.planner import Plan

#: The key of ``plan.summary()``'s ``attrs`` that holds its lines.
ATTR = "assumed"


def assumed_lines(plan: "Plan", hardware: Optional[Hardware] = None) -> List[str]:
    """The lines (see the module docstring) for ``plan`` priced on ``hardware`` (this machine by default)."""
    if hardware is not None and not hardware.is_local:
        return []
    cfg = plan.config
    n = cfg.runtime_ngpus
    choice = comm_model.local_choice(n)
    backend = choice.backend.value
    where = (f"each on a GPU of its own" if choice.on_gpu else
             "on the CPU" + (f", as this host has fewer GPUs than ranks" if choice.note else ""))
    ranks = f"{n} rank{'s' if n > 1 else ''}"
    lines = [f"collectives priced for {backend}: the backend the {ranks} of this plan run on this host, {where} "
             "(nbscaler.runtime.backend; NBSCALER_BACKEND chooses another)."]
    if cfg.runtime_ngpus > 1:
        comm = comm_model.load(choice.backend, nranks=max(2, cfg.plan_ngpus))
        if not comm.calibrated:
            lines.append(f"collectives at {backend}'s uncalibrated defaults (latency {comm.alpha_s * 1e6:.3g} µs, "
                         f"{1 / comm.beta_s_per_byte / 1e9:.3g} GB/s), not measured here: a Cluster calibrates them "
                         "when it first parallelizes, or call nbscaler.cost.calibration.calibrate_ranks() on "
                         "every rank of a run.")
    cores = os.cpu_count() or 1
    if not choice.on_gpu and n > cores:
        lines.append(f"{n} ranks share {cores} CPU cores: they take turns on them, and at every collective and "
                     "send a rank waits for peers not yet scheduled. Those waits are timed with every rank busy, "
                     "so the step predicted here can be a few times the one measured (the demo's 4 ranks on 2 "
                     f"cores: 2 to 3 times); run at most {cores} ranks where the prediction matters.")
    return lines
