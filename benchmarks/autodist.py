"""autodist against the built-in policies: search time, predicted and measured step time.

Two parts:

- **search time** of autodist for a 12-layer GPT (d=768, vocab 50304, seq 128) on 8 devices, without
  and with a pipeline to choose (``graph.meta['autodist']['search_s']``; tracing is not counted), the
  first time on a machine (each distinct op is profiled once) and again from the cached profile;
- **the plans it finds** for the GPT, the Llama-style decoder and a CNN on ``--ranks`` local CPU ranks:
  the predicted step time (``plan.summary()``) of autodist and of every built-in policy (dp, tp, data,
  pp, hybrid) for the same devices, then the measured one. autodist is given the devices and chooses
  how many make a unit (``autodist_plan_ngpus='auto'``), as a user choosing among the built-ins does.

Plans on the same devices train different amounts per step: ``dp`` one sample per unit, a pipeline
one per micro-batch. So they are compared by the time per sample (a step's time over the samples it
trains, each a batch of the same size), the figure that decides how long training takes. Each run
is measured ``--reps`` times, the runs taking turns, and the median is kept: on a shared machine one
measurement moves by 15% or more.

    python -m benchmarks.autodist --ranks 2           # writes benchmarks/results/autodist.md
    python -m benchmarks.autodist --at-scale          # only its section "At scale" (below)

**At scale** (``--at-scale``): autodist given a target (``pas_config={"hardware": "H100-SXM-80GB"}``)
plans Llama-3-70B for 64 H100s (8 nodes) over the ranges of ``benchmarks.sweep`` (the model, the
batch and the precision are that benchmark's), with nothing profiled on this machine: the wall and
CPU seconds of ``nbscaler.plan(..., "autodist", ...)`` (the search, then the trace and placement of
the 80 layers), its predicted step against the fastest fitting row of the full ``nbscaler.sweep``
over the same ranges, ``summary(hardware=...)`` of the returned plan against what autodist claims,
and ``plan.explain()``. That section of the results file is replaced; the rest is kept.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Dict, List, Optional

import torch


import nbscaler
from benchmarks.runs import (MODELS, Run, calibrate, machine, measure, parser, pipeline, predict, reference_loop_ms,
                            write_results)
from nbscaler import ComputeConfig, Hardware
from nbscaler.columns import SummaryColumn as C
from nbscaler.policy.autodist import samples_per_step
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


#: autodist chooses the unit size too: on ``n`` devices, ``dp``'s units of one are among its options.
AUTO_UNIT = (("autodist_plan_ngpus", "auto"),)


def contenders(model: str, n: int) -> List[Run]:
    """autodist, with and without a pipeline to place, and every built-in policy on ``n`` devices."""
    out = [Run(model, "autodist", n, n, pas=AUTO_UNIT), Run(model, "autodist", n, n, pipeline("1f1b", 2), AUTO_UNIT),
           Run(model, "dp", 1, n), Run(model, "tp", n, n), Run(model, "data", n, n),
           Run(model, "pp", n, n, pipeline("1f1b", n))]
    if n >= 4:
        out += [Run(model, "hybrid", n, n, pipeline("1f1b", 2))]
    return out


def chosen(config: ComputeConfig) -> str:
    """The plan's shape: devices per unit x ranks, and the stages of a pipeline."""
    stages = f", {config.pipeline_nstages} stages" if config.use_pipeline else ""
    return f"{config.plan_ngpus}x{config.runtime_ngpus}{stages}"


def measure_interleaved(runs: List[Run], steps: int, reps: int) -> Dict[Run, List[float]]:
    """Each run's measured step time (mean over ranks of their median step), ``reps`` times, the runs
    taking turns: a slow minute of the machine then falls on every run alike, not on one."""
    out: Dict[Run, List[float]] = {run: [] for run in runs}
    for rep in range(reps):
        for run in runs:
            print(f"  repetition {rep + 1}/{reps}: {run.model} {run} ...", flush=True)
            out[run].append(statistics.mean(r["step_s"] for r in measure(run, steps)))
    return out


