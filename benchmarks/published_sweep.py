"""What ``nbscaler.sweep`` would run instead of each published run, and how much faster it predicts.

For three rows of ``benchmarks.published_runs`` (one without a pipeline, one tensor-parallel, one
pipelined: ``SWEPT``) the shipped GPT at the row's size is swept on the
row's hardware, GPUs and software (``PublishedRun.hardware``; ``nbscaler.sweep``: tp in {1, 2, 4, 8}, pp in {1, 2, 4, 8, 16} up to the
layers, micro-batches of 1, 2, 4 or 8 sequences, recomputation on and off, sequence parallelism on
and off where t > 1, no ZeRO or ZeRO-1, the run's recipe: ``RunFacts.recipe``).
The published configuration is the sweep's fastest fitting row with the row's ``t`` and ``p``, full
recomputation, no sequence parallelism (the 2021 runs predate it) and no ZeRO (the paper gives no
micro-batch size: the fastest that fits); nbscaler's choice is the sweep's first row. Both are
priced by the same model, so the speed-up compares plans, not the model with the published figure.
Without a pipeline (``p = 1``) the sweep accumulates micro-batches (a pipeline of one stage), where
``published_runs`` traces a replica's whole share of the batch as one micro-batch.

    python -m benchmarks.published_sweep            # prints the table for every row
"""

from __future__ import annotations

import time
from typing import List

import pandas as pd
import torch

import nbscaler
from nbscaler.models.gpt import GPT

TP, MICRO, ZERO = (1, 2, 4, 8), (1, 2, 4, 8), (0, 1)


SWEPT = (1.7, 18.4, 145.6)


def sweep_run(run) -> pd.DataFrame:
    """The sweep of one published run's GPT on its hardware and GPUs, with its software and recipe."""
    with torch.device("meta"):
        model = GPT(run.gpt())                   # the row's GPT as its table prices it, dropout included
    idx = torch.zeros(1, run.seq, dtype=torch.long)
    pp = tuple(p for p in (1, 2, 4, 8, 16) if p <= run.layers)
    return nbscaler.sweep(model, {"batch": {"idx": idx, "targets": idx}}, run.hardware(), global_batch=run.batch,
                          tp=TP, pp=pp, micro_batch=MICRO, zero_stage=ZERO, recipe=run.facts.recipe, progress=False)


def published_row(frame: pd.DataFrame, run) -> pd.Series:
    """The fastest fitting row of the published layout: its t and p, everything recomputed, no
    sequence parallelism, no ZeRO."""
    rows = frame[(frame.tp == run.tp) & (frame.pp == run.pp) & (frame.recompute == "full") & ~frame.sequence_parallel
                 & (frame.zero_stage == 0)]
    fitting = rows[rows.fits]
    return (fitting if len(fitting) else rows).sort_values("step_time_s").iloc[0]


def config(row: pd.Series) -> str:
    return (f"t {row.tp}, p {row.pp}, micro-batch {row.micro_batch}, "
            f"recompute {row.recompute}"
            f"{', sequence parallel' if row.sequence_parallel else ''}, {'ZeRO-1' if row.zero_stage else 'no ZeRO'}")


def why(best: pd.Series, published: pd.Series, capacity: float) -> str:
    """The differences between the two plans that move the step, each with the figures behind it."""
    if all(best[c] == published[c] for c in ("tp", "pp", "micro_batch", "recompute", "sequence_parallel",
                                               "zero_stage")):
        return "the published plan"
    share = lambda r: (f"tp collectives {r.tp_comm_share:.0%}, bubble {r.bubble:.0%}, "
                       f"exposed dp all-reduce {r.dp_comm_share:.0%}, sends {r.pp_send_share:.0%}")
    parts = [f"{name} {published[name]} -> {best[name]}" for name in ("tp", "pp", "micro_batch")
             if best[name] != published[name]]
    if best.recompute != published.recompute:
        parts.append(f"recompute {published.recompute} -> {best.recompute}, which fits ({best.peak_bytes / 1e9:.0f} GB "
                     f"per GPU): less of the forward is run twice (HFU {best.hfu:.0%} against {published.hfu:.0%} "
                     f"published)")
    if best.sequence_parallel:
        parts.append("sequence parallelism keeps the norms' and residual adds' activations on 1/t of the sequence")
    if best.zero_stage and not published.zero_stage:
        parts.append("ZeRO-1 shards Adam's state and master weights over the data-parallel ranks")
    parts.append(f"{share(best)} of its step against {share(published)}")
    if capacity - best.peak_bytes < 5e9:
        parts.append(f"but its peak is within 5 GB of the {capacity / 1e9:.0f} GB, which the workspace "
                     "peak_bytes leaves out may fill (nbscaler.columns)")
    return "; ".join(parts)


def table(runs: List) -> str:
    """Markdown: per published run, the published layout and the sweep's first as the sweep prices them."""
    lines = ["| params (B) | GPUs | published layout, as swept | its step (s) | sweep's first | its step (s) | "
             "predicted speed-up | peak (GB) | why | sweep (s) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in runs:
        start = time.perf_counter()
        frame = sweep_run(run)
        seconds = time.perf_counter() - start
        best, published = frame.iloc[0], published_row(frame, run)
        capacity = run.hardware().memory_bytes
        lines.append(f"| {run.params_b} | {run.gpus} | {config(published)} | {published.step_time_s:.2f} | "
                     f"{config(best)} | {best.step_time_s:.2f} | {published.step_time_s / best.step_time_s:.2f}x | "
                     f"{best.peak_bytes / 1e9:.1f} | {why(best, published, capacity)} | {seconds:.0f} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def section(runs: List) -> str:
    """The section ``published_runs`` appends to its results, for the runs of ``SWEPT``."""
    swept = [r for r in runs if r.params_b in SWEPT]
    return (f"\n## What nbscaler's sweep would run instead\n\n{__doc__.split(chr(10) + chr(10))[1]}\n\n"
            f"{table(swept)}\n")


def main() -> None:
    from benchmarks.published.runs import NARAYANAN_2021
    print(section(NARAYANAN_2021))


if __name__ == "__main__":
    main()
