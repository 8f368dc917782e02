"""The results file of ``benchmarks.published_runs``: tables and sentences, every figure and every
verdict computed here from the predictions (``predict.predict``), none pasted."""

from __future__ import annotations

import statistics
from typing import Dict, List

from benchmarks.published.predict import ABLATIONS
from benchmarks.published.runs import PublishedRun

#: The goal set for these tables: mean and largest |error| over all rows.
GOAL_MEAN, GOAL_MAX = 0.05, 0.10
#: The best analytical planner we know of, against published step times: Calculon (Isaev et al.,
#: "Calculon: a Methodology and Tool for High-Level Codesign of Systems and Large Language Models",
#: SC23), 3.65% mean and 8.87% largest error.
CALCULON_MEAN, CALCULON_MAX = 0.0365, 0.0887


def predicted_tflops(row: Dict) -> float:
    """The paper's FLOPs of a step (its equation 3) over the predicted step, per GPU: what the
    published column would read if the run took the predicted time."""
    run: PublishedRun = row["run"]
    return run.paper_flops / (row["best"].step_s * run.gpus) / 1e12


def error(row: Dict) -> float:
    """Predicted TFLOP/s over published, less one: the published step over the predicted, less one."""
    return predicted_tflops(row) / row["run"].tflops_per_gpu - 1


def _shares(shares: Dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.0%}" for k, v in sorted(shares.items(), key=lambda kv: -kv[1]) if v >= 0.005)


