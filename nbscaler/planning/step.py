"""A plan's training step, priced whole: ``cost.step_figures.StepFigures`` from every op of the plan.

``plan.summary(hardware=hw)`` prices the step on ``hw`` (``cost.timing`` with ``cost.roofline`` and
``cost.nccl``) through ``plan_step``, and adds the columns ``nbscaler.columns.TARGET_COLUMNS``
defines from what ``StepFigures`` works out. Every figure of the target comes from ``Hardware``:
nothing here knows a peak.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, defaultdict
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Tuple

import pandas as pd
import torch

from nbscaler.columns import SummaryColumn as C
from nbscaler.cost.hardware import Hardware
from nbscaler.cost.roofline import masked_flops, skips_masked_pairs
from nbscaler.cost.step_figures import StepFigures, step_tokens
from nbscaler.cost.timing import StepModel
from nbscaler.ir.graph import IRNode
from nbscaler.recipe import Recipe

if TYPE_CHECKING:
    from nbscaler.planning.planner import Plan


def compute_dtype(plan: "Plan") -> torch.dtype:
    """The dtype the model computes in: that of most of its trained parameters' elements."""
    count: Counter = Counter()
    for t in plan.graph.weights.values():
        if t.kind == "param" and t.dtype.is_floating_point:
            count[t.dtype] += math.prod(t.shape)
    return count.most_common(1)[0][0] if count else torch.float32


def blocks_per_stage(plan: "Plan", device: int) -> Dict[Tuple[int | None, str], int]:
    """How often ``device`` runs each ``(stage, phase)`` in one training step. A ``W`` block is
    the weight half of a backward its ``B`` block already counts (the graph's ops and collectives
    are forward or backward), so only ``F`` and ``B`` are counted."""
    if plan.geometry is None:
        return {(None, "F"): 1, (None, "B"): 1}
    counts: Dict[Tuple[int | None, str], int] = defaultdict(int)
    for block in plan.schedule.blocks_of(plan.geometry.pipeline_device(device)):
        if block.phase != "W":
            counts[(block.stage, block.phase)] += 1
    return counts


def stage_device(plan: "Plan", stage: int | None, device: int) -> int:
    """The plan device whose share of ``stage`` ``device`` runs (``PipelineGeometry.view_of``)."""
    return device if plan.geometry is None else plan.geometry.view_of(stage, device)


def flops_per_device(plan: "Plan", value: Optional[Callable[[IRNode, str], float]] = None) -> Dict[int, float]:
    """FLOPs each plan device runs in one training step (its share of split ops); ``value(node,
    phase)`` counts something else of each op's forward (``"F"``) or backward (``"B"``) instead."""
    value = value or (lambda n, phase: n.meta["local_flops_fwd" if phase == "F" else "local_flops_bwd"])
    by_stage: Dict[int | None, List[IRNode]] = {}          # in graph order, as one pass over it sums
    for n in plan.graph.nodes:
        by_stage.setdefault(n.stage, []).append(n)
    by_stage[None] = plan.graph.nodes                        # no pipeline: every node
    sums: Dict[Tuple[int | None, str, int], float] = {}     # (stage, phase, device) -> one block's FLOPs

    def block_flops(stage: int | None, phase: str, where: int) -> float:
        if (stage, phase, where) not in sums:
            sums[(stage, phase, where)] = sum(value(n, phase) for n in by_stage.get(stage, [])
                                              if where in n.placement.devices)
        return sums[(stage, phase, where)]

    out = {}
    for d in range(plan.config.plan_ngpus):
        out[d] = sum(count * block_flops(stage, phase, stage_device(plan, stage, d))
                     for (stage, phase), count in blocks_per_stage(plan, d).items())
    return out


