"""Plans and one-process runs the chart and report tests share (built once per test session)."""

from __future__ import annotations

import functools
from typing import Tuple

import pandas as pd
import torch

import nbscaler
from nbscaler import ComputeConfig, build_optimizer, parallelize
from nbscaler.planning import Plan
from nbscaler.runtime.memory import MemoryMeter
from tests.models import batch, build


def pipeline_config(plan_ngpus: int, nmicros: int = 4) -> ComputeConfig:
    return ComputeConfig(plan_ngpus, plan_ngpus, use_end2end=True, use_pipeline=True, pipeline_nmicros=nmicros,
                         pipeline_nstages=plan_ngpus, pipeline_scheduler="1f1b")


@functools.lru_cache(maxsize=None)
def llama_tp() -> Plan:
    """The Llama block model under tensor parallelism, 2 devices per unit, 2 units."""
    return nbscaler.plan(build("llama"), batch("llama", 0), "tp", ComputeConfig(2, 4))


@functools.lru_cache(maxsize=None)
def llama_pp() -> Plan:
    """The Llama block model as a 2-stage 1F1B pipeline of 4 micro-batches."""
    return nbscaler.plan(build("llama"), batch("llama", 0), "pp", pipeline_config(2))


@functools.lru_cache(maxsize=None)
def gpt_pipeline_run(gen_dir: str) -> Tuple[Plan, pd.DataFrame, pd.DataFrame]:
    """A real one-process run: the GPT as a one-stage pipeline of 2 micro-batches, trained a step
    with AdamW, then a measured step. Returns the plan, the measured timeline and memory."""
    cfg = pipeline_config(1, nmicros=2)
    plan = nbscaler.plan(build("gpt"), batch("gpt", 0), "pp", cfg)
    pm = parallelize(build("gpt"), batch("gpt", 0), "pp", cfg, gen_savedir=gen_dir, reuse="override")
    optimizer = build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
    samples = [batch("gpt", m)["batch"] for m in range(2)]
    pm.train_step(samples)                  # the first step creates Adam's state
    optimizer.step()
    with MemoryMeter(pm, optimizer) as meter:
        pm.train_step(samples)
        optimizer.step()
    timeline = pd.DataFrame(pm.pipeline_timeline().to_rows())
    return plan, timeline, pd.DataFrame([meter.stats()])
