"""nbscaler's predictions for published training runs, beside what those runs measured.

The runs are rows of the weak-scaling table of Narayanan et al., "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM" (SC21, Table 1): GPT models with a vocabulary of
51,200 and sequences of 2,048 on DGX A100 (80 GB) nodes of 8 GPUs, bf16/fp16 mixed precision,
full activation recomputation (every transformer block recomputed), Adam. Their TFLOP/s per GPU
counts the recomputed forward, i.e. ``hfu * peak`` in nbscaler's terms (``nbscaler.columns``).

For each row the shipped GPT (``nbscaler.models.gpt``) is built on the meta device at the row's
size, planned with the row's tensor (``t``) and pipeline (``p``) parallelism and ``GPUs / (t p)``
data-parallel units, every block recomputed, in bf16, and priced with ``plan.summary(hardware=
Hardware.named("A100-SXM-80GB", nodes=GPUs / 8))``: nothing runs on this machine. The paper does
not give the micro-batch size: each candidate that divides a pipeline's share of the batch is
planned and the fastest whose predicted memory fits is kept. Without a pipeline (``p = 1``)
``plan.summary`` prices a step of one sample, so a replica's whole share of the batch is traced as
one micro-batch.

The shipped GPT differs from Megatron's in ways that move the figures: unfused bias, GELU, dropout-free
layers and PyTorch's attention (FlashAttention's cost, where Megatron in 2021 materialised the
scores with a fused softmax); its optimizer state is counted in the model's dtype (bf16), where
Megatron keeps fp32 master weights and moments.

    python -m benchmarks.published_runs                 # writes benchmarks/results/published_runs.md
    python -m benchmarks.published_runs --rows 1.7      # one row, printed
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import torch

import nbscaler
from nbscaler import ComputeConfig, Hardware
from nbscaler.cost.timing import StepModel, sync_time
from nbscaler.models.gpt import GPT, GPTConfig

RESULTS = Path(__file__).parent / "results" / "published_runs.md"
VOCAB, SEQ = 51200, 2048


@dataclass(frozen=True)
class PublishedRun:
    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    tflops_per_gpu: float          # as published: with the recomputed forward
    hardware: str = "A100-SXM-80GB"
    source: str = "Narayanan et al. 2021 (SC21), Table 1"

    @property
    def units(self) -> int:
        return self.gpus // (self.tp * self.pp)

    @property
    def per_replica(self) -> int:
        return self.batch // self.units


RUNS = [
    PublishedRun(1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    PublishedRun(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    PublishedRun(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
]


def _tokens(micro: int) -> Dict[str, torch.Tensor]:
    idx = torch.zeros(micro, SEQ, dtype=torch.long, device="meta")
    return {"batch": {"idx": idx, "targets": idx.clone()}}


def plan_run(run: PublishedRun, micro: int) -> "nbscaler.Plan":
    """The row's GPT on meta, placed as the row was run with micro-batches of ``micro`` sequences."""
    cfg = GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=run.layers, d_model=run.hidden, n_head=run.heads)
    with torch.device("meta"):
        model = GPT(cfg)
    n = run.tp * run.pp
    pas = {"recompute_modules": ["blocks"]}
    if run.pp > 1:
        cc = ComputeConfig(n, run.gpus, use_end2end=True, use_pipeline=True, pipeline_nstages=run.pp,
                           pipeline_nmicros=run.per_replica // micro, pipeline_scheduler="1f1b", pas_config=pas)
        policy = "hybrid"
    else:
        cc = ComputeConfig(n, run.gpus, use_end2end=True, pas_config=pas)
        policy = "tp" if run.tp > 1 else "data"
    return nbscaler.plan(model, _tokens(micro), policy, cc, module_dtype=torch.bfloat16)


def breakdown(plan: "nbscaler.Plan", hw: Hardware, step: float) -> Dict[str, float]:
    """Seconds of rank 0's step by cause: its ops (forward, recomputed forward and backward), its tp
    collectives, the part of the data-parallel reduction the backward does not hide, and the rest
    (the pipeline's bubble and sends, the optimizer step)."""
    model = StepModel(plan.graphs, plan.storage, plan.config, plan.geometry, runs=plan.local_runs, hardware=hw)
    ops, nccl = model.profiler, model.comm
    blocks = plan.config.pipeline_nmicros if plan.config.use_pipeline else 1
    run = next(iter(plan.local_runs[0].values()))
    compute = sum(sum(ops.time(op)) + (ops.time(op)[0] if op.recomputed else 0.0) for op in run.ops)
    tp = sum(nccl.forward(c.fn, c.in_bytes, len(c.devices), c.devices) * (2 if c.recomputed else 1)
             + nccl.backward(c.fn, c.in_bytes, len(c.devices), c.devices) for c in run.collectives)
    overlap = max(b for _, b in model.times[0].values())
    dp = sync_time(plan.graphs, plan.storage, plan.config, 0, plan.geometry, nccl, overlap)
    out = {"compute": blocks * compute, "tp collectives": blocks * tp, "dp all-reduce (exposed)": dp}
    out["bubble, sends, optimizer"] = step - sum(out.values())
    return out


def predict(run: PublishedRun, micros: Optional[List[int]] = None) -> Dict[str, object]:
    """The fastest micro-batch that fits, and its figures."""
    hw = Hardware.named(run.hardware, nodes=run.gpus // 8)
    candidates = micros or [m for m in (1, 2, 4, 8, 16) if run.per_replica % m == 0]
    if run.pp == 1:
        candidates = [run.per_replica]
    best = None
    for micro in candidates:
        start = time.perf_counter()
        plan = plan_run(run, micro)
        s = plan.summary(torch.optim.Adam, hardware=hw)
        step = float(s.step_time_s.max())
        row = {"micro": micro, "step_s": step, "peak_gb": float(s.peak_bytes.max()) / 1e9, "fits": bool(s.fits.all()),
               "tflops": float(s.hardware_flops.sum()) / (step * len(s)) / 1e12, "mfu": float(s.mfu.mean()),
               "seconds": time.perf_counter() - start, "plan": plan}
        print(f"  {run.params_b}B micro {micro}: step {step:.2f} s, {row['tflops']:.1f} TFLOP/s, "
              f"peak {row['peak_gb']:.1f} GB, {row['seconds']:.0f} s to plan and price", flush=True)
        if row["fits"] and (best is None or step < best["step_s"]):
            best = row
    return best or row


def table(rows: List[Dict[str, object]]) -> str:
    lines = ["| params (B) | t | p | GPUs | batch | micro-batch | step (s) | peak memory per GPU (GB) | fits | "
             "TFLOP/s per GPU, predicted | published | error | MFU | dominated by (share of the step) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        run, best = r["run"], r["best"]
        parts = sorted(r["breakdown"].items(), key=lambda kv: -kv[1])
        causes = ", ".join(f"{k} {v / best['step_s']:.0%}" for k, v in parts)
        error = best["tflops"] / run.tflops_per_gpu - 1
        lines.append(f"| {run.params_b} | {run.tp} | {run.pp} | {run.gpus} | {run.batch} | {best['micro']} | "
                     f"{best['step_s']:.2f} | {best['peak_gb']:.1f} | {'yes' if best['fits'] else 'no'} | "
                     f"{best['tflops']:.0f} | {run.tflops_per_gpu:.0f} | {error:+.0%} | {best['mfu']:.0%} | {causes} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", type=float, help="only these sizes (billions), printed not written")
    parser.add_argument("--micros", nargs="*", type=int, help="micro-batch sizes to try (default: all that divide)")
    args = parser.parse_args()
    rows = []
    for run in RUNS:
        if args.rows and run.params_b not in args.rows:
            continue
        best = predict(run, args.micros)
        rows.append({"run": run, "best": best,
                     "breakdown": breakdown(best["plan"], Hardware.named(run.hardware, nodes=run.gpus // 8),
                                            best["step_s"])})
    text = table(rows)
    print(text)
    if not args.rows:
        from benchmarks.published_sweep import section       # nbscaler's own choice beside each run
        RESULTS.write_text(HEADER + text + "\n" + FOOTER + section(RUNS, VOCAB, SEQ))


HEADER = """# Published runs, predicted

Written by `python -m benchmarks.published_runs` (see its docstring for the method). Each row is a
run of Narayanan et al. 2021 (SC21, Table 1) on DGX A100 80 GB nodes; nbscaler plans the shipped
GPT at the row's size on the meta device and prices it on `Hardware.named("A100-SXM-80GB")`.
*TFLOP/s per GPU* counts the recomputed forward, as the paper does (`hfu` times the bf16 peak,
312 TFLOP/s); *error* is predicted over published, less one. *Dominated by* splits rank 0's step.

"""

FOOTER = """
Every prediction is above the published figure, and none is within the 15% aimed at. What the model
leaves out, each of which would lower it:

- **Efficiencies are not fitted.** Matrix products are taken at 80% of the dense peak (less a 4 us
  ramp), the best cuBLAS reaches on large shapes; a training run's products reach less. No GPU was
  at hand to time the model's own products and fit the curve, and fitting it to this table would
  make the table prove nothing.
- **Megatron-LM in 2021 is not the shipped GPT.** Its attention materialised the scores (a fused
  scale, mask and softmax over B x heads x 2048 x 2048), which the roofline prices as FlashAttention
  does, with no T x T bytes; it reduced the gradients after the backward, in fp32, where the model
  hides all but the first bucket of a bf16 reduction in the backward, as DDP does.
- **No stalls.** Ranks are assumed in step; a collective never waits for a slower peer, and a
  kernel never waits for the host.

The memory column is the shipped GPT with Adam's state in the model's dtype (bf16); Megatron keeps
fp32 master weights, gradients and moments: 18 bytes per parameter on the rank that holds it, where
the column counts 8.
"""


if __name__ == "__main__":
    main()
