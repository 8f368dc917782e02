"""nbscaler's predictions for published training runs, beside what those runs measured.

``benchmarks/published/`` holds the runs and the facts of their software (``runs``), how each is
planned and priced (``predict``, ``torchtitan``, ``torchtitan_ladder``, ``torchtitan_context``,
``megatron_bridge``) and the results file (``report``).

    python -m benchmarks.published_runs                  # writes benchmarks/results/published_runs.md
    python -m benchmarks.published_runs --rows 1.7 39.1  # those rows, printed, nothing written
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path
from typing import List, Optional

from benchmarks.published import report
from benchmarks.published.predict import predict
from benchmarks.published.runs import NARAYANAN_2021
from benchmarks.published.torchtitan import LLAMA_RUNS, predict_llama, section as llama_section
from benchmarks.published import megatron_bridge as moe
from benchmarks.published import torchtitan_context as context
from benchmarks.published import torchtitan_ladder as ladder

RESULTS = Path(__file__).parent / "results" / "published_runs.md"
SUMMARIES = [Path(__file__).parent.parent / "README.md", Path(__file__).parent.parent / "docs" / "targets.md"]


def results(rows: Optional[List[float]] = None, micros: Optional[List[int]] = None, llama: bool = True,
            swept: bool = True) -> str:
    """The results file's text for the Megatron-LM rows of ``rows`` (all by default)."""
    warnings.filterwarnings("ignore", message="the cost model could not replay")
    runs = [r for r in NARAYANAN_2021 if rows is None or r.params_b in rows]
    predicted = []
    for run in runs:
        start = time.perf_counter()
        predicted.append(predict(run, micros))
        print(f"{run.params_b:g}B: {report.error(predicted[-1]):+.1%} in {time.perf_counter() - start:.0f} s", flush=True)
    text = report.header() + report.megatron_section(predicted) + "\n" + report.H100_2024
    if rows is None and micros is None:
        for path in SUMMARIES:
            report.write_block(path, report.summary_block(predicted))
    if llama:
        for run in LLAMA_RUNS:
            text += "\n" + llama_section(run, predict_llama(run))
            rungs = ladder.predict_ladder(run)
            text += "\n" + ladder.section(run, rungs)
            if rows is None and micros is None:
                report.write_block(SUMMARIES[0], ladder.summary_block(rungs), ladder.START, ladder.END)
        long_rows = context.predict_context()
        text += "\n" + context.section(long_rows)
        if rows is None and micros is None:
            report.write_block(SUMMARIES[0], context.summary_block(long_rows), context.START, context.END)
        moe_rows = moe.predict_moe()
        text += "\n" + moe.section(moe.GPT_OSS_120B, moe_rows)
        if rows is None and micros is None:
            report.write_block(SUMMARIES[0], moe.summary_block(moe.GPT_OSS_120B, moe_rows), moe.START, moe.END)
    if swept:
        from benchmarks.published_sweep import section
        text += section(runs)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="*", type=float, help="only these sizes (billions), printed not written")
    parser.add_argument("--micros", nargs="*", type=int, help="micro-batch sizes to try (default: all that divide)")
    args = parser.parse_args()
    whole = args.rows is None and args.micros is None
    text = results(args.rows, args.micros, llama=whole, swept=whole)
    if whole:
        RESULTS.write_text(text)
        print(f"wrote {RESULTS}")
    else:
        print(text)


if __name__ == "__main__":
    main()
