"""What the cost-model and autodist benchmarks share: the models, a run to measure, and the
measurement on every rank.

A ``Run`` is one model under one policy and ``ComputeConfig``. ``predict(run)`` is the plan's own
per-rank summary; ``measure(run, steps)`` trains the same plan on local CPU ranks and returns, per
rank, the memory of the last step by category, and the median step time and pipeline bubble.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import nbscaler
from nbscaler import ComputeConfig, build_optimizer, parallelize
from nbscaler.cost import comm_model
from nbscaler.cost.calibration import Calibration, calibrate_ranks
from nbscaler.models import gpt, llama
from nbscaler.runtime.launch import spawn
from nbscaler.runtime.memory import MemoryMeter
from nbscaler.schedule import Timeline

BATCH = 4
OPTIMIZER = torch.optim.AdamW
OPTIMIZER_KWARGS = {"lr": 1e-3}
GEN_DIR = os.path.join(tempfile.gettempdir(), "nbscaler-benchmarks")


class LlamaEnd2End(nn.Module):
    """The Llama-style decoder as an end2end module: ``forward(batch) -> loss``."""

    def __init__(self, cfg: llama.LlamaConfig):
        super().__init__()
        self.model = llama.Llama(cfg)

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(batch["idx"], batch["targets"])


class ConvNet(nn.Module):
    """A small CNN with BatchNorm, end2end: ``forward(batch) -> loss``."""

    def __init__(self, width: int = 32, classes: int = 10):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, padding=1), nn.BatchNorm2d(width)
        self.head = nn.Linear(width, classes)

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(batch["x"])))                  # (B, C, H, W)
        h = F.relu(self.bn2(self.conv2(h)))
        return F.cross_entropy(self.head(h.mean(dim=(2, 3))), batch["y"])


def _images(seed: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(2 * BATCH, 3, 16, 16, generator=g), "y": torch.randint(0, 10, (2 * BATCH,), generator=g)}


_GPT = gpt.GPTConfig(vocab_size=256, seq_len=64, n_layer=4, d_model=128, n_head=4)
_LLAMA = llama.LlamaConfig(vocab_size=256, seq_len=64, n_layer=4, d_model=128, n_head=4, n_kv_head=2)

#: name -> (build the module, make the batch of a seed)
MODELS: Dict[str, Tuple[Callable[[], nn.Module], Callable[[int], Dict[str, torch.Tensor]]]] = {
    "gpt": (lambda: gpt.GPT(_GPT), lambda seed: gpt.sample_batch(_GPT, BATCH, seed)),
    "llama": (lambda: LlamaEnd2End(_LLAMA), lambda seed: llama.sample_batch(_LLAMA, BATCH, seed)),
    "cnn": (ConvNet, _images),
}


def pipeline(scheduler: str, nstages: int, nmicros: int = 4) -> tuple:
    return (("use_pipeline", True), ("pipeline_scheduler", scheduler), ("pipeline_nstages", nstages),
            ("pipeline_nmicros", nmicros))


ZERO = (("use_zero", True),)


@dataclass(frozen=True)
class Run:
    model: str
    policy: str
    plan_ngpus: int
    runtime_ngpus: int
    extra: tuple = ()           # ComputeConfig keywords as (name, value) pairs
    pas: tuple = ()             # pas_config entries as (key, value) pairs

    @property
    def config(self) -> ComputeConfig:
        extra = dict(self.extra)
        if self.pas:
            extra["pas_config"] = {**extra.get("pas_config", {}), **dict(self.pas)}
        return ComputeConfig(self.plan_ngpus, self.runtime_ngpus, use_end2end=True, **extra)

    @property
    def nmicros(self) -> int:
        return self.config.pipeline_nmicros if self.config.use_pipeline else 1

    def __str__(self) -> str:
        cfg = self.config
        name = self.policy + (f" {cfg.pipeline_scheduler}" if cfg.use_pipeline else "")
        name += "".join(f" {k}={v}" for k, v in self.pas)
        return name + (" +zero" if cfg.use_zero else "") + f" {self.plan_ngpus}x{self.runtime_ngpus}"

    def plan(self) -> nbscaler.Plan:
        build, sample = MODELS[self.model]
        torch.manual_seed(0)
        return nbscaler.plan(build(), {"batch": sample(0)}, self.policy, self.config)


def predict(run: Run) -> Dict[str, Any]:
    """The plan of ``run``, its rows (``plan.summary`` with the benchmarks' optimizer), its config (a
    policy may choose some of it, as autodist does the unit size) and its bubble."""
    plan = run.plan()
    return {"plan": plan, "rows": plan.summary(OPTIMIZER, **OPTIMIZER_KWARGS).to_dict("records"), "config": plan.config,
            "bubble": plan.timeline().bubble_fraction if run.config.use_pipeline else None}


def _measure_on_rank(run: Run, steps: int) -> Dict[str, Any]:
    build, sample = MODELS[run.model]
    torch.manual_seed(0)
    pm = parallelize(build(), {"batch": sample(0)}, run.policy, run.config, gen_savedir=GEN_DIR,
                     instance_name=f"{run.model}_{run}".replace(" ", "_").replace("+", "").replace("=", ""), reuse="override")
    unit = pm.compute_config.unit_of(dist.get_rank())     # the compiled plan's units (autodist may choose them)
    opt = build_optimizer(pm, OPTIMIZER, **OPTIMIZER_KWARGS)
    times, losses, blocks = [], [], []
    # Timed steps run without the meter: its saved-tensor hooks cost Python time per saved tensor.
    # One more step under the meter then counts the memory.
    for step in range(steps + 1):
        samples = [sample(1000 * step + 10 * unit + m) for m in range(run.nmicros)]
        metered = step == steps
        dist.barrier()
        start = time.perf_counter()
        with MemoryMeter(pm, opt) if metered else contextlib.nullcontext() as meter:
            out = pm.train_step(samples)
            opt.step()
        if not metered:
            times.append(time.perf_counter() - start)
            if run.config.use_pipeline:           # the timed steps' blocks, not the metered one's
                blocks.append(list(pm.pipeline_events))
        else:
            memory = meter.stats()       # before zero_grad, while the gradients are still held
        opt.zero_grad()
        losses.append(float(sum(out)))
    return {"memory": memory, "step_s": statistics.median(times[1:]), "blocks": blocks, "losses": losses}


def pipeline_bubble(blocks_per_rank: List[List[List[Dict[str, Any]]]], nranks: int) -> Optional[float]:
    """The median, over the timed steps after the first, of the bubble of every rank's blocks of a
    step together (``blocks_per_rank[rank][step]``: rows as the executor records them), as the
    plan's timeline predicts it; ``None`` without a pipeline. One rank's own blocks would leave out
    the others' idle time: the late start and early end of the later stages."""
    if not blocks_per_rank[0]:
        return None
    steps = zip(*blocks_per_rank)
    bubbles = [Timeline.from_rows([row for rank in step for row in rank], nranks).bubble_fraction for step in steps]
    return statistics.median(bubbles[1:])


