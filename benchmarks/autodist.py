"""autodist against the built-in policies: search time, predicted and measured step time.

Two parts:

- **search time** of autodist for a 12-layer GPT (d=768, vocab 50304, seq 128) on 8 devices, without
  and with a pipeline to choose (``graph.meta['autodist']['search_s']``; tracing is not counted), the
  first time on a machine (each distinct op is profiled once) and again from the cached profile;
- **the plans it finds** for the GPT, the Llama-style decoder and a CNN on ``--ranks`` local CPU ranks:
  the predicted step time (``plan.summary()``) of autodist and of every built-in policy (dp, tp, data,
  pp, hybrid) for the same devices, then the measured one (median of the timed steps).

Plans on the same devices train different amounts per step: ``dp`` one sample per unit, a pipeline
one per micro-batch. So they are compared by the time per sample (a step's time over the samples it
trains, each a batch of the same size), the figure that decides how long training takes.

    python -m benchmarks.autodist --ranks 2           # writes benchmarks/results/autodist.md
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Dict, List, Optional

import torch

import nbscaler
from benchmarks.runs import MODELS, Run, calibrate_collectives, machine, measure, parser, pipeline, predict, write_results
from nbscaler import ComputeConfig
from nbscaler.columns import SummaryColumn as C
from nbscaler.models.gpt import GPT, GPTConfig, sample_batch

RESULTS = Path(__file__).parent / "results" / "autodist.md"


def search_seconds(layers: int = 12, devices: int = 8) -> Dict[str, float]:
    """Seconds autodist searches for a GPT of ``layers`` layers (d=768) on ``devices`` devices: the
    first time (op times profiled on this machine, then cached on disk) and again (from the cache)."""
    cfg = GPTConfig(vocab_size=50304, seq_len=128, n_layer=layers, d_model=768, n_head=12)
    flat = ComputeConfig(devices, devices, use_end2end=True)
    piped = ComputeConfig(devices, devices, use_end2end=True, **dict(pipeline("1f1b", 2, 8)))
    plan = nbscaler.plan(GPT(cfg), {"batch": sample_batch(cfg, 8)}, "autodist", flat)
    out = {"first search (profiling ops)": plan.graph.meta["autodist"]["search_s"]}
    out["again (profile cached)"] = plan.replan(compute_config=flat).graph.meta["autodist"]["search_s"]
    out["with a pipeline (2 stages), first"] = plan.replan(compute_config=piped).graph.meta["autodist"]["search_s"]
    out["with a pipeline, again"] = plan.replan(compute_config=piped).graph.meta["autodist"]["search_s"]
    return out


def contenders(model: str, n: int) -> List[Run]:
    """autodist, with and without a pipeline to place, and every built-in policy on ``n`` devices."""
    out = [Run(model, "autodist", n, n), Run(model, "autodist", n, n, pipeline("1f1b", 2)),
           Run(model, "dp", 1, n), Run(model, "tp", n, n), Run(model, "data", n, n),
           Run(model, "pp", n, n, pipeline("1f1b", n))]
    if n >= 4:
        out += [Run(model, "hybrid", n, n, pipeline("1f1b", 2))]
    return out


def samples_per_step(run: Run) -> int:
    """Samples one training step of ``run`` trains: one per micro-batch, in every unit."""
    return run.nmicros * run.runtime_ngpus // run.plan_ngpus


def step_times(run: Run, steps: int) -> Dict[str, float]:
    predicted = max(r[C.STEP_TIME_S] for r in predict(run)["rows"])
    return {"predicted": predicted, "measured": statistics.mean(r["step_s"] for r in measure(run, steps))}


def table(results: Dict[str, Dict[Run, Dict[str, float]]]) -> str:
    lines = ["| model | policy | samples / step | predicted ms / sample | measured ms / sample "
             "| measured / best built-in | predicted / best built-in |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for model, by_run in results.items():
        per = {run: {k: v / samples_per_step(run) for k, v in t.items()} for run, t in by_run.items()}
        best = {k: min(t[k] for run, t in per.items() if run.policy != "autodist") for k in ("measured", "predicted")}
        for run, t in per.items():
            lines.append(f"| {model} | {run} | {samples_per_step(run)} | {1e3 * t['predicted']:.1f} "
                         f"| {1e3 * t['measured']:.1f} | {t['measured'] / best['measured']:.2f} "
                         f"| {t['predicted'] / best['predicted']:.2f} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    cli = parser(__doc__.splitlines()[0], list(MODELS), RESULTS)
    cli.add_argument("--skip-search", action="store_true", help="leave out the 12-layer GPT search timing")
    args = cli.parse_args(argv)
    torch.set_num_threads(1)          # as each rank runs: op times are profiled at this thread count
    parts = []
    if not args.skip_search:
        print("  searching a 12-layer GPT on 8 devices ...", flush=True)
        searched = search_seconds()
        parts.append("Search time, 12-layer GPT (d=768) on 8 devices: "
                     + ", ".join(f"{k}: {v:.1f} s" for k, v in searched.items()) + ".")
    calibrate_collectives(args.ranks)
    results: Dict[str, Dict[Run, Dict[str, float]]] = {}
    for model in args.models:
        results[model] = {}
        for run in contenders(model, args.ranks):
            print(f"  {model}: {run} ...", flush=True)
            results[model][run] = step_times(run, args.steps)
    parts.append(f"Step times on {machine(args.ranks, args.steps)}.\n\n{table(results)}")
    write_results(args.out, "\n\n".join(parts) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
