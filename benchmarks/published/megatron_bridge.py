"""Megatron-Bridge's GPT-OSS 120B on 64 H100s: a mixture of experts with expert parallelism.

NVIDIA's Megatron-Bridge performance summary (NeMo container 25.11, DGX-H100) trains GPT-OSS 120B
in BF16 on 64 H100s with TP 1, PP 4 and EP 8, micro-batch 4, global batch 512 of 4,096 tokens, and
publishes 5,630 tokens/s and 153 model TFLOP/s per GPU. The model is GPT-OSS 120B's shape as
Hugging Face's ``GptOssConfig`` gives it by default: 36 layers, hidden size 2,880, 64 query heads
of 64 channels sharing 8 key-value heads, every other layer (the first, the third, ...) attending
over a sliding window of 128 keys and the others over every earlier key, 128 routed experts of
width 2,880 of which each token takes 4, a vocabulary of 201,088; nbscaler's ``MoELlama`` at that
shape (``sliding_window=128, window_layers="alternate"``: ``nbscaler.attention.window``) has 116.8 B
parameters, as the model card counts. It is planned on meta with ``hybrid``: 4 stages of 8 devices, each stage's
experts split over its 8 devices (``pas_config={"expert_parallel": 8}``) and everything else split
by batch over them, so each device runs 4 sequences a micro-batch as in the run, in 2 data-parallel
units; 8 micro-batches of 32 sequences a unit make the global batch. 1F1B, bf16 weights with fp32
masters and gradients reduced in fp32 (Megatron's bf16 mixed precision), AdamW, Megatron's
distributed optimizer as ZeRO-1, priced on ``Hardware.named("H100-SXM-80GB", nodes=8)`` running
Megatron's attention: Transformer Engine's cuDNN kernels (``Software(attention="cudnn")``), each
windowed layer's kernel computing the band of 128 keys alone, as a windowed fused kernel skips the
blocks outside it.

The run's routing is taken as forced balance, as Megatron-Bridge's performance recipes force it
(``moe_router_force_load_balancing``): nbscaler prices dropless routing with every expert served
the same number of tokens, its default.

The summary does not say which layers the run recomputes. Two rows bracket it: none, and every
layer (Megatron's full recomputation).

What is not priced, or priced from a figure measured at another shape, each named with the way it
moves the figure:

- its attention sinks (one learned logit a head), the biases of its projections and experts, and its
  clamped SwiGLU are element-wise work of a few bytes a token, not priced;
- cuDNN's speed-up over FlashAttention-2 is the one FlashAttention-3's paper measured without a mask
  (``cost.roofline.CUDNN_OVER_FLASH2``); its speed on a windowed band of 128 keys is not published,
  and a band that narrow fills fewer of the kernel's tiles than a full causal triangle does, so the
  predicted windowed attention is likely faster than the run's;
- Megatron shards the optimizer state of the layers around the experts over all 16 data-parallel
  replicas of a stage, and the experts' over 2; nbscaler's ZeRO-1 shards both over its 2 units, so
  its peak holds more state than the run's (the step barely moves).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch

import nbscaler
from benchmarks.published.predict import shares
from nbscaler import ComputeConfig, Hardware, Recipe, Software
from nbscaler.models.moe import MoEConfig, MoELlama

#: The goal the row is held to: predicted tokens/s per GPU within 15% of the published.
GOAL = 0.15
GIB = 2 ** 30
RECIPE = Recipe(torch.optim.AdamW, module_dtype=torch.bfloat16, master_dtype=torch.float32,
                grad_reduce_dtype=torch.float32)
RECOMPUTE = {"none": "none", "every layer": "full"}


@dataclass(frozen=True)
class PublishedMoERun:
    """A published MoE run: its layout, batch and what it measured per GPU."""

    name: str
    gpus: int
    pp: int
    ep: int
    micro_batch: int            # sequences a device runs at once
    global_batch: int
    seq: int
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    source: str

    @property
    def units(self) -> int:
        """Data-parallel units: copies of the ``pp x ep`` devices of one plan."""
        return self.gpus // (self.pp * self.ep)

    @property
    def micro_batches(self) -> int:
        """Micro-batches a unit's pipeline runs a step."""
        return self.global_batch // (self.units * self.ep * self.micro_batch)


