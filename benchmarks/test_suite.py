"""How long the test suite takes: the fast subset (``make test-fast``) and the whole suite (``make test``).

Each part runs as ``make`` runs it, in a fresh ``python -m pytest`` process started from the
repository root, and is timed as wall-clock seconds and as the CPU seconds of that process and its
children (which a machine shared with other work inflates less). Beside them: the machine's
reference Python loop (``benchmarks.runs.reference_loop_ms``, before and after each part) and its
load average, since figures taken at different moments or on different machines compare only after
dividing by it; the slowest tests of each part (pytest's ``--durations``); and each test that failed,
with pytest's one-line reason and the last ``REPORT_LINES`` lines of its report (where an exception
raised on a rank carries that rank's traceback), so that a failure in a long run can be found again.

    python -m benchmarks.test_suite                  # both parts, writes benchmarks/results/test_suite.md
    python -m benchmarks.test_suite --parts fast     # the fast subset alone (about a minute)

Each part is held to its goal: the fast subset under a minute, the whole suite under 25 minutes.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Optional

from benchmarks.runs import reference_loop_ms

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).parent / "results" / "test_suite.md"

#: The markers ``make test-fast`` leaves out (the Makefile's expression).
FAST = "not multiprocess and not cluster and not browser and not notebook and not slow"
#: How ``make test`` and ``make test-fast`` spread the tests over the cores (the Makefile's options; ``tests/conftest.py``
#: keeps every test that starts a cluster on one worker).
WORKERS = ["-n", "2", "--dist", "loadgroup"]
PARTS: Dict[str, List[str]] = {"fast": [*WORKERS, "-m", FAST], "whole": WORKERS}
TITLES = {"fast": "fast subset (`make test-fast`)", "whole": "whole suite (`make test`)"}
#: How many of its slowest steps each part lists.
SLOWEST = {"fast": 15, "whole": 50}
#: How many of the last lines of each failure's report the results keep.
REPORT_LINES = 40
#: Each part's goal, in wall-clock seconds on a machine like CI's (2 cores).
GOAL_S = {"fast": 60.0, "whole": 25 * 60.0}


@dataclass
class Outcome:
    part: str
    summary: str            # pytest's last line, e.g. "983 passed, 227 deselected in 50.1s"
    tests: int              # tests run (passed, failed, skipped, errors)
    wall_s: float
    cpu_s: float
    reference_ms: List[float]    # before and after
    load: List[float]            # 1-minute load average before and after
    slowest: List[str]           # pytest's --durations lines
    failures: List[str]          # pytest's short summary of each failed test or error (-rfE)
    reports: List[List[str]]     # the end of each failure's report, in pytest's order
    returncode: int


def run_part(part: str, tests: List[str]) -> Outcome:
    """Run one part of the suite (of the test paths ``tests``) in a fresh pytest process and time it."""
    reference = [reference_loop_ms()]
    load = [os.getloadavg()[0]]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--durations={SLOWEST[part]}",
                           "-rfE", *PARTS[part], *tests], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "400"})   # wide enough for each failure's message
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    load.append(os.getloadavg()[0])
    reference.append(reference_loop_ms())
    lines = done.stdout.splitlines()
    summary = next((line.strip("= ") for line in reversed(lines) if re.search(r"\d+ (passed|failed)", line)), "")
    tests = sum(int(n) for n, what in re.findall(r"(\d+) (passed|failed|skipped|error|errors|xfailed|xpassed)", summary))
    slowest = [line for line in lines if re.match(r"\d+\.\d+s (call|setup|teardown) ", line)]
    failures = [line[:2000] for line in lines if line.startswith(("FAILED ", "ERROR "))]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Outcome(part, summary, tests, wall, cpu, reference, load, slowest, failures, failure_reports(lines),
                   done.returncode)


def failure_reports(lines: List[str]) -> List[List[str]]:
    """The last ``REPORT_LINES`` lines of each report in pytest's FAILURES and ERRORS sections (a
    report starts at a ``____ name ____`` line and ends at the next one or the next ``====`` rule)."""
    reports: List[List[str]] = []
    inside = False
    for line in lines:
        if re.match(r"^=+ (FAILURES|ERRORS) =+$", line):
            inside = True
        elif re.match(r"^=+ .* =+$", line):
            inside = False
        elif inside and re.match(r"^_{3,} .+ _{3,}$", line):
            reports.append([line.strip("_ ")])
        elif inside and reports:
            reports[-1].append(line[:400])
    return [[r[0], *r[1:][-REPORT_LINES:]] for r in reports]


def report(outcomes: List[Outcome], command: str) -> str:
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = ["# The test suite's time", "",
           f"`{command}`, {when}, on a machine of {os.cpu_count()} cores.", "",
           "Wall-clock and CPU seconds of a fresh `python -m pytest` process (collection included); the "
           "reference loop (`benchmarks.runs.reference_loop_ms`) and the 1-minute load average before and "
           "after each part; the last column divides the wall-clock time by the mean reference.", "",
           "| part | tests | wall (s) | CPU (s) | reference loop (ms) | load average | wall / reference | goal (s) | met |",
           "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for o in outcomes:
        mean_ref = sum(o.reference_ms) / len(o.reference_ms)
        out.append(f"| {TITLES[o.part]} | {o.tests} | {o.wall_s:.1f} | {o.cpu_s:.1f} | "
                   f"{o.reference_ms[0]:.1f} / {o.reference_ms[1]:.1f} | {o.load[0]:.1f} / {o.load[1]:.1f} | "
                   f"{o.wall_s / (mean_ref / 1e3):,.0f} | {GOAL_S[o.part]:,.0f} | "
                   f"{'yes' if o.wall_s <= GOAL_S[o.part] else 'no'} |")
    for o in outcomes:
        out += ["", f"## {TITLES[o.part]}", "", f"pytest: {o.summary}" + ("" if o.returncode == 0 else
                                                                      f" (exit status {o.returncode})"), ""]
        if o.failures:
            out += ["What failed:", "", "```", *o.failures, "```", ""]
        for name, *tail in o.reports:
            out += [f"How `{name}` ended (the last {len(tail)} lines of its report):", "", "```", *tail, "```", ""]
        out += [f"Its {len(o.slowest)} slowest steps:", "", "```", *o.slowest, "```"]
    return "\n".join(out) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    cli = argparse.ArgumentParser(prog="python -m benchmarks.test_suite", description=__doc__.splitlines()[0])
    cli.add_argument("--parts", nargs="+", choices=list(PARTS), default=list(PARTS))
    cli.add_argument("--out", type=Path, default=RESULTS)
    cli.add_argument("--tests", nargs="+", default=["tests"], help="test paths to run (default: the whole suite)")
    args = cli.parse_args(argv)
    outcomes = []
    for part in args.parts:
        print(f"running the {TITLES[part]} ...", flush=True)
        outcomes.append(run_part(part, args.tests))
        o = outcomes[-1]
        print(f"  {o.summary}: {o.wall_s:.1f} s wall, {o.cpu_s:.1f} s CPU", flush=True)
    command = "python -m benchmarks.test_suite" + ("" if args.parts == list(PARTS) else " --parts " + " ".join(args.parts))
    command += "" if args.tests == ["tests"] else " --tests " + " ".join(args.tests)
    args.out.write_text(report(outcomes, command))
    print(f"wrote {args.out}")
    return 0 if all(o.returncode == 0 for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
