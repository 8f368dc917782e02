"""How long ``nbscaler.sweep`` takes for Llama-3-70B on 64 H100s, and what it ranks first.

The model is Hugging Face's ``LlamaForCausalLM`` at Llama-3-70B's published shape (hidden 8192,
intermediate 28672, 80 layers, 64 heads, 8 key-value heads, vocabulary 128,256, from its
``config.json``), built on the meta device; sequences of 8,192 tokens (its training context), a
global batch of 128 sequences (1M tokens), bf16 with fp32 master weights and AdamW, priced on
``Hardware.named("H100-SXM-80GB", nodes=8)``. The sweep covers tp in {1, 2, 4, 8}, pp in
{1, 2, 4, 8}, micro-batches of 1, 2 or 4 sequences, recomputation on and off, sequence
parallelism on and off where tp > 1, ZeRO 1 and 2: 336 combinations (192 without sequence
parallelism, 144 more with it). Then the first row is planned whole (``nbscaler.plan`` of the 80-layer model
with that row's ``config_of``) and its ``summary`` set beside the row.

    python -m benchmarks.sweep              # writes benchmarks/results/sweep.md
    python -m benchmarks.sweep --print      # prints it instead
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path
from typing import Dict, Tuple

import pandas as pd
import torch

import nbscaler
from benchmarks.runs import reference_loop_ms
from nbscaler import Hardware
from nbscaler.space.sweep import config_of

RESULTS = Path(__file__).parent / "results" / "sweep.md"
SEQ, GLOBAL_BATCH = 8192, 128
RANGES = dict(tp=(1, 2, 4, 8), pp=(1, 2, 4, 8), micro_batch=(1, 2, 4), recompute=(False, True),
              sequence_parallel=(False, True), zero_stage=(1, 2))


class LossOf(torch.nn.Module):
    """``forward(batch) -> model(**batch).loss``: a transformers model as a training loop calls it."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(**batch).loss


def llama3_70b(layers: int = 80) -> torch.nn.Module:
    from nbscaler.models import torchvision_compat
    torchvision_compat.declare_missing_ops()      # transformers imports torchvision, whose ops may be missing here
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers, num_attention_heads=64,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192)
    with torch.device("meta"):
        return LossOf(LlamaForCausalLM(config))


def tokens(batch: int) -> Dict[str, Dict[str, torch.Tensor]]:
    """Real (CPU) input ids: the module is on meta, its inputs are not."""
    ids = torch.zeros(batch, SEQ, dtype=torch.long)
    return {"batch": {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}}


def timed_sweep(hardware: Hardware) -> Tuple[pd.DataFrame, float]:
    model = llama3_70b()
    start = time.perf_counter()
    frame = nbscaler.sweep(model, tokens(1), hardware, global_batch=GLOBAL_BATCH, **RANGES)
    return frame, time.perf_counter() - start


def full_plan(row: pd.Series, hardware: Hardware, stack: str) -> Tuple[Dict[str, float], float]:
    """The row's configuration planned whole and priced: its figures and the seconds it took."""
    start = time.perf_counter()
    plan = nbscaler.plan(llama3_70b(), tokens(int(row.micro_batch)), "hybrid", config_of(row, hardware.ngpus, stack),
                         module_dtype=torch.bfloat16)
    step = plan.step_figures(torch.optim.AdamW, hardware=hardware, master_dtype=torch.float32)
    peak = plan.summary(torch.optim.AdamW, hardware=hardware, master_dtype=torch.float32).peak_bytes.max()
    figures = {"step_time_s": step.step_time_s, "tokens_per_s": step.tokens_per_s, "mfu": step.mfu, "peak_bytes": peak}
    return figures, time.perf_counter() - start


SHOWN = ["tp", "pp", "dp", "micro_batch", "recompute", "sequence_parallel", "zero_stage", "step_time_s", "tokens_per_s",
         "mfu", "peak_bytes", "fits", "bubble", "tp_comm_share", "dp_comm_share", "pp_send_share"]


def markdown(frame: pd.DataFrame) -> str:
    shown = frame[SHOWN].copy()
    shown["peak_bytes"] = (shown.peak_bytes / 1e9).map("{:.1f} GB".format)
    for c in ("mfu", "bubble", "tp_comm_share", "dp_comm_share", "pp_send_share"):
        shown[c] = shown[c].map("{:.1%}".format)
    shown["step_time_s"] = shown.step_time_s.map("{:.2f}".format)
    shown["tokens_per_s"] = shown.tokens_per_s.map("{:,.0f}".format)
    lines = ["| " + " | ".join(shown.columns) + " |", "|" + " --- |" * len(shown.columns)]
    lines += ["| " + " | ".join(str(v) for v in row) + " |" for row in shown.itertuples(index=False)]
    return "\n".join(lines)


def report(frame: pd.DataFrame, seconds: float, loads: Tuple[float, float], check: Dict[str, float],
           check_s: float, loops: Tuple[float, float]) -> str:
    fitting = frame[frame.fits]
    first = frame.iloc[0]
    published = frame[(frame.tp == 8) & (frame.pp == 8)]
    lines = [
        "# The plan space of Llama-3-70B on 64 H100s",
        "",
        f"Written by `python -m benchmarks.sweep` (see its docstring) on "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, on the shared 2-core CPU machine (load average "
        f"{loads[0]:.1f} at the start, {loads[1]:.1f} at the end; its reference Python loop, "
        f"`benchmarks.runs.reference_loop_ms`, took {loops[0]:.1f} ms before and {loops[1]:.1f} ms after).",
        "",
        f"**The sweep: {seconds:.1f} s** for {len(frame) + len(frame.attrs['excluded'])} combinations: "
        f"{len(frame)} priced ({len(fitting)} fit in 80 GB), {len(frame.attrs['excluded'])} left out "
        f"({'; '.join(sorted(set(frame.attrs['excluded'].reason)))}).",
        "",
        f"The first row planned whole (`nbscaler.plan` of the 80 layers with `config_of(row)`, then "
        f"`summary(hardware=...)`) took {check_s:.1f} s and predicts a step of {check['step_time_s']:.4f} s, "
        f"{check['peak_bytes'] / 1e9:.3f} GB at the peak and {check['mfu']:.4%} MFU; the sweep's row says "
        f"{first.step_time_s:.4f} s, {first.peak_bytes / 1e9:.3f} GB and {first.mfu:.4%}.",
        "",
        "## The ten fastest that fit",
        "",
        markdown(fitting.head(10)),
        "",
        "## tp 8 x pp 8 (the layout notebook 11 and `benchmarks.plan_at_scale` plan 70B with)",
        "",
        markdown(published.head(6)),
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--print", action="store_true", help="print the report instead of writing it")
    opts = parser.parse_args()
    warnings.simplefilter("ignore")
    hardware = Hardware.named("H100-SXM-80GB", nodes=8)
    load, loop = os.getloadavg()[0], reference_loop_ms()
    frame, seconds = timed_sweep(hardware)
    end_load = os.getloadavg()[0]
    print(f"sweep: {seconds:.1f} s, {len(frame)} rows", flush=True)
    check, check_s = full_plan(frame.iloc[0], hardware, frame.attrs["stack"])
    text = report(frame, seconds, (load, end_load), check, check_s, (loop, reference_loop_ms()))
    if opts.print:
        print(text)
    else:
        RESULTS.write_text(text)
        print(text)


if __name__ == "__main__":
    main()