GPT_OSS_120B = PublishedMoERun("GPT-OSS 120B", 64, 4, 8, 4, 512, 4096, 5630, 153,
                               "Megatron-Bridge performance summary, NeMo 25.11, DGX-H100, BF16")
#: GPT-OSS 120B's shape (Hugging Face ``GptOssConfig`` defaults, the 120B model).
SHAPE = dict(vocab_size=201088, n_layer=36, d_model=2880, n_head=64, n_kv_head=8, head_dim=64, n_experts=128,
             top_k=4, expert_hidden=2880, rope_base=150000.0, sdpa=True, sliding_window=128, window_layers="alternate")
#: What the run computes attention with: Megatron-Core's Transformer Engine, whose fused attention on
#: Hopper GPUs is cuDNN's.
SOFTWARE = Software(attention="cudnn", name="Megatron-Bridge 25.11 (Transformer Engine)")


def model(run: PublishedMoERun, **shape) -> torch.nn.Module:
    """``MoELlama`` at GPT-OSS 120B's shape (``shape`` overrides it), dropless, in bf16 on meta."""
    with torch.device("meta"):
        return MoELlama(MoEConfig(seq_len=run.seq, **{**SHAPE, **shape})).to(torch.bfloat16)


def config(run: PublishedMoERun, recompute: str) -> ComputeConfig:
    """The run's layout: ``pp`` stages of ``ep`` devices, experts split over each stage's devices."""
    return ComputeConfig(run.pp * run.ep, run.gpus, use_end2end=True, use_pipeline=True, pipeline_nstages=run.pp,
                         pipeline_nmicros=run.micro_batches, use_zero=True, zero_stage=1,
                         pas_config={"expert_parallel": run.ep, "recompute": recompute})


def step_shares(step) -> Dict[str, float]:
    """The slowest device's step by cause; without tensor parallelism a section's collectives are
    expert parallelism's all-to-alls (and the loss's sum)."""
    out = shares(step)
    out["expert all-to-alls"] = out.pop("tp collectives")
    return out