def table(rows: List[Dict]) -> str:
    lines = ["| params (B) | t | p | GPUs | batch | micro-batch | step (s), published | predicted | peak memory "
             "per GPU (GB) | fits | TFLOP/s per GPU, predicted | published | error | MFU | the step, by cause |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        run, best = r["run"], r["best"]
        lines.append(f"| {run.params_b:g} | {run.tp} | {run.pp} | {run.gpus} | {run.batch} | {best.micro} | "
                     f"{run.published_step_s:.2f} | {best.step_s:.2f} | {best.step.peak_bytes / 1e9:.1f} | "
                     f"{'yes' if best.step.fits else 'no'} | {predicted_tflops(r):.0f} | {run.tflops_per_gpu:.0f} | "
                     f"{error(r):+.1%} | {best.step.mfu:.0%} | {_shares(r['shares'])} |")
    return "\n".join(lines)


def ablation_table(rows: List[Dict]) -> str:
    names = list(ABLATIONS)
    lines = ["| params (B) | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for r in rows:
        cells = ["—" if r["ablation"][n] is None else f"{r['ablation'][n]:+.1%}" for n in names]
        lines.append(f"| {r['run'].params_b:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _signs(rows: List[Dict]) -> str:
    """Which facts lengthen the step and which shorten it, over every row where they apply."""
    longer, shorter, mixed, none = [], [], [], []
    for name in ABLATIONS:
        moves = [r["ablation"][name] for r in rows if r["ablation"][name] is not None]
        if not moves:
            continue
        lo, hi = min(moves), max(moves)
        if abs(lo) < 5e-4 and abs(hi) < 5e-4:
            none.append(name)
            continue
        label = f"{name} ({lo:+.1%} to {hi:+.1%})" if lo != hi else f"{name} ({lo:+.1%})"
        (shorter if lo >= 0 and hi > 0 else longer if hi <= 0 and lo < 0 else mixed).append(label)
    out = []
    if longer:
        out.append("undoing these makes the step shorter, so the fact lengthens it: " + "; ".join(longer))
    if shorter:
        out.append("undoing these makes it longer, so the fact shortens it: " + "; ".join(shorter))
    if mixed:
        out.append("these move it either way, by row: " + "; ".join(mixed))
    if none:
        out.append("these move it by less than 0.05% on every row: " + "; ".join(none))
    return ". ".join(s[0].upper() + s[1:] for s in out) + "."


def verdict(rows: List[Dict]) -> str:
    """The goal, met or not, in figures; the rows outside it; the trend with pipeline depth."""
    errors = [error(r) for r in rows]
    mean, worst = statistics.fmean(abs(e) for e in errors), max(abs(e) for e in errors)
    met = mean <= GOAL_MEAN and worst <= GOAL_MAX
    text = [f"Over the {len(rows)} rows the mean |error| is {mean:.1%} and the largest {worst:.1%}: the goal "
            f"(mean at most {GOAL_MEAN:.0%}, largest at most {GOAL_MAX:.0%}) is {'met' if met else 'not met'}. "
            f"Calculon, the best analytical planner we know of, reports {CALCULON_MEAN:.2%} and "
            f"{CALCULON_MAX:.2%} against published step times."]
    flat = [r for r in rows if r["run"].pp == 1]
    deep = [r for r in rows if r["run"].pp > 1]
    if flat and deep:
        text.append(f"Rows without a pipeline are predicted at {_range(flat)}; pipelined rows at {_range(deep)}.")
        bubbles = [r["shares"]["bubble"] for r in deep]
        text.append(f"In the pipelined rows the predicted bubble is {min(bubbles):.1%} to {max(bubbles):.1%} of the "
                    f"step (about (p - 1) / m for 1F1B, p stages, m micro-batches a replica)"
                    + (f", and the correlation between a row's error and its bubble share is "
                       f"{_correlation([error(r) for r in deep], bubbles):+.2f}." if len(deep) >= 3 else "."))
    if all(e > 0 for e in errors):
        text.append(f"Every row is predicted faster than it ran, by {min(errors):.1%} to {max(errors):.1%} of the "
                    "published TFLOP/s. What the model leaves out would each lengthen a step, and none has a figure "
                    "to size it here: the products at the models' own shapes (the matmul ceiling is the best shape "
                    "of a sweep, a burst; no GPU was lent to time these shapes), the host's time between eager "
                    "kernels, and ranks waiting on slower peers (every rank is assumed in step).")
    outside = [r for r in rows if abs(error(r)) > GOAL_MAX]
    if outside:
        text.append("Outside the 10% bound: " + "; ".join(
            f"{r['run'].params_b:g}B ({error(r):+.1%}; t {r['run'].tp}, p {r['run'].pp}; {_shares(r['shares'])})"
            for r in outside) + ".")
    return " ".join(text)


def _range(rows: List[Dict]) -> str:
    errors = [error(r) for r in rows]
    return f"{min(errors):+.1%} to {max(errors):+.1%} (mean {statistics.fmean(errors):+.1%})"


def _correlation(xs: List[float], ys: List[float]) -> float:
    if len(xs) < 2 or statistics.pstdev(xs) == 0 or statistics.pstdev(ys) == 0:
        return float("nan")
    return statistics.correlation(xs, ys)


def megatron_section(rows: List[Dict]) -> str:
    run = rows[0]["run"]
    param_dtype = run.facts.recipe.module_dtype
    return f"""## Megatron-LM 2021 on DGX A100 ({run.source})

Each row's GPT is planned on meta as the row ran and priced on `Hardware.named("{run.target}")`
running {run.facts.software.describe()}, trained with {run.facts.recipe.describe(param_dtype)}, its hidden
states dropped with p = {run.facts.hidden_dropout:g}, every layer recomputed, the layers split evenly over the stages, 1F1B
(`benchmarks/published/runs.py` gives each fact's source). *Step, published* is the paper's FLOPs
of a step (its equation 3) over the published TFLOP/s and GPUs; *TFLOP/s per GPU, predicted* the
same FLOPs over the predicted step, so *error* compares step times. *Micro-batch* is the fastest
that fits by nbscaler's own prediction (the paper does not give it). *MFU* counts the model's
FLOPs as nbscaler traces them, against the 312 TFLOP/s bf16/fp16 peak. *The step, by cause* splits
the slowest device's step.

{table(rows)}

{verdict(rows)}

Each fact of the run undone alone, on the same micro-batch (the step then, over the step with
every fact, less one; — where the fact does not apply):

{ablation_table(rows)}

{_signs(rows)}
"""


def header() -> str:
    return """# Published runs, predicted

Written by `python -m benchmarks.published_runs`; `benchmarks/published/` holds the runs with their
facts and sources (`runs.py`), how each is planned and priced (`predict.py`) and this file's every
figure and sentence (`report.py`). Nothing is fitted to these tables: every efficiency, latency and
bandwidth is a figure with its own source in `nbscaler/cost/hardware.py` and
`nbscaler/cost/roofline.py`, and every fact of a run is applied whichever way it moves the step.

"""


H100_2024 = """## Megatron-LM on H100 (its README, 2024)

Not priced. Megatron-LM's README gives its H100 weak-scaling table (vocabulary 131,072, sequence
4,096; 408.8, 465.9, 489.1, 459.6, 420.5 and 474.4 TFLOP/s per GPU for its 1.7B to 314B rows)
only as an image (`images/model_table.png`): the rows' hidden sizes, layers, heads, parallel
layouts and batches, which a prediction needs, are not published as text anywhere this project can
read them, and are not guessed here.
"""


#: The README and the targets page carry the summary between these markers, rewritten with the results.
START, END = "<!-- published-runs: written by python -m benchmarks.published_runs -->", "<!-- /published-runs -->"


def summary_block(rows: List[Dict]) -> str:
    """The short table and verdict the README and docs/targets.md show."""
    lines = ["| params (B) | t x p | GPUs | micro-batch | TFLOP/s per GPU, predicted | published | error | "
             "the step, by cause |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        run = r["run"]
        lines.append(f"| {run.params_b:g} | {run.tp} x {run.pp} | {run.gpus} | {r['best'].micro} | "
                     f"{predicted_tflops(r):.0f} | {run.tflops_per_gpu:.0f} | {error(r):+.1%} | {_shares(r['shares'])} |")
    return "\n".join(lines) + "\n\n" + verdict(rows)


def write_block(path, block: str, start: str = START, end: str = END) -> None:
    """Replace what lies between ``start`` and ``end`` in the file at ``path`` with ``block``."""
    text = path.read_text()
    if start not in text or end not in text:
        raise ValueError(f"{path} has no {start} ... {end} block to write the summary into.")
    head, rest = text.split(start, 1)
    path.write_text(head + start + "\n" + block + "\n" + end + rest.split(end, 1)[1])
