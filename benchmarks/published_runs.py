"""nbscaler's predictions for published training runs, beside what those runs measured.

**Megatron-LM, 2021.** Rows of the weak-scaling table of Narayanan et al., "Efficient Large-Scale
Language Model Training on GPU Clusters Using Megatron-LM" (SC21, Table 1; also Megatron-LM's
README): GPT models with a vocabulary of 51,200 and sequences of 2,048 on DGX A100 (80 GB) nodes of
8 GPUs, mixed precision, full activation recomputation (every transformer block recomputed), Adam.
Their TFLOP/s per GPU counts the recomputed forward, i.e. ``hfu * peak`` in nbscaler's terms
(``nbscaler.columns``).

For each row the shipped GPT (``nbscaler.models.gpt``) is built on the meta device at the row's
size, planned with the row's tensor (``t``) and pipeline (``p``) parallelism and ``GPUs / (t p)``
data-parallel units, every block recomputed, in bf16, with 1F1B over the replica's micro-batches
(one stage when ``p = 1``: gradient accumulation), and priced with ``plan.summary(Adam,
master_dtype=torch.float32, hardware=...)``: nothing runs on this machine. What is modelled is what
the run did, each with its source, not a fit to the table:

- the recipe: fp32 master weights, fp32 gradients and Adam moments beside the bf16/fp16 model (the
  paper's mixed precision; ``master_dtype=torch.float32``), so the memory counts 18 bytes a
  parameter and the gradients are reduced in fp32 (Megatron-LM's ``arguments.py`` forces fp32
  gradient accumulation and all-reduce for bf16);
- the software: attention with the (B, heads, 2048, 2048) scores written to memory (2021 predates
  FlashAttention; ``Hardware.attention="materialized"``), and the data-parallel all-reduce after the
  backward, not during it (``overlap_grad_reduce=False``: Megatron-LM added
  ``--overlap-grad-reduce`` in September 2023, NVIDIA/Megatron-LM issues #391 and #456);
- the loop: before each step Megatron-LM clips the gradients' global norm (``--clip-grad`` defaults
  to 1.0) and its fp16 loss scaler unscales them and checks them for infinities, passes over the fp32
  gradients (``clip_grad_norm=True``, ``loss_scaling=True``); and it drops the attention
  probabilities with p = 0.1 (``--attention-dropout``, ``arguments.py``; ``attention_dropout=0.1``),
  one more pass over the materialised scores each way;
- the model: Megatron-LM's GPT drops its hidden states with p = 0.1 after the attention's output
  projection and after the MLP, before each residual add (``--hidden-dropout``, ``arguments.py``):
  the shipped GPT is built with ``dropout=0.1`` (``PublishedRun.gpt``), a dropout kernel per branch
  in every forward (recomputed too) and backward, its mask saved;
- the GPU: matrix products at the A100's measured cuBLAS ceiling (``Hardware.matmul_efficiency``), at
  the clock an A100 holds under sustained load (1,305 of 1,410 MHz, ``Hardware.sustained_clock_ratio``;
  the catalogue gives its source).

``left_out`` sizes, on the same plan, what is still not modelled and has a figure: the tied
embedding's all-reduce between the first and last stages, and what Megatron-LM's fusion of each
hidden dropout with its bias and residual add saves over the separate dropout and add kernels the
shipped GPT's trace runs (``nbscaler.cost.roofline``).

The paper does not give the micro-batch size: each candidate that divides a replica's share of the
batch is planned and the fastest whose predicted memory fits is kept (and said).

**torchtitan on H100s.** The one bf16 H100 row of torchtitan's published performance
(``docs/performance.md``, Table 1, torchtitan 9dec370, December 2024): Llama 3.1 8B, FSDP over 8
GPUs of one node, local batch 2 of 8,192 tokens, selective activation checkpointing, AdamW, 5,762
tokens/s per GPU, on Meta's Grand Teton H100s (96 GB HBM2e at 2.4 TB/s, 500 W power limit). It is
planned from its published shape (Hugging Face ``LlamaForCausalLM`` on meta) as data parallelism
with ZeRO over the 8 GPUs, fp32 masters, FlashAttention (PyTorch's SDPA on H100), the gradients'
norm clipped (its configs' ``max_norm = 1.0``), priced on an H100-SXM with that memory.

The shipped GPT differs from Megatron's in ways that move the figures: unfused bias and GELU, the
hidden dropouts as kernels apart from the residual add (Megatron fuses the bias, the dropout and the
add; ``left_out`` sizes the difference), the attention dropout priced from the target's software
(the shipped GPT's attention has none), an untied output layer. FSDP gathers each layer's parameters before its forward and backward, ZeRO-1 here does
not; both send the gradients once.

    python -m benchmarks.published_runs                 # writes benchmarks/results/published_runs.md
    python -m benchmarks.published_runs --rows 1.7      # one row, printed
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

import nbscaler
from nbscaler import ComputeConfig, Hardware
from nbscaler.cost.hardware import NumberFormat as Prec
from nbscaler.recipe import Recipe
from nbscaler.cost.nccl import NcclModel
from nbscaler.cost.roofline import drops, memory_seconds
from nbscaler.cost.step_figures import overlap_window
from nbscaler.cost.timing import StepModel, sync_time
from nbscaler.models.gpt import GPT, GPTConfig

RESULTS = Path(__file__).parent / "results" / "published_runs.md"
VOCAB, SEQ = 51200, 2048
MICROS = (1, 2, 4, 8, 16)
RECIPE = Recipe(master_dtype=torch.float32)  # fp32 masters, Adam state and gradient reduction
HIDDEN_DROPOUT = 0.1                         # Megatron-LM's --hidden-dropout default (arguments.py)


def megatron_2021(nodes: int) -> Hardware:
    """DGX A100 80 GB nodes running Megatron-LM as of 2021: scores materialised, reduction after the
    backward, the gradients' global norm clipped (``--clip-grad`` defaults to 1.0), fp16's loss
    scaler unscaling them and checking them for infinities (Megatron-LM's ``arguments.py`` and
    ``optimizer/optimizer.py``), and the attention probabilities dropped with p = 0.1
    (``--attention-dropout`` defaults to 0.1 in Megatron-LM's ``arguments.py``)."""
    return dataclasses.replace(Hardware.named("A100-SXM-80GB", nodes=nodes), attention="materialized",
                               overlap_grad_reduce=False, clip_grad_norm=True, loss_scaling=True,
                               attention_dropout=0.1)


def grand_teton_h100(nodes: int, bf16_peak: Optional[float] = None) -> Hardware:
    """Meta's Grand Teton H100 (torchtitan's docs/performance.md): 96 GB of HBM2e at 2.4 TB/s, 400 Gb/s
    RDMA per GPU. Its 500 W limit lowers the clock by an amount torchtitan does not know ("between SXM
    and NVL"): the SXM's peaks, or ``bf16_peak`` (the H100 NVL's, 835.5 TFLOP/s dense: the datasheet's
    1,671 sparse halved) for the other end."""
    hw = Hardware.named("H100-SXM-80GB", nodes=nodes)
    peaks = dict(hw.peak_flops_by_precision)
    name = "H100 (Grand Teton, 96 GB HBM2e)"
    if bf16_peak is not None:
        peaks.update({Prec.BF16: bf16_peak, Prec.FP16: bf16_peak})
        name += f", bf16 peak {bf16_peak / 1e12:.0f} TFLOP/s"
    return dataclasses.replace(hw, name=name, memory_bytes=96e9, memory_bytes_per_s=2.4e12,
                               peak_flops_by_precision=peaks, clip_grad_norm=True)   # its configs: max_norm = 1.0


H100_NVL_BF16 = 835.5e12


@dataclass(frozen=True)
class PublishedRun:
    """A Megatron-LM 2021 row: TFLOP/s per GPU as published (with the recomputed forward)."""

    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops_per_gpu: float
    source: str = "Narayanan et al. 2021 (SC21), Table 1"

    @property
    def units(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def per_replica(self) -> int:
        return self.batch // self.units

    def hardware(self) -> Hardware:
        return megatron_2021(self.gpus // 8)

    def gpt(self, vocab: Optional[int] = None, seq: Optional[int] = None) -> GPTConfig:
        """The row's GPT as Megatron-LM built it: its hidden states dropped with p = 0.1 after the
        attention's output projection and after the MLP (``--hidden-dropout`` defaults to 0.1 in
        Megatron-LM's ``arguments.py``)."""
        return GPTConfig(vocab_size=vocab or VOCAB, seq_len=seq or SEQ, n_layer=self.layers, d_model=self.hidden,
                         n_head=self.heads, dropout=HIDDEN_DROPOUT)


RUNS = [
    PublishedRun(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    PublishedRun(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    PublishedRun(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
]


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


def _tokens(micro: int) -> Dict[str, torch.Tensor]:
    idx = torch.zeros(micro, SEQ, dtype=torch.long, device="meta")
    return {"batch": {"idx": idx, "targets": idx.clone()}}


def plan_run(run: PublishedRun, micro: int) -> "nbscaler.Plan":
    """The row's GPT on meta, placed as the row was run: 1F1B over the replica's micro-batches of
    ``micro`` sequences (one stage without pipeline parallelism: gradient accumulation)."""
    with torch.device("meta"):
        model = GPT(run.gpt())
    cc = ComputeConfig(run.tp * run.pp, run.gpus, use_end2end=True, use_pipeline=True, pipeline_nstages=run.pp,
                       pipeline_nmicros=run.per_replica // micro, pipeline_scheduler="1f1b",
                       pas_config={"recompute_modules": ["blocks"]})
    return nbscaler.plan(model, _tokens(micro), "hybrid", cc, module_dtype=torch.bfloat16)


def breakdown(plan: "nbscaler.Plan", hw: Hardware, step: float) -> Dict[str, float]:
    """Seconds of rank 0's step by cause: its ops (forward, recomputed forward and backward), its tp
    collectives, the part of the data-parallel reduction the backward does not hide, and the rest
    (the pipeline's bubble and sends, the optimizer step)."""
    model = StepModel(plan.placed, runs=plan.local_runs, hardware=hw)
    ops, nccl = model.profiler, model.comm
    blocks = plan.config.pipeline_nmicros if plan.config.use_pipeline else 1
    run = next(iter(plan.local_runs[0].values()))
    compute = sum(sum(ops.time(op)) + (ops.time(op)[0] if op.recomputed else 0.0) for op in run.ops)
    tp = sum(nccl.forward(c.fn, c.in_bytes, len(c.devices), c.devices) * (2 if c.recomputed else 1)
             + nccl.backward(c.fn, c.in_bytes, len(c.devices), c.devices) for c in run.collectives)
    overlap = overlap_window((b for _, b in model.times[0].values()), hw)
    dp = sync_time(plan.placed, 0, nccl, RECIPE, overlap)
    out = {"compute": blocks * compute, "tp collectives": blocks * tp, "dp all-reduce (exposed)": dp}
    out["bubble, sends, optimizer"] = step - sum(out.values())
    return out


def price(plan: "nbscaler.Plan", hw: Hardware, optimizer=torch.optim.Adam) -> Dict[str, object]:
    """The summary's figures for the whole job: the slowest rank's step, the largest peak, throughput."""
    s = plan.summary(optimizer, hardware=hw, master_dtype=torch.float32)
    step = float(s.step_time_s.max())
    return {"step_s": step, "peak_gb": float(s.peak_bytes.max()) / 1e9, "fits": bool(s.fits.all()),
            "tflops": float(s.hardware_flops.sum()) / (step * len(s)) / 1e12, "mfu": float(s.mfu.mean()),
            "tokens_per_s_per_gpu": float(s.tokens_per_s.iloc[0]) / len(s), "plan": plan}


def fastest_that_fits(make: Callable[[int], "nbscaler.Plan"], hw: Hardware, micros: List[int],
                      label: str) -> Dict[str, object]:
    """Plan with each micro-batch size, keep the fastest whose memory fits (the last tried if none)."""
    best = row = None
    for micro in micros:
        start = time.perf_counter()
        row = {"micro": micro, **price(make(micro), hw)}
        print(f"  {label} micro {micro}: step {row['step_s']:.2f} s, {row['tflops']:.1f} TFLOP/s, "
              f"peak {row['peak_gb']:.1f} GB, {time.perf_counter() - start:.0f} s to plan and price", flush=True)
        if row["fits"] and (best is None or row["step_s"] < best["step_s"]):
            best = row
    return best or row


ABLATIONS = {
    "FlashAttention": dict(attention="flash"),
    "no attention dropout": dict(attention_dropout=0.0),
    "boost clock (1,410 MHz)": dict(sustained_clock_ratio=1.0),
    "reduction during the backward": dict(overlap_grad_reduce=True),
    "matmul ceiling 0.80": dict(matmul_efficiency=0.80),
    "no gradient clipping or loss scaler": dict(clip_grad_norm=False, loss_scaling=False),
}


def ablation(run: PublishedRun, plan: "nbscaler.Plan", step: float) -> Dict[str, float]:
    """How much each modelled fact of the 2021 run moves the step: the step with that one fact
    undone, over the step with all of them, less one (the plan is re-priced, not re-traced)."""
    hw = run.hardware()
    out = {k: float(plan.summary(torch.optim.Adam, hardware=dataclasses.replace(hw, **v),
                                 master_dtype=torch.float32).step_time_s.max()) / step - 1
           for k, v in ABLATIONS.items()}
    out["Adam state and reduction in bf16"] = float(plan.summary(torch.optim.Adam, hardware=hw, master_dtype=None)
                                                   .step_time_s.max()) / step - 1
    return out


def ablation_table(rows: List[Dict[str, object]], key: str = "ablation") -> str:
    names = list(rows[0][key])
    lines = ["| params (B) | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for r in rows:
        lines.append(f"| {r['run'].params_b} | " + " | ".join(f"{r[key][n]:+.1%}" for n in names) + " |")
    return "\n".join(lines)


def unfused_dropout_s(plan: "nbscaler.Plan", hw: Hardware) -> float:
    """Seconds rank 0's separate dropout and residual-add kernels spend over Megatron-LM's fused
    bias-dropout-add (``nbscaler.cost.roofline``): the dropout's output written and read again,
    ``2 * itemsize`` bytes an element in every forward, the recomputed ones too."""
    blocks = plan.config.pipeline_nmicros if plan.config.use_pipeline else 1
    run = next(iter(plan.local_runs[0].values()))
    extra = sum(2 * math.prod(shape) * dtype.itemsize * (2 if op.recomputed else 1)
                for op in run.ops if drops(op.node) for shape, dtype in op.out_shapes)
    return blocks * memory_seconds(extra, hw.memory_bytes_per_s)


def left_out(run: PublishedRun, plan: "nbscaler.Plan", step: float) -> Dict[str, float]:
    """How much the effects the model leaves out would lengthen (or, negative, shorten) the step, sized
    on the same plan: the tied embedding's all-reduce (the shipped GPT has no tied embedding to plan it
    from) and the hidden dropouts' fusion with the residual add (priced as separate kernels). Sizes,
    not corrections applied."""
    hw = run.hardware()
    tied = 0.0
    if run.pp > 1:          # the first and last stages' copies of the tied embedding, fp32 gradients
        ends = [0, (run.pp - 1) * run.tp]                   # tp ranks adjacent, then pipeline stages
        tied = NcclModel(hw).all_reduce(VOCAB * run.hidden // run.tp * 4, 2, hw.link(ends))
    return {"tied embedding all-reduce": tied / step, "bias-dropout-add fused": -unfused_dropout_s(plan, hw) / step}


def left_out_table(rows: List[Dict[str, object]]) -> str:
    """Each left-out effect's share of the step, and the TFLOP/s and error the row would have with
    them (the step lengthened by their sum)."""
    names = list(rows[0]["left out"])
    lines = ["| params (B) | " + " | ".join(names) + " | TFLOP/s per GPU with them | error |",
             "| --- |" + " --- |" * (len(names) + 2)]
    for r in rows:
        shares, run = r["left out"], r["run"]
        together = sum(shares.values())
        tflops = r["best"]["tflops"] / (1 + together)
        lines.append(f"| {run.params_b} | " + " | ".join(f"{shares[n]:+.1%}" for n in names)
                     + f" | {tflops:.0f} | {tflops / run.tflops_per_gpu - 1:+.1%} |")
    return "\n".join(lines)


def predict(run: PublishedRun, micros: Optional[List[int]] = None) -> Dict[str, object]:
    """The fastest micro-batch that fits, and its figures."""
    candidates = [m for m in (micros or MICROS) if run.per_replica % m == 0]
    return fastest_that_fits(lambda m: plan_run(run, m), run.hardware(), candidates, f"{run.params_b}B")


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


def predict_llama(run: PublishedLlamaRun) -> List[Dict[str, object]]:
    """torchtitan's FSDP run as ZeRO data parallelism over its GPUs, without recomputation and with
    every layer recomputed (its selective checkpointing lies between), each priced at the SXM's peak
    and at the NVL's (its power-limited GPUs lie between)."""
    model = hf_llama(run)
    ids = torch.zeros(run.local_batch, run.seq, dtype=torch.long)      # transformers' forward reads the ids' values
    nodes = max(1, run.gpus // 8)
    rows = []
    for recompute in ([], ["model.layers"]):
        cc = ComputeConfig(1, run.gpus, use_end2end=True, use_zero=True, pas_config={"recompute_modules": recompute})
        start = time.perf_counter()
        plan = nbscaler.plan(model, {"input_ids": ids, "labels": ids.clone()}, "data", cc)
        for peak in (None, H100_NVL_BF16):
            hw = grand_teton_h100(nodes, peak)
            row = {"recompute": "every layer" if recompute else "none", "hardware": hw,
                   "peak": "SXM, 989" if peak is None else "NVL, 836", **price(plan, hw, torch.optim.AdamW)}
            print(f"  {run.name} recompute {row['recompute']}, {row['peak']}: step {row['step_s']:.2f} s, "
                  f"{row['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, {time.perf_counter() - start:.0f} s", flush=True)
            rows.append(row)
    return rows


def _causes(parts: Dict[str, float], step: float) -> str:
    return ", ".join(f"{k} {v / step:.0%}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))


def table(rows: List[Dict[str, object]]) -> str:
    lines = ["| params (B) | t | p | GPUs | batch | micro-batch | step (s) | peak memory per GPU (GB) | fits | "
             "TFLOP/s per GPU, predicted | published | error | MFU | dominated by (share of the step) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        run, best = r["run"], r["best"]
        error = best["tflops"] / run.tflops_per_gpu - 1
        lines.append(f"| {run.params_b} | {run.tp} | {run.pp} | {run.gpus} | {run.batch} | {best['micro']} | "
                     f"{best['step_s']:.2f} | {best['peak_gb']:.1f} | {'yes' if best['fits'] else 'no'} | "
                     f"{best['tflops']:.0f} | {run.tflops_per_gpu:.0f} | {error:+.0%} | {best['mfu']:.0%} | "
                     f"{_causes(r['breakdown'], best['step_s'])} |")
    return "\n".join(lines)


def llama_table(run: PublishedLlamaRun, rows: List[Dict[str, object]]) -> str:
    lines = ["| model | GPUs | local batch x sequence | recomputation | bf16 peak (TFLOP/s) | step (s) | "
             "peak memory per GPU (GB) | fits | tokens/s per GPU, predicted | published | error | MFU | "
             "dominated by (share of the step) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        error = r["tokens_per_s_per_gpu"] / run.tokens_per_s_per_gpu - 1
        lines.append(f"| {run.name} | {run.gpus} | {run.local_batch} x {run.seq} | {r['recompute']} | {r['peak']} | "
                     f"{r['step_s']:.2f} | {r['peak_gb']:.1f} | {'yes' if r['fits'] else 'no'} | "
                     f"{r['tokens_per_s_per_gpu']:,.0f} | "
                     f"{run.tokens_per_s_per_gpu:,.0f} | {error:+.0%} | {r['mfu']:.0%} | "
                     f"{_causes(r['breakdown'], r['step_s'])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", type=float, help="only these sizes (billions), printed not written")
    parser.add_argument("--micros", nargs="*", type=int, help="micro-batch sizes to try (default: all that divide)")
    parser.add_argument("--no-llama", action="store_true", help="leave out the torchtitan row")
    parser.add_argument("--llama-only", action="store_true", help="only the torchtitan row, printed")
    args = parser.parse_args()
    rows = []
    for run in RUNS:
        if args.llama_only or (args.rows is not None and run.params_b not in args.rows):
            continue
        best = predict(run, args.micros)
        rows.append({"run": run, "best": best, "breakdown": breakdown(best["plan"], run.hardware(), best["step_s"]),
                     "ablation": ablation(run, best["plan"], best["step_s"]),
                     "left out": left_out(run, best["plan"], best["step_s"])})
    text = table(rows) + ("\n\n" + ABLATION_HEADER + ablation_table(rows) + "\n\n" + LEFT_OUT_HEADER
                          + left_out_table(rows) if rows else "")
    print(text)
    llama = ""
    if not args.no_llama:
        for run in LLAMA_RUNS:
            found = predict_llama(run)
            for r in found:
                r["breakdown"] = breakdown(r["plan"], r["hardware"], r["step_s"])
            llama += llama_table(run, found) + "\n"
        print(llama)
    if args.rows is None and not args.no_llama and not args.llama_only:
        from benchmarks.published_sweep import section       # nbscaler's own choice beside each run
        RESULTS.write_text(HEADER + text + "\n" + MEGATRON_NOTES + LLAMA_HEADER + llama + FOOTER
                           + section(RUNS, VOCAB, SEQ))


HEADER = """# Published runs, predicted

Written by `python -m benchmarks.published_runs` (its docstring gives the method and the sources).
Nothing is fitted to these tables: every efficiency, latency and bandwidth is a figure with its own
source in `nbscaler/cost/hardware.py` and `nbscaler/cost/roofline.py`.

## Megatron-LM 2021 on DGX A100 (Narayanan et al. 2021, SC21, Table 1)

Priced on `Hardware.named("A100-SXM-80GB")` with Megatron-LM's software of 2021
(`attention="materialized"`, `overlap_grad_reduce=False`, the gradients' norm clipped and fp16's
loss scaler: `clip_grad_norm=True`, `loss_scaling=True`, the attention probabilities dropped with
p = 0.1: `attention_dropout=0.1`), its GPT's hidden states dropped with p = 0.1 after the attention
and the MLP (`GPTConfig(dropout=0.1)`) and its recipe (fp32 master weights, gradients reduced in fp32,
fp32 Adam moments: `master_dtype=torch.float32`), its products and attention at the A100's
sustained clock (1,305 of 1,410 MHz: the catalogue's `sustained_clock_ratio`). *TFLOP/s per GPU*
counts the recomputed forward, as the paper does (`hfu` times the bf16 peak at the boost clock,
312 TFLOP/s); *error*
is predicted over published, less one; *micro-batch* is the fastest that fits by nbscaler's own
prediction (the paper does not give it). *Dominated by* splits rank 0's step.

"""

ABLATION_HEADER = """How much each modelled fact of the 2021 run moves the predicted step, each undone alone on the
same plan (a negative figure: undoing it makes the step shorter, so the fact lengthens it):

"""

LEFT_OUT_HEADER = """What the model still leaves out and can be sized, on the same plan (the share by which it would
lengthen the predicted step, or shorten it where negative; not in the table above):

"""

MEGATRON_NOTES = """
The three rows are within the 15% aimed at: -3.0%, +5.3% and +12.8% (133, 142 and 167 TFLOP/s
against 137, 135 and 148). Before Megatron-LM's hidden dropouts were priced and an embedding's
lookup counted as the gather it is (it had counted as a product over the whole table, in the FLOPs
and in where the pipeline cuts fall) they were +1.0%, +9.8% and +15.5% (138, 148 and 171); before the A100's sustained clock and Megatron-LM's attention dropout
were, +17%, +19% and +25% (160, 160 and 185 TFLOP/s); before the run's recipe and software were
(FlashAttention, a bf16 reduction hidden in the backward, Adam's state in bf16, matrix products at
80% of the peak), +53%, +27% and +23%. Each of these is a fact of the run with its own source, none
fitted to the table:

- **The clock under load.** The 312 TFLOP/s peak assumes the A100's 1,410 MHz boost clock; NVIDIA
  computed its HPL peak at 1,305 MHz, the clock an A100 holds at its power limit (G. Lockwood,
  "Peak FLOPS"). The catalogue's A100s carry that ratio (`Hardware.sustained_clock_ratio`) and the
  roofline runs compute-bound kernels at it; MFU and the TFLOP/s column stay quoted against the
  boost peak, as the paper's are. The 85.9% matmul ceiling is mamf-finder's best-of-sweep figure,
  which its README (S. Bekman, *Machine Learning Engineering*) defines as a burst at the boost clock
  (MAMF), beside a separate sustained figure (MSMF) for what training sees: the clock is not counted
  twice. It lengthens the steps by 4 to 6%, most where products dominate (the table above).
- **Attention dropout.** Megatron-LM drops the attention probabilities with p = 0.1 by default
  (`--attention-dropout`, `arguments.py`), a `torch.nn.Dropout` over the materialised (B, heads,
  2,048, 2,048) probabilities (`attention_dropout=0.1`): one more memory-bound pass in every
  forward (two under recomputation) and in the backward, each moving 5 bytes a score (bf16 in and
  out, PyTorch's one-byte mask). The shipped GPT's attention has no dropout; the target's software
  adds the pass. It weighs most on the 1.7B row, whose micro-batch of 16 sequences holds 24 heads of
  scores: 10% of its step.
- **Hidden dropout.** Megatron-LM's GPT also drops its hidden states with p = 0.1
  (`--hidden-dropout`, `arguments.py`) after the attention's output projection and after the MLP,
  before each residual add. The shipped GPT is built with `dropout=0.1`, which traces an
  `F.dropout` there; the roofline prices it as PyTorch's `native_dropout` on a GPU, one pass each
  way moving 5 bytes an element (bf16 in and out, a one-byte mask), in every forward (two under
  recomputation) and backward. With tensor parallelism the dropout runs on the whole hidden state on
  every rank of the group, as Megatron-LM's did in 2021 (before sequence parallelism). It lengthens
  the steps by 1.1%, 3.5% and 2.2% (3.60 to 3.64 s, 8.63 to 8.93 s, 21.52 to 22.00 s), most on the
  18.4B row, whose 8 tensor-parallel ranks each drop the whole (16, 2,048, 6,144) hidden state.
  Megatron fuses the bias, the dropout and the add into one kernel (`--bias-dropout-fusion`, on by
  default; the paper's section 4.2); the separate kernels priced here write the dropout's output and
  read it again, 4 bytes an element more in each forward: the last table below sizes that.

The memory column counts what Megatron held: 18 bytes a parameter (bf16 weights and gradients, fp32
master weights and Adam moments); the materialised scores and the dropouts' masks, held while one
block's recomputed forward is back-propagated, are not counted, so the hidden dropouts leave it as
it was. Without recomputation (the sweep's first rows, last section) the hidden dropouts' masks are
held from the forward to the backward and counted as this machine's PyTorch keeps them, in the
activations' dtype (2 bytes an element in bf16) where a GPU's `native_dropout` keeps one byte: that
overstates those peaks, by about 4 GB of the 145.6B row's 41 GB (10 layers of two 2,048 x 12,288
masks for each of the first stage's 8 micro-batches in flight). The gradient clipping and loss
scaler's passes over the fp32 gradients (three and two tensors an element) weigh 0.1 to 0.6% of a
step.

The last table sizes the two effects still left out that have a figure. **The tied embedding's
all-reduce** between the first and last stages (p > 1 only), the fp32 gradient of the 51,200 x
12,288 / 8 embedding between two nodes over InfiniBand: the shipped GPT has a separate output
layer, whose gradient the data-parallel reduction already counts, so there is no tied weight to
plan it from; it is 0.06% of the 145.6B row's step. **The bias-dropout-add fusion**: the time rank
0's separate dropout kernels spend writing their output for the add to read (4 bytes an element in
each forward, the recomputed ones too), which Megatron's fused kernel does not; it would shorten
the steps by 0.5%, 1.8% and 1.1%. With both the rows would be at -2.5%, +7.2% and +13.9%. Not
sized, and each would lower the prediction further:

- **The products at the models' own shapes.** The ceiling is the best shape of a sweep, and the
  ramp that makes small products slower is an estimate. No GPU was lent to time these models'
  products, and no shape-level A100 measurement was found as figures (Anthony et al. 2024, "The Case
  for Co-Designing Model Architectures with Hardware", and NVIDIA's *Matrix Multiplication
  Background User's Guide* publish theirs as plots). At micro-batch 1 the 145.6B row's forward
  products are 2,048 rows by 4,608 to 12,288 columns: in 256 x 128 tiles, the guide's most
  efficient, that is 2.7 to 7.1 waves over the A100's 108 SMs, whose last partial wave would leave
  11% of the time idle; cuBLAS's choice among tile shapes makes the true loss smaller and unknown.
- **Megatron's host.** The data loader and the host's time between kernel launches (eager PyTorch).
- **No stalls.** Ranks are assumed in step; a collective never waits for a slower peer.
"""
LLAMA_HEADER = """
## torchtitan on H100 (Llama 3.1 8B, FSDP on 8 GPUs)

Priced on an H100-SXM with the Grand Teton's 96 GB of HBM2e at 2.4 TB/s, FlashAttention, the
reduction overlapping the backward, fp32 masters (torchtitan's FSDP keeps fp32 parameters and
reduces in fp32), the gradients' norm clipped (`max_norm = 1.0` in its configs). *Tokens/s per GPU* is what torchtitan reports (its MFU is not compared: its
footnote says the GPUs' peak is unknown). The run used selective activation checkpointing; the
two rows bracket it: none recomputed, and every layer recomputed.

"""
FOOTER = """
The published 5,762 tokens/s lies inside the bracket the four rows draw (5,527 to 8,027; errors
-4% to +39%; 5,538 to 8,052 before the clipping's passes over the fp32 gradients were counted): selective checkpointing recomputes part of each layer (between the two
recomputation rows), and the 500 W GPUs run between the NVL's peak and the SXM's. Only with
recomputation does the step fit in 96 GB (57 GB; 158 GB without), which is why the run
checkpoints. Left out: FSDP gathers each layer's bf16 parameters before its forward and again
before its backward (2 x 14 GB of bus bytes at 450 GB/s on NVLink, about 0.06 s a step if nothing
hid it, 2% of the step), the eager launch overhead between kernels, and the selective policy's
exact choice of what to recompute.
"""


if __name__ == "__main__":
    main()