def placement(plan: nbscaler.Plan) -> tuple:
    """What decides the code a plan runs: its unit size, stages, and every op's split, devices and stage."""
    cfg = plan.config
    return (cfg.plan_ngpus, cfg.pipeline_nstages if cfg.use_pipeline else 0,
            tuple((n.placement.split, n.placement.devices, n.placement.blocks, n.stage) for n in plan.graph.nodes))


def table(model: str, rows: List[Dict]) -> List[str]:
    """One line per run: seconds per sample predicted and measured (the fastest and the median of
    the repetitions), the fastest over the best built-in's, and which built-in places the same plan."""
    builtins = [r for r in rows if r["run"].policy != "autodist"]
    best = {k: min(r[k] for r in builtins) for k in ("predicted", "fastest", "median")}
    lines = []
    for r in rows:
        same = [str(b["run"]) for b in builtins if b is not r and b["placement"] == r["placement"]]
        lines.append(f"| {model} | {r['run']} | {r['chosen']} | {', '.join(same) or '-'} | {r['samples']} "
                     f"| {1e3 * r['predicted']:.1f} | {1e3 * r['fastest']:.1f} / {1e3 * r['median']:.1f} "
                     f"| {r['fastest'] / best['fastest']:.2f} / {r['median'] / best['median']:.2f} "
                     f"| {r['predicted'] / best['predicted']:.2f} |")
    return lines


HEADER = ["| model | run | plan | same plan as | samples / step | predicted ms / sample "
          "| measured ms / sample, fastest / median | measured / best built-in, fastest / median "
          "| predicted / best built-in |", "|---|---|---|---|---:|---:|---:|---:|---:|"]


def compare(model: str, n: int, steps: int, reps: int) -> List[Dict]:
    """Predicted and measured seconds per sample of every contender for ``model`` on ``n`` ranks."""
    runs = contenders(model, n)
    predicted = {run: predict(run) for run in runs}
    measured = measure_interleaved(runs, steps, reps)
    rows = []
    for run in runs:
        cfg = predicted[run]["config"]
        samples = samples_per_step(cfg)
        rows.append({"run": run, "chosen": chosen(cfg), "samples": samples,
                     "placement": placement(predicted[run]["plan"]),
                     "predicted": max(r[C.STEP_TIME_S] for r in predicted[run]["rows"]) / samples,
                     "fastest": min(measured[run]) / samples, "median": statistics.median(measured[run]) / samples})
    return rows


AT_SCALE = "## At scale: Llama-3-70B on 64 H100s, nothing profiled here"


