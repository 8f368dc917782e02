"""The columns a plan's summary adds on a target: memory against capacity, utilisation, throughput.

``plan.summary(hardware=hw)`` prices the step on ``hw`` (``cost.timing`` with ``cost.roofline`` and
``cost.nccl``) and adds the columns ``nbscaler.columns.TARGET_COLUMNS`` defines. Every figure of the
target comes from ``Hardware``: nothing here knows a peak.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import TYPE_CHECKING, Dict, Optional

import pandas as pd
import torch

from nbscaler.columns import SummaryColumn as C
from nbscaler.cost.hardware import Hardware

if TYPE_CHECKING:
    from nbscaler.planning.planner import Plan


def compute_dtype(plan: "Plan") -> torch.dtype:
    """The dtype the model computes in: that of most of its trained parameters' elements."""
    count: Counter = Counter()
    for t in plan.graph.weights.values():
        if t.kind == "param" and t.dtype.is_floating_point:
            count[t.dtype] += math.prod(t.shape)
    return count.most_common(1)[0][0] if count else torch.float32


def recomputed_flops_per_device(plan: "Plan") -> Dict[int, float]:
    """FLOPs of the forwards each plan device runs again in its backwards (recomputed regions)."""
    from nbscaler.planning.tables import blocks_per_stage
    runs = plan.local_runs or {}
    out = {}
    for d in range(plan.config.plan_ngpus):
        total = 0.0
        for (stage, phase), count in blocks_per_stage(plan, d).items():
            run = runs.get(d, {}).get(stage)
            if phase == "B" and run is not None:
                total += count * sum(op.node.meta["local_flops_fwd"] for op in run.ops if op.recomputed)
        out[d] = total
    return out


def tokens_per_step(plan: "Plan") -> Optional[int]:
    """Tokens the whole job trains on in one step, or None when no input has a sequence."""
    seq = next((t for t in plan.graph.inputs if t.ndim >= 2 and not t.dtype.is_floating_point
                and t.dtype != torch.bool), None)
    if seq is None:
        return None
    cfg = plan.config
    micros = cfg.pipeline_nmicros if cfg.use_pipeline else 1
    return seq.shape[0] * seq.shape[1] * micros * cfg.units


def add_target_columns(plan: "Plan", frame: pd.DataFrame, hardware: Hardware) -> pd.DataFrame:
    """``frame`` (a summary on ``hardware``) with the columns of ``TARGET_COLUMNS``."""
    cfg = plan.config
    peak = hardware.peak_flops(compute_dtype(plan))
    again = recomputed_flops_per_device(plan)
    step = frame[str(C.STEP_TIME_S)]
    frame = frame.copy()
    frame[str(C.DEVICE_MEMORY_BYTES)] = hardware.memory_bytes
    frame[str(C.FITS)] = hardware.fits(frame[str(C.PEAK_BYTES)])
    frame[str(C.HARDWARE_FLOPS)] = frame[str(C.FLOPS)] + [again[cfg.device_of(r)] for r in frame[str(C.RANK)]]
    frame[str(C.MFU)] = frame[str(C.FLOPS)] / (step * peak)
    frame[str(C.HFU)] = frame[str(C.HARDWARE_FLOPS)] / (step * peak)
    tokens = tokens_per_step(plan)
    frame[str(C.TOKENS_PER_S)] = tokens / step.max() if tokens is not None else float("nan")
    return frame