def measure(run: Run, steps: int) -> List[Dict[str, Any]]:
    """Per rank: ``memory`` (``MemoryMeter.stats()`` of the last step), ``step_s`` (the median over
    the steps after the first), the pipeline's ``bubble`` (``pipeline_bubble``, the same on every
    rank) and ``losses``; one thread per rank."""
    rows = spawn(_measure_on_rank, run.runtime_ngpus, run, steps, threads=1, timeout=900)
    bubble = pipeline_bubble([row.pop("blocks") for row in rows], run.runtime_ngpus)
    return [{**row, "bubble": bubble} for row in rows]


def calibrate(nranks: int) -> Calibration:
    """Calibrate the time model on ``nranks`` local ranks of one thread, now: the machine's load
    decides collective latencies and compute speed, so a calibration from another moment would
    mislead."""
    return spawn(calibrate_ranks, nranks, True, threads=1, timeout=300)[0]


def store_calibrations(calibrations: List[Calibration]) -> None:
    """Cache what several calibrations measured, for the plans that follow: the median of their
    collectives' models (set beside the median of as many measurements). Their speeds are in the
    cache already, each added by the ranks that timed it; the time model reads the median of the
    recent ones (``speed.RECENT_CALIBRATIONS``)."""
    for size in calibrations[0].comm:
        comm_model.store(comm_model.median_model([c.comm[size] for c in calibrations]), size)


def parser(description: str, models: List[str], out: Path) -> argparse.ArgumentParser:
    """The options every benchmark over ``Run``s takes: ranks, steps, models and the results file."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--ranks", type=int, default=2, choices=[2, 4])
    p.add_argument("--steps", type=int, default=6, help="training steps per run (the first is warm-up)")
    p.add_argument("--models", nargs="+", default=models, choices=list(MODELS))
    p.add_argument("--out", type=Path, default=out)
    return p


def write_results(out: Path, text: str) -> None:
    """Write a benchmark's markdown and print it, with where it went."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print("\n" + text + f"\nwritten to {out}")


def reference_loop_ms() -> float:
    """Milliseconds this machine takes for one fixed pure-Python loop (dict updates, the median of
    five): planning is Python-bound, so the results files that time it give this beside their
    figures, and figures taken on machines of different speed compare after dividing by it."""
    def loop() -> None:
        counts: Dict[int, int] = {}
        for i in range(200_000):
            counts[i % 997] = counts.get(i % 997, 0) + i
    times = []
    for _ in range(5):
        start = time.perf_counter()
        loop()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def machine(nranks: int, steps: int) -> str:
    """One line on how the measurements were taken, with the machine's load."""
    return (f"{nranks} CPU ranks (1 thread each), AdamW, {steps} steps; machine: {os.cpu_count()} cores, "
            f"load average {os.getloadavg()[0]:.1f} at the end")
