"""Physics every priced step obeys, on every model of the test zoo, every catalogued target and both
half-precision dtypes, under data, tensor and pipeline parallelism:

- HFU <= 1: no rank's step is shorter than its hardware FLOPs (those its kernels perform) at the
  GPU's peak; and MFU <= HFU once the pairs a causal attention kernel skips are left out of the
  model's FLOPs (MFU counts every pair, as published counts do; ``cost.flops``);
- no rank's memory is below its parameters, their gradients and the optimizer's state.

At the zoo's tiny shapes every op sits on a kernel's floor, so HFU <= 1 would hold whatever the
FLOPs. Each target is therefore also priced as its *arithmetic-only twin*: memory as fast as one
likes, links too, no kernel floor, no ramp of a product; only arithmetic is left to take time, and an op whose
FLOPs the roofline did not bind (GPT-2's ``addmm``, an ``einsum``) would take none.

Each model is traced once per dtype and re-placed (``plan.replan``) for each policy. The shipped
models and Hugging Face's decoders in bf16 run in the fast suite (with the shipped GPT in fp16 too, for
the T4, which has no bf16); fp16 everywhere and the vision models are ``slow``.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Dict, Iterator, Tuple

import pytest
import torch

import nbscaler
from nbscaler import ComputeConfig, Hardware
from nbscaler.cost import roofline
from nbscaler.cost.hardware import NumberFormat
from nbscaler.cost.roofline import masked_flops, skips_masked_pairs
from nbscaler.cost.step_figures import StepFigures
from nbscaler.planning.step import flops_per_device
from tests.models import batch, build

FAST = ("gpt", "llama_e2e", "hf_gpt2", "hf_llama", "hf_qwen2", "user_op")
SLOW = ("resnet", "mobilenet", "vit")
END2END = set(FAST + SLOW) - {"user_op"}           # a pipeline takes its batch as one argument
ADAMW_STATE_BYTES = 8                              # AdamW's two moments, fp32, per element
INSTANT = dict(memory_bytes_per_s=1e30, intra_node_bytes_per_s=1e30, inter_node_bytes_per_s=1e30,
               intra_node_latency_s=0.0, inter_node_latency_s=0.0)


def cases() -> Iterator:
    for name in FAST + SLOW:
        for dtype in (torch.bfloat16, torch.float16):
            fast = name in FAST and (dtype == torch.bfloat16 or name == "gpt")
            yield pytest.param(name, dtype, id=f"{name}-{str(dtype)[6:]}", marks=() if fast else pytest.mark.slow)


@functools.lru_cache(maxsize=None)
def plans(name: str, dtype: torch.dtype) -> Dict[str, "nbscaler.Plan"]:
    """``name`` traced once in ``dtype``, placed by ``dp`` (two units), ``tp`` (two devices) and,
    when it is end2end, a two-stage 1F1B pipeline."""
    e2e = name in END2END
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dp = nbscaler.plan(build(name), batch(name, 0), "dp", ComputeConfig(1, 2, use_end2end=e2e), module_dtype=dtype)
        out = {"dp": dp, "tp": dp.replan("tp", ComputeConfig(2, 2, use_end2end=e2e))}
        if e2e:
            out["pp"] = dp.replan("pp", ComputeConfig(2, 2, use_end2end=True, use_pipeline=True, pipeline_nstages=2,
                                                      pipeline_nmicros=2, pipeline_scheduler="1f1b"))
    return out


def targets(dtype: torch.dtype) -> Iterator[Tuple[str, Hardware, bool]]:
    """Every catalogued target that computes in ``dtype``, as it is and as its arithmetic-only twin
    (its memory and links made unbounded and instant here, its floors removed when it is priced)."""
    for name, hw in Hardware.catalogue().items():
        if NumberFormat.of(dtype) in hw.peak_flops_by_precision:
            yield name, hw, False
            yield f"{name} (arithmetic only)", dataclasses.replace(hw, **INSTANT), True


def priced(plan: "nbscaler.Plan", hw: Hardware, arithmetic_only: bool, monkeypatch) -> StepFigures:
    """``plan``'s step on ``hw`` (AdamW, fp32 masters); with ``arithmetic_only``, no kernel floor and
    no ramp of a product (a twin is its own target: the plan keeps its step model apart)."""
    with monkeypatch.context() as patch:
        if arithmetic_only:
            patch.setattr(roofline, "KERNEL_FLOOR_S", 0.0)
            patch.setattr(roofline, "MATMUL_RAMP_S", 0.0)
        return plan.step_figures(torch.optim.AdamW, hardware=hw, master_dtype=torch.float32)


@pytest.mark.parametrize("name, dtype", cases())
def test_no_rank_computes_faster_than_its_peak(name, dtype, monkeypatch):
    for policy, plan in plans(name, dtype).items():
        for target, hw, arithmetic_only in targets(dtype):
            step = priced(plan, hw, arithmetic_only, monkeypatch)
            masked = flops_per_device(plan, lambda n, phase: masked_flops(
                n.meta, n.meta["local_flops_fwd" if phase == "F" else "local_flops_bwd"])) if skips_masked_pairs(hw) else {}
            for device, d in step.devices.items():
                where = f"{name} {policy} on {target}, device {device}"
                assert d.hardware_flops > 0, where
                assert d.step_time_s >= d.hardware_flops / step.peak_flops, where
                assert step.device_hfu(device) <= 1, where
                assert d.flops - masked.get(device, 0.0) <= d.hardware_flops * (1 + 1e-12), where
            assert step.hfu <= 1, f"{name} {policy} on {target}"


@pytest.mark.parametrize("name, dtype", cases())
def test_no_rank_holds_less_than_its_weights_gradients_and_optimizer_state(name, dtype):
    for policy, plan in plans(name, dtype).items():
        memory = plan.memory(torch.optim.AdamW, master_dtype=torch.float32)
        for row in memory.itertuples():
            params = [w for w in plan.programs.weights(plan.config.device_of(row.rank)) if w.kind == "param"]
            # each element: itself, a gradient at least in its dtype, an fp32 master unless it is one, AdamW's moments
            least = sum(p.numel * (2 * p.dtype.itemsize + (4 if p.dtype != torch.float32 else 0) + ADAMW_STATE_BYTES)
                        for p in params)
            assert least > 0 and row.peak_bytes >= least, f"{name} {policy}, rank {row.rank}"


@pytest.mark.slow
@pytest.mark.parametrize("hidden, layers, heads, tp, pp, batch_size", [
    (6144, 48, 64, 8, 1, 4),              # 22B, tp 8 on 8 A100s (MFU 1.13 with addmm bound by memory alone)
    (12288, 96, 96, 8, 8, 64),            # 175B, tp 8 x pp 8 on 64 A100s (MFU 1.90 then)
], ids=["22B", "175B"])
def test_gpt2_at_the_sizes_of_korthikanti_et_al_stays_under_the_peak(hidden, layers, heads, tp, pp, batch_size):
    """Hugging Face's GPT-2 (its ``Conv1D`` is ``addmm``) at the 22B and 175B shapes of Korthikanti et
    al. 2022 (sequence 2,048, vocabulary 51,200), on meta, micro-batches of one sequence, priced on A100s."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(vocab_size=51200, n_positions=2048, n_embd=hidden, n_layer=layers, n_head=heads,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    with torch.device("meta"):
        model = GPT2LMHeadModel(config).to(torch.bfloat16)
    ids = torch.zeros(1, 2048, dtype=torch.long)                   # its forward reads the ids' values
    cc = ComputeConfig(tp * pp, tp * pp, use_end2end=True, use_pipeline=True, pipeline_nstages=pp,
                       pipeline_nmicros=batch_size, pipeline_scheduler="1f1b")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = nbscaler.plan(model, {"input_ids": ids, "labels": ids.clone()}, "hybrid", cc)
    step = plan.step_figures(torch.optim.AdamW, hardware=Hardware.named("A100-SXM-80GB", nodes=tp * pp // 8),
                             master_dtype=torch.float32)
    assert 0.3 < step.mfu < 0.7 and step.hfu < 0.7
