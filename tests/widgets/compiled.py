"""Plans and one-process runs the chart and report tests share (built once per test session; the
run through the ``run`` fixture of ``tests/widgets/conftest.py``)."""

from __future__ import annotations

import functools
from typing import Optional, Tuple

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


def shown_figure(box) -> dict:
    """The plotly figure (data and layout, plain JSON) a chart view's live box shows."""
    from nbscaler.widgets.plotting import PLOTLY_MIME

    (output,) = box.children[0].outputs
    return output["data"][PLOTLY_MIME]


@functools.lru_cache(maxsize=None)
def gpt_on_meta_pp() -> Plan:
    """The shipped GPT at 0.5B parameters built on meta (no memory, nothing run), as a 2-stage 1F1B
    pipeline of 4 micro-batches of 12 x 1024 tokens. With AdamW its first stage holds about 20 GiB
    (more activations in flight) and its second about 11: over a T4's 16 GB and under it."""
    from nbscaler.models.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=50304, seq_len=1024, n_layer=8, d_model=2048, n_head=16)
    with torch.device("meta"):
        model = GPT(cfg)
    idx = torch.zeros(12, cfg.seq_len, dtype=torch.long, device="meta")
    return nbscaler.plan(model, {"batch": {"idx": idx, "targets": idx.clone()}}, "pp", pipeline_config(2))


@functools.lru_cache(maxsize=None)
def gpt_context(kind: str = "ring", n: int = 4, cp: Optional[int] = None) -> Plan:
    """nbscaler's GPT of 2 layers, one sequence of 16 tokens split over ``n`` devices by context
    parallelism (``kind``: how attention reads the other devices' keys); with ``cp``, over ``cp``
    groups of ``n // cp`` tensor-parallel devices."""
    from nbscaler.models.gpt import GPT, GPTConfig, sample_batch
    cfg = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=64)
    return nbscaler.plan(GPT(cfg), {"batch": sample_batch(cfg, 1)}, "tp",
                         ComputeConfig(n, n, pas_config={"context_parallel": cp or n, "context_parallel_kind": kind}))


MOE_EXPERTS, MOE_TOP_K = 8, 2


def moe_llama(routing: str = "dropless"):
    """nbscaler's mixture-of-experts Llama of 2 blocks, 8 experts of which each token uses 2,
    dropless (or ``routing='capacity'``: a capacity factor of 1.0), and a batch of 2 sequences of 16
    tokens for it."""
    from nbscaler.models.moe import MoEConfig, MoELlama, sample_batch
    cfg = MoEConfig(vocab_size=64, seq_len=16, n_layer=2, d_model=32, n_head=4, n_kv_head=2, n_experts=MOE_EXPERTS,
                    top_k=MOE_TOP_K, expert_hidden=16, capacity_factor=1.0 if routing == "capacity" else None)
    return MoELlama(cfg), sample_batch(cfg, 2)


@functools.lru_cache(maxsize=None)
def moe_expert_parallel(routing: str = "dropless") -> Plan:
    """``moe_llama`` with its experts split over 2 devices by expert parallelism (``expert_parallel=2``)."""
    return nbscaler.plan(*moe_llama(routing), "tp", ComputeConfig(2, 2, pas_config={"expert_parallel": 2}))


@functools.lru_cache(maxsize=None)
def moe_data_parallel() -> Plan:
    """``moe_llama`` with its batch split over 2 devices, every expert whole on each (``data``)."""
    return nbscaler.plan(*moe_llama(), "data", ComputeConfig(2, 2))
