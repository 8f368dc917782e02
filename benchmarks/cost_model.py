"""The cost model against measurements: memory by category, step time and pipeline bubble per rank.

For each model (the shipped GPT and Llama-style decoder) and each built-in policy, ``nbscaler.plan``
predicts one row per rank (``plan.summary(AdamW)``); then the same plan trains on as many local CPU
ranks, where ``MemoryMeter`` counts one step's bytes by category, the median of the timed steps gives
the step time, and every rank's recorded blocks of a step together give a pipeline's bubble. Each
run is measured ``--reps`` times, the time model calibrated again before each (collectives, and
the speed the ranks compute at side by side), and the prediction uses the median of those
calibrations (the speed's with the previous run's last two), as the measurement is the median of
the repetitions: the model and the measurement see nearly the same minutes of the machine.
The table shows the prediction, the median measurement and the error.

    python -m benchmarks.cost_model --ranks 2            # writes benchmarks/results/cost_model.md

Memory is counted exactly on both sides (the storages of live tensors), so its error is zero where
the model claims exactness. Step time is a sum of op times profiled in one process, scaled to the
speed the ranks measured, plus an alpha-beta model of the collectives; what it leaves out (ranks
waiting for a peer the machine slowed, Python between ops) shows in the error.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional


from benchmarks.runs import (ZERO, Run, calibrate, machine, measure, parser, pipeline, predict,
                            store_calibrations, write_results)
from nbscaler.columns import MEMORY_CATEGORIES, SummaryColumn as C

RESULTS = Path(__file__).parent / "results" / "cost_model.md"


def runs(model: str, n: int) -> List[Run]:
    """Every built-in policy on ``n`` ranks, with and without ZeRO where it applies."""
    out = [Run(model, "dp", 1, n), Run(model, "dp", 1, n, ZERO), Run(model, "tp", n, n), Run(model, "data", n, n),
           Run(model, "pp", n, n, pipeline("1f1b", n)), Run(model, "pp", n, n, pipeline("gpipe", n)),
           Run(model, "pp", n, n, pipeline("1f1b", n) + ZERO)]
    if n >= 4:
        out += [Run(model, "tp", n // 2, n), Run(model, "hybrid", n, n, pipeline("1f1b", 2))]
    return out


def _error(predicted: float, measured: float) -> float:
    return 0.0 if predicted == measured else (predicted - measured) / measured if measured else float("inf")


def measure_calibrated(run: Run, steps: int, reps: int) -> List[Dict[str, Any]]:
    """Per rank, ``measure``'s row with the median step time (and bubble) of ``reps`` repetitions.

    Before each repetition the collectives and the ranks' compute speed are calibrated again, and
    the prediction then uses the collectives' median and the median speed of the last calibrations
    (these and the previous run's last two): model and measurement see nearly the same minutes of a
    machine whose collectives drift by a quarter, and its compute by a fifth, from one minute to
    the next, while no single calibration, one second of it, rescales the prediction alone."""
    calibrations, repeats = [], []
    for _ in range(reps):
        calibrations.append(calibrate(run.runtime_ngpus))
        repeats.append(measure(run, steps))
    store_calibrations(calibrations)
    rows = repeats[0]
    for rank, row in enumerate(rows):
        row["step_s"] = statistics.median(r[rank]["step_s"] for r in repeats)
        if row["bubble"] is not None:
            row["bubble"] = statistics.median(r[rank]["bubble"] for r in repeats)
    return rows


def compare(run: Run, steps: int, reps: int) -> Dict[str, Any]:
    """One line of the table: the worst rank's memory and time errors for ``run``."""
    measured = measure_calibrated(run, steps, reps)
    pred = predict(run)
    mem_err = cat_err = 0.0
    time_err = []
    for p, m in zip(pred["rows"], measured):
        mem_err = max(mem_err, abs(_error(p[C.PEAK_BYTES], m["memory"][C.PEAK_BYTES])))
        cat_err = max([cat_err] + [abs(_error(p[c], m["memory"][c])) for c in MEMORY_CATEGORIES])
        time_err.append(_error(p[C.STEP_TIME_S], m["step_s"]))
    peak = max(range(len(measured)), key=lambda r: measured[r]["memory"][C.PEAK_BYTES])
    return {"run": run, "peak_pred": pred["rows"][peak][C.PEAK_BYTES], "peak_meas": measured[peak]["memory"][C.PEAK_BYTES],
            "mem_err": mem_err, "cat_err": cat_err,
            "step_pred": statistics.mean(p[C.STEP_TIME_S] for p in pred["rows"]),
            "step_meas": statistics.mean(m["step_s"] for m in measured),
            "time_err": max(time_err, key=abs), "bubble_pred": pred["bubble"], "bubble_meas": measured[0]["bubble"]}


def table(rows: List[Dict[str, Any]]) -> str:
    """The rows as a markdown table."""
    mib = 2 ** 20
    lines = ["| model | policy | peak MiB predicted | measured | worst memory error: total / category "
             "| step ms predicted | measured | worst step-time error | bubble predicted | measured |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        bubble = f"{r['bubble_pred']:.1%} | {r['bubble_meas']:.1%}" if r["bubble_pred"] is not None else "- | -"
        lines.append(f"| {r['run'].model} | {r['run']} | {r['peak_pred'] / mib:.2f} | {r['peak_meas'] / mib:.2f} "
                     f"| {r['mem_err']:.1%} / {r['cat_err']:.1%} | {1e3 * r['step_pred']:.1f} "
                     f"| {1e3 * r['step_meas']:.1f} | {r['time_err']:+.0%} | {bubble} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    p = parser(__doc__.splitlines()[0], ["gpt", "llama"], RESULTS)
    p.add_argument("--reps", type=int, default=3, help="repetitions of each run, each after a calibration")
    args = p.parse_args(argv)
    rows = []
    for model in args.models:
        for run in runs(model, args.ranks):
            print(f"  {model}: {run} ...", flush=True)
            rows.append(compare(run, args.steps, args.reps))
    write_results(args.out, f"{len(rows)} runs on {machine(args.ranks, args.steps)}, the median of {args.reps} "
                            f"repetitions, collectives calibrated before each.\n\n{table(rows)}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