def hardware_flops_per_device(plan: "Plan", hardware: Hardware) -> Dict[int, float]:
    """FLOPs each plan device's kernels perform in one step on ``hardware``: the model's, with the
    forwards recomputed regions run again in their backwards, less the pairs a causal attention
    kernel skips where the target's does (``cost.roofline.skips_masked_pairs``)."""
    flops = flops_per_device(plan)
    skips = skips_masked_pairs(hardware)
    masked = flops_per_device(plan, lambda n, phase: masked_flops(
        n.meta, n.meta["local_flops_fwd" if phase == "F" else "local_flops_bwd"])) if skips else {}
    runs = plan.local_runs or {}
    out = {}
    for d in range(plan.config.plan_ngpus):
        again = 0.0                                          # forwards run again, less what they mask
        for (stage, phase), count in blocks_per_stage(plan, d).items():
            run = runs.get(d, {}).get(stage)
            if phase == "B" and run is not None:
                fwd = [op.node for op in run.ops if op.recomputed]
                again += count * sum(n.meta["local_flops_fwd"] - (masked_flops(n.meta, n.meta["local_flops_fwd"])
                                                                  if skips else 0.0) for n in fwd)
        out[d] = flops[d] - masked.get(d, 0.0) + again
    return out


def micro_batch_tokens(plan: "Plan") -> Optional[int]:
    """Tokens in one micro-batch of one unit: the first integer input of two or more dimensions,
    batch x sequence; None when no input has a sequence."""
    seq = next((t for t in plan.graph.inputs if t.ndim >= 2 and not t.dtype.is_floating_point
                and t.dtype != torch.bool), None)
    return None if seq is None else seq.shape[0] * seq.shape[1]


def tokens_per_step(plan: "Plan") -> Optional[int]:
    """Tokens the whole job trains on in one step, or None when no input has a sequence."""
    cfg = plan.config
    return step_tokens(micro_batch_tokens(plan), cfg.pipeline_nmicros if cfg.use_pipeline else 1, cfg.units)


def plan_step(plan: "Plan", recipe: Recipe, hardware: Optional[Hardware] = None,
              memory: Optional[pd.DataFrame] = None) -> StepFigures:
    """One training step of ``plan`` trained with ``recipe`` on ``hardware`` (this machine without
    it), priced: each plan device's compute, exposed synchronisation and update
    (``cost.timing.StepModel``), its FLOPs and its peak bytes (the most any of its ranks holds in
    ``memory``, ``plan.memory(recipe=recipe)`` unless given), the job's tokens, and with
    ``hardware`` (``Hardware.local()`` too) its peak FLOP/s at the model's compute dtype and the
    FLOPs recomputed forwards add."""
    cfg = plan.config
    model = plan.step_model(hardware, recipe) or StepModel(plan.placed, runs=plan.runs_for(recipe), hardware=hardware,
                                                           weights_of=plan.programs.weights,
                                                           program_of=plan.programs.device, recipe=recipe)
    nsamples = cfg.pipeline_nmicros if cfg.use_pipeline else 1
    parts = model.device_steps(nsamples, recipe)
    flops = flops_per_device(plan)
    # utilisation needs a peak: a target's, or this machine's as Hardware.local() measures it
    performed = hardware_flops_per_device(plan, hardware) if hardware is not None else {}
    memory = memory if memory is not None else plan.memory(recipe=recipe)
    peaks = memory.groupby(memory[str(C.RANK)].map(cfg.device_of))[str(C.PEAK_BYTES)].max()
    devices = {d: dataclasses.replace(p, flops=flops[d], hardware_flops=performed.get(d, math.nan),
                                      peak_bytes=float(peaks[d])) for d, p in parts.items()}
    return StepFigures(devices, cfg.units, cfg.runtime_ngpus, hardware,
                       hardware.peak_flops(compute_dtype(plan)) if hardware is not None else None, tokens_per_step(plan),
                       model.pipeline_parts(recipe))


def target_columns(plan: "Plan", frame: pd.DataFrame, step: StepFigures) -> pd.DataFrame:
    """``frame`` (a summary priced as ``step``, on a target) with the columns of ``TARGET_COLUMNS``."""
    hardware, devices = step.hardware, [plan.config.device_of(r) for r in frame[str(C.RANK)]]
    frame = frame.copy()
    frame[str(C.DEVICE_MEMORY_BYTES)] = hardware.memory_bytes
    frame[str(C.FITS)] = hardware.fits(frame[str(C.PEAK_BYTES)])
    frame[str(C.HARDWARE_FLOPS)] = [step.devices[d].hardware_flops for d in devices]
    frame[str(C.MFU)] = [step.device_mfu(d) for d in devices]
    frame[str(C.HFU)] = [step.device_hfu(d) for d in devices]
    frame[str(C.TOKENS_PER_S)] = step.tokens_per_s
    return frame