def predict_moe(run: PublishedMoERun = GPT_OSS_120B, log: Callable = print, **shape) -> List[Dict[str, object]]:
    """The run planned and priced once per recomputation of ``RECOMPUTE``."""
    net = model(run, **shape)
    ids = torch.zeros(run.ep * run.micro_batch, run.seq, dtype=torch.long)      # one unit's micro-batch
    hardware = Hardware.named("H100-SXM-80GB", nodes=run.gpus // 8).running(SOFTWARE)
    rows = []
    for label, recompute in RECOMPUTE.items():
        start = time.perf_counter()
        plan = nbscaler.plan(net, {"idx": ids, "targets": ids.clone()}, "hybrid", config(run, recompute))
        step = plan.step_figures(recipe=RECIPE, hardware=hardware)
        tokens = step.tokens_per_s / run.gpus
        flops_per_token = step.tokens_per_s and step.flops / (step.tokens_per_s * step.step_time_s)
        rows.append({"recompute": label, "step": step, "tokens_per_s_per_gpu": tokens,
                     "tokens_error": tokens / run.tokens_per_s_per_gpu - 1, "peak_gib": step.peak_bytes / GIB,
                     "flops_per_token": flops_per_token, "shares": step_shares(step),
                     "params": sum(p.numel() for p in net.parameters())})
        log(f"  {run.name}, recompute {label}: {tokens:,.0f} tokens/s per GPU (published "
            f"{run.tokens_per_s_per_gpu:,.0f}), peak {rows[-1]['peak_gib']:.1f} GiB, {time.perf_counter() - start:.0f} s")
    return rows


def verdict(run: PublishedMoERun, rows: List[Dict[str, object]]) -> str:
    """The goal, met or not, in figures, and where the published figure lies against the bracket."""
    at = {r["recompute"]: r for r in rows}
    lo, hi = at["every layer"]["tokens_per_s_per_gpu"], at["none"]["tokens_per_s_per_gpu"]
    where = ("below both" if run.tokens_per_s_per_gpu < lo else "above both" if run.tokens_per_s_per_gpu > hi
             else "between them")
    met = [r["recompute"] for r in rows if abs(r["tokens_error"]) <= GOAL]
    unfit = [r["recompute"] for r in rows if not r["step"].fits]
    return (f"The run's recomputation lies between the two rows, whose tokens/s per GPU are {lo:,.0f} (every layer) "
            f"and {hi:,.0f} (none); the published {run.tokens_per_s_per_gpu:,.0f} is {where}. Within {GOAL:.0%}: "
            + (", ".join(met) if met else "neither row") + f". The goal (the run's prediction within {GOAL:.0%}) is "
            + ("met by every row of the bracket." if len(met) == len(rows) else
               "met only if the run's recomputation is priced as a row that meets it." if met else "not met.")
            + (f" The {' and '.join(repr(u) for u in unfit)} row does not fit the "
               f"{rows[0]['step'].hardware.memory_bytes / 1e9:.0f} GB of an H100 by nbscaler's count." if unfit else ""))


def section(run: PublishedMoERun, rows: List[Dict[str, object]]) -> str:
    """The section of the results: the facts, the rows, the FLOPs a token and the verdict, computed."""
    from benchmarks.published.report import _shares
    paragraphs = [p.strip() for p in __doc__.split("\n\n")]
    lines = ["| recomputation | step (s) | tokens/s per GPU, predicted | published | error | peak per GPU (GiB) | "
             f"fits in {rows[0]['step'].hardware.memory_bytes / 1e9:.0f} GB | nbscaler's FLOPs a token (G) | the step, by cause |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        step = r["step"]
        lines.append(f"| {r['recompute']} | {step.step_time_s:.2f} | {r['tokens_per_s_per_gpu']:,.0f} | "
                     f"{run.tokens_per_s_per_gpu:,.0f} | {r['tokens_error']:+.1%} | {r['peak_gib']:.1f} | "
                     f"{'yes' if step.fits else 'no'} | {r['flops_per_token'] / 1e9:.1f} | {_shares(r['shares'])} |")
    published_flops = run.tflops_per_gpu * 1e12 / run.tokens_per_s_per_gpu
    flops = (f"The published figures imply {published_flops / 1e9:.1f} GFLOPs a token ({run.tflops_per_gpu:g} TFLOP/s over "
             f"{run.tokens_per_s_per_gpu:,.0f} tokens/s); nbscaler counts {rows[0]['flops_per_token'] / 1e9:.1f} for the run without recomputation "
             f"(every attention pair and each token's {SHAPE['top_k']} experts, forward and backward), "
             f"{rows[0]['params'] / 1e9:.1f} B parameters in all.")
    return (f"## Megatron-Bridge on DGX-H100 ({run.name}, experts over {run.gpus} GPUs)\n\n" + "\n\n".join(paragraphs[1:])
            + "\n\n" + "\n".join(lines) + f"\n\n{flops}\n\n{verdict(run, rows)}\n")


#: The README carries the row's summary between these markers, rewritten with the results.
START, END = "<!-- megatron-bridge-moe: written by python -m benchmarks.published_runs -->", "<!-- /megatron-bridge-moe -->"


def summary_block(run: PublishedMoERun, rows: List[Dict[str, object]]) -> str:
    """The README's short table of the bracket and its verdict."""
    lines = ["| recomputation | tokens/s per GPU, predicted | published | error | fits |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['recompute']} | {r['tokens_per_s_per_gpu']:,.0f} | {run.tokens_per_s_per_gpu:,.0f} | "
              f"{r['tokens_error']:+.1%} | {'yes' if r['step'].fits else 'no'} |" for r in rows]
    return "\n".join(lines) + "\n\n" + verdict(run, rows)


if __name__ == "__main__":
    print(section(GPT_OSS_120B, predict_moe()))