def at_scale() -> str:
    """The section "At scale" of the results (see the module docstring)."""
    from benchmarks.sweep import GLOBAL_BATCH, RANGES, llama3_70b, tokens
    warnings.simplefilter("ignore")
    hardware = Hardware.named("H100-SXM-80GB", nodes=8)
    cfg = ComputeConfig(8, hardware.ngpus, pas_config={"hardware": "H100-SXM-80GB", "global_batch": GLOBAL_BATCH,
                                                       "autodist_space": RANGES})
    model, load, loop = llama3_70b(), os.getloadavg()[0], reference_loop_ms()
    wall, cpu = time.perf_counter(), time.process_time()
    plan = nbscaler.plan(model, tokens(1), "autodist", cfg, module_dtype=torch.bfloat16)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    info = plan.graph.meta["autodist"]["target"]
    print(f"  autodist: {wall:.1f} s, {cpu:.1f} s CPU; now the full sweep ...", flush=True)
    s = plan.summary(torch.optim.AdamW, hardware=hardware, master_dtype=torch.float32)
    sweep_s = time.perf_counter()
    frame = nbscaler.sweep(model, tokens(1), hardware, global_batch=GLOBAL_BATCH, progress=False, **RANGES)
    sweep_s = time.perf_counter() - sweep_s
    best, claim = frame[frame.fits].iloc[0], info["chosen"]
    return "\n".join([
        AT_SCALE, "",
        f"`python -m benchmarks.autodist --at-scale` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, on the "
        f"shared {os.cpu_count()}-core CPU machine, load average {load:.1f} at the start and "
        f"{os.getloadavg()[0]:.1f} at the end (wall seconds stretch with the load; CPU seconds much less); its "
        f"reference Python loop, `benchmarks.runs.reference_loop_ms`, took {loop:.1f} ms before and "
        f"{reference_loop_ms():.1f} ms after.", "",
        f"- `nbscaler.plan(llama_70b, ..., \"autodist\", cfg)`: **{wall:.1f} s wall, {cpu:.1f} s CPU**, of which "
        f"the search {info['search_s']:.1f} s wall, {info['search_cpu_s']:.1f} s CPU ({info['priced']} "
        f"configurations priced, {info['pruned']} pruned, {info['excluded']} that cannot run); the rest traces "
        f"and places the 80 layers under the chosen config.",
        f"- chosen: tp {claim['tp']} x pp {claim['pp']} x dp {claim['dp']}, micro-batch {claim['micro_batch']}, "
        f"recompute {claim['recompute']}, ZeRO {claim['zero_stage']}: predicted step **{claim['step_time_s']:.4f} s**, "
        f"{claim['peak_bytes'] / 1e9:.3f} GB at the peak.",
        f"- the returned plan's `summary(AdamW, hardware=..., master_dtype=float32)`: step "
        f"{s.step_time_s.max():.4f} s, peak {s.peak_bytes.max() / 1e9:.3f} GB, fits {bool(s.fits.all())}.",
        f"- the full `nbscaler.sweep` over the same ranges ({len(frame)} rows priced, {sweep_s:.1f} s wall): its "
        f"fastest fitting row, tp {best.tp} x pp {best.pp} x dp {best.dp}, micro-batch {best.micro_batch}, "
        f"recompute {best.recompute}, ZeRO {best.zero_stage}: {best.step_time_s:.4f} s.", "",
        "`print(plan.explain())`:", "", "```", str(plan.explain()), "```", ""])


def write_at_scale(out: Path) -> None:
    """Replace the section "At scale" of ``out`` (or add it), keeping the rest."""
    text = out.read_text() if out.exists() else ""
    kept = text.split(AT_SCALE)[0].rstrip("\n")
    write_results(out, (kept + "\n\n" if kept else "") + at_scale())


def main(argv: Optional[List[str]] = None) -> int:
    cli = parser(__doc__.splitlines()[0], list(MODELS), RESULTS)
    cli.add_argument("--skip-search", action="store_true", help="leave out the 12-layer GPT search timing")
    cli.add_argument("--reps", type=int, default=5, help="interleaved repetitions of each run's measurement")
    cli.add_argument("--at-scale", action="store_true", help="only the section on Llama-3-70B for 64 H100s")
    args = cli.parse_args(argv)
    if args.at_scale:
        write_at_scale(args.out)
        return 0
    parts = []
    if not args.skip_search:
        print("  searching a 12-layer GPT on 8 devices ...", flush=True)
        searched = search_seconds()
        parts.append("Search time, 12-layer GPT (d=768) on 8 devices: "
                     + ", ".join(f"{k}: {v:.1f} s" for k, v in searched.items()) + ".")
    calibrate(args.ranks)
    lines = list(HEADER)
    for model in args.models:
        lines += table(model, compare(model, args.ranks, args.steps, args.reps))
    parts.append(f"Step times on {machine(args.ranks, args.steps)}; each run measured {args.reps} times, "
                 "taking turns (each time: the mean over ranks of their median step). Other processes only ever "
                 "slow a run down, so the fastest repetition is the steadiest figure; the median is given too."
                 "\n\n" + "\n".join(lines))
    write_results(args.out, "\n\n".join(parts) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
