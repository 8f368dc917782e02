"""torchtitan's one bf16 H100 row, planned from its published shape and priced on its GPUs.

torchtitan's published performance (``docs/performance.md``, Table 1, torchtitan 9dec370, December
2024): Llama 3.1 8B, FSDP over the 8 GPUs of one node, local batch 2 of 8,192 tokens, selective
activation checkpointing, AdamW, 5,762 tokens/s per GPU, on Meta's Grand Teton H100s (96 GB of
HBM2e at 2.4 TB/s, 500 W power limit). It is planned from Hugging Face's ``LlamaForCausalLM`` on meta
as data parallelism with ZeRO over the 8 GPUs (nbscaler has no FSDP yet: ZeRO gathers no
parameters), FlashAttention (PyTorch's SDPA on H100), fp32 masters and an fp32 reduction (its FSDP
keeps fp32 parameters and reduces in fp32), the gradients' norm clipped (``max_norm = 1.0`` in its
configs). Its 500 W limit lowers the clock by an amount torchtitan does not know ("between SXM and
NVL"): each row is priced at the SXM's bf16 peak and at the NVL's (835.5 TFLOP/s dense, the
datasheet's 1,671 sparse halved).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

import nbscaler
from nbscaler import ComputeConfig, Hardware, NumberFormat, Recipe
from benchmarks.published.predict import shares

H100_NVL_BF16 = 835.5e12
RECIPE = Recipe(torch.optim.AdamW, master_dtype=torch.float32, grad_reduce_dtype=torch.float32, clip_grad_norm=1.0)


@dataclass(frozen=True)
class PublishedLlamaRun:
    """A torchtitan row: tokens/s per GPU as published; FSDP over ``gpus``, ``local_batch`` sequences each."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    gpus: int
    local_batch: int
    seq: int
    tokens_per_s_per_gpu: float
    source: str


LLAMA_RUNS = [
    PublishedLlamaRun("Llama 3.1 8B", 4096, 14336, 32, 32, 8, 2, 8192, 5762,
                      "torchtitan docs/performance.md, Table 1 (FSDP, no torch.compile), 9dec370"),
]


def grand_teton_h100(nodes: int, bf16_peak: Optional[float] = None) -> Hardware:
    """Meta's Grand Teton H100: 96 GB of HBM2e at 2.4 TB/s; the SXM's peaks, or ``bf16_peak``."""
    hw = Hardware.named("H100-SXM-80GB", nodes=nodes)
    peaks = dict(hw.peak_flops_by_precision)
    name = "H100 (Grand Teton, 96 GB HBM2e)"
    if bf16_peak is not None:
        peaks.update({NumberFormat.BF16: bf16_peak, NumberFormat.FP16: bf16_peak})
        name += f", bf16 peak {bf16_peak / 1e12:.0f} TFLOP/s"
    return dataclasses.replace(hw, name=name, memory_bytes=96e9, memory_bytes_per_s=2.4e12, peak_flops_by_precision=peaks)


def hf_llama(run: PublishedLlamaRun) -> torch.nn.Module:
    """Hugging Face's ``LlamaForCausalLM`` at a Llama-3 shape (8 key-value heads, vocabulary 128,256), on meta."""
    from nbscaler.models import torchvision_compat
    torchvision_compat.declare_missing_ops()         # transformers imports torchvision, whose ops may be missing here
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=run.hidden, intermediate_size=run.intermediate, num_hidden_layers=run.layers,
                         num_attention_heads=run.heads, num_key_value_heads=8, vocab_size=128256,
                         rope_theta=500000.0, max_position_embeddings=run.seq)
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(torch.bfloat16)


#: torchtitan's selective checkpointing (``selective_ac_option = "op"``) saves the outputs of the
#: products and of attention and recomputes the rest of each layer; nbscaler's ``selective`` (Megatron-LM's)
#: recomputes the attention core, one SDPA kernel here. Neither is the other: the three rows bracket it.
RECOMPUTE = {"none": {"recompute": "none"}, "selective (attention core)": {"recompute": "selective"},
             "every layer": {"recompute": "full"}}


def predict_llama(run: PublishedLlamaRun, log: Callable = print) -> List[Dict[str, object]]:
    """The run as ZeRO data parallelism over its GPUs for each recomputation of ``RECOMPUTE``, each
    priced at the SXM's peak and at the NVL's."""
    model = hf_llama(run)
    ids = torch.zeros(run.local_batch, run.seq, dtype=torch.long)      # transformers' forward reads the ids' values
    rows = []
    for label, pas in RECOMPUTE.items():
        cc = ComputeConfig(1, run.gpus, use_end2end=True, use_zero=True, pas_config=pas)
        start = time.perf_counter()
        plan = nbscaler.plan(model, {"input_ids": ids, "labels": ids.clone()}, "data", cc)
        for peak in (None, H100_NVL_BF16):
            step = plan.step_figures(recipe=RECIPE, hardware=grand_teton_h100(max(1, run.gpus // 8), peak))
            rows.append({"recompute": label, "peak": "SXM, 989" if peak is None else "NVL, 836", "step": step,
                         "tokens_per_s_per_gpu": step.tokens_per_s / run.gpus, "shares": shares(step)})
            log(f"  {run.name} recompute {label}, {rows[-1]['peak']}: step {step.step_time_s:.2f} s, "
                f"{rows[-1]['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, {time.perf_counter() - start:.0f} s")
    return rows


def section(run: PublishedLlamaRun, rows: List[Dict[str, object]]) -> str:
    """The torchtitan section of the results: its table and what the rows say, computed."""
    from benchmarks.published.report import _shares
    lines = ["| model | GPUs | local batch x sequence | recomputation | bf16 peak (TFLOP/s) | step (s) | "
             "peak memory per GPU (GB) | fits | tokens/s per GPU, predicted | published | error | MFU | "
             "the step, by cause |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        step = r["step"]
        lines.append(f"| {run.name} | {run.gpus} | {run.local_batch} x {run.seq} | {r['recompute']} | {r['peak']} | "
                     f"{step.step_time_s:.2f} | {step.peak_bytes / 1e9:.1f} | {'yes' if step.fits else 'no'} | "
                     f"{r['tokens_per_s_per_gpu']:,.0f} | {run.tokens_per_s_per_gpu:,.0f} | "
                     f"{r['tokens_per_s_per_gpu'] / run.tokens_per_s_per_gpu - 1:+.0%} | {step.mfu:.0%} | "
                     f"{_shares(r['shares'])} |")
    fitting = [r for r in rows if r["step"].fits]
    errors = [r["tokens_per_s_per_gpu"] / run.tokens_per_s_per_gpu - 1 for r in fitting]
    said = (f"Of the {len(rows)} rows, {len(fitting)} fit in {rows[0]['step'].hardware.memory_bytes / 1e9:.0f} GB; "
            + (f"they predict {min(errors):+.0%} to {max(errors):+.0%} against the published "
               f"{run.tokens_per_s_per_gpu:,.0f} tokens/s per GPU." if fitting else "none does."))
    return (f"## torchtitan on H100 ({run.name}, FSDP on {run.gpus} GPUs)\n\n{__doc__.split(chr(10) + chr(10))[1]}\n\n"
            + "\n".join(lines) + f"\n\n{said}\n")
