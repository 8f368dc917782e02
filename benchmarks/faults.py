"""The fault campaign, a soak under load, and notebooks side by side, written to one results page.

Every fault of ``tests/faults`` is staged on one two-engine cluster (collective timeout 20 s), in
the order below; each row says how long the error took to reach the notebook from the fault,
whether it named the rank and the cause, whether anything visible was left half-written, and
whether the cluster then trained as one process does (``restart()`` first where a rank was lost).
The network cut runs on a cluster of its own over two network-namespace hosts.

The soak compiles and trains ``tp`` and ``dp`` in turn on one cluster, sampling its engines after
every cycle (``tests.faults.soak``); then several notebook processes start a cluster each, at once,
and compile and train the same module into one shared ``gen_savedir``.

    python -m benchmarks.faults                  # 200 cycles, 4 notebooks; writes benchmarks/results/faults.md
"""

from __future__ import annotations

import argparse
import functools
import platform
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from nbscaler.cluster import Cluster
from tests.cluster import netns_hosts
from tests.faults import disks, folders, network, processes, soak
from tests.faults.staging import DEADLINE_S, Row

RESULTS = Path(__file__).parent / "results" / "faults.md"
DOCS = Path(__file__).parents[1] / "docs" / "faults.md"
#: docs/faults.md carries the fault table between these markers, copied from the results by this script.
START, END = "<!-- faults: written by python -m benchmarks.faults -->", "<!-- /faults -->"
TIMEOUT_S = 20
GROWTH_GOAL_MB = 0.1
FAULTS: Dict[str, Callable[[Any, Path], Row]] = {
    "kill-forward": processes.kill_in_forward,
    "kill-collective": processes.kill_in_collective,
    "kill-save": processes.kill_in_checkpoint_save,
    "stop": processes.stop_in_collective,
    "disk-checkpoint": disks.disk_full_in_checkpoint_save,
    "disk-generated": disks.disk_full_in_generated_files,
    "flipped": functools.partial(disks.damaged_checkpoint, damage="flip"),
    "truncated": functools.partial(disks.damaged_checkpoint, damage="truncate"),
    "deleted-folder": folders.generated_folder_deleted,
    "changed-folder": folders.generated_folder_changed,
}
NETWORK = "network-cut"


def run_faults(names: List[str], folder: Path) -> List[Row]:
    """Stage each named fault in turn on one cluster (the network cut on hosts of its own)."""
    rows = []
    with Cluster(n=2, timeout=TIMEOUT_S, name="faults") as cluster:
        for name in (n for n in names if n != NETWORK):
            rows.append(FAULTS[name](cluster, folder / name))
    if NETWORK in names:
        reason = netns_hosts.missing_reason()
        if reason:
            rows.append(Row("network cut between two hosts", None, "not staged", False, False, False, False, reason))
        else:
            hosts = netns_hosts.make()
            try:
                rows.append(network.cut_between_hosts(hosts, folder / NETWORK))
            finally:
                netns_hosts.remove(hosts)
    return rows


def run_soak(cycles: int, folder: Path) -> soak.Soak:
    with Cluster(n=2, timeout=TIMEOUT_S, name="soak") as cluster:
        return soak.soak(cluster, folder, cycles)


def yes(flag: Optional[bool]) -> str:
    return "yes" if flag else "no"


def fault_table(rows: List[Row]) -> List[str]:
    lines = ["| fault | seconds to the error | error | rank named | cause named | nothing half-written | "
             "trains as one process after | verdict | note |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        seconds = "no error due" if row.seconds is None else f"{row.seconds:.2f}"
        error = row.error.replace("|", "/")
        named = ("n/a", "n/a") if row.seconds is None else (yes(row.rank_named), yes(row.cause_named))
        lines.append(f"| {row.fault} | {seconds} | {error} | {named[0]} | {named[1]} | "
                     f"{yes(row.intact)} | {yes(row.usable)} | {'pass' if row.passed else 'FAIL'} | {row.note} |")
    return lines


def soak_lines(result: soak.Soak) -> List[str]:
    growth = result.growth_mb_per_cycle
    first, last = result.rss[1], result.rss[-1]
    return [
        f"{result.cycles} compile-and-train cycles (tp and dp in turn, two steps each) in {result.seconds:.0f} s.",
        "",
        "| measure | rank 0 | rank 1 |", "|---|---|---|",
        f"| resident MB before the first cycle | {result.rss[0][0] / 1e6:.1f} | {result.rss[0][1] / 1e6:.1f} |",
        f"| resident MB after the first cycle | {first[0] / 1e6:.1f} | {first[1] / 1e6:.1f} |",
        f"| resident MB after the last cycle | {last[0] / 1e6:.1f} | {last[1] / 1e6:.1f} |",
        f"| open descriptors after the first / last cycle | {result.fds[1][0]} / {last_of(result.fds, 0)} | "
        f"{result.fds[1][1]} / {last_of(result.fds, 1)} |",
        f"| threads after the first / last cycle | {result.threads[1][0]} / {last_of(result.threads, 0)} | "
        f"{result.threads[1][1]} / {last_of(result.threads, 1)} |",
        "",
        f"Growth: {growth:.3f} MB per cycle (the larger engine's least-squares slope after the first quarter "
        f"of the cycles); goal under {GROWTH_GOAL_MB} MB: {'met' if growth < GROWTH_GOAL_MB else 'NOT met'}. "
        f"Descriptors leaked: {result.leaked_descriptors}; processes of the cluster before and after: "
        f"{result.processes[0]} and {result.processes[-1]} ({result.leaked_processes} leaked).",
    ]


def last_of(samples: List[List[int]], rank: int) -> int:
    return samples[-1][rank]


def side_lines(side: Dict[str, Any], rounds: int) -> List[str]:
    clashes = ", ".join(f"{k} {v}" for k, v in side["clashes"].items())
    lines = [f"{side['notebooks']} notebook processes at once, each with a cluster of the default name, each "
             f"compiling and training tp {rounds} times into one shared gen_savedir ({side['seconds']:.0f} s): "
             f"{side['trained']} of {side['notebooks'] * rounds} trainings equal one process; values shared by two "
             f"clusters: {clashes}."]
    lines += [f"\nA notebook failed:\n\n```\n{error}\n```" for error in side["errors"]]
    return lines


def write(out: Path, rows: List[Row], result: Optional[soak.Soak], side: Optional[Dict[str, Any]], rounds: int) -> Path:
    passed = sum(row.passed for row in rows)
    lines = [
        "# Faults: what a cluster does when a rank, a disk or the network fails",
        "",
        f"Written by `python -m benchmarks.faults` on {platform.node()} ({platform.machine()}, torch "
        f"{torch.__version__}), two engines, collective timeout {TIMEOUT_S} s; deadline for an error "
        f"{DEADLINE_S:.0f} s. {passed} of {len(rows)} faults pass.",
        "",
        *fault_table(rows),
    ]
    if result is not None:
        lines += ["", "## Soak", "", *soak_lines(result)]
    if side is not None:
        lines += ["", "## Notebooks side by side", "", *side_lines(side, rounds)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return out


def splice(results: Path, docs: Path) -> None:
    """Copy the fault table and its verdict line from ``results`` into ``docs`` between the markers."""
    lines = results.read_text().splitlines()
    table = [line for line in lines if line.startswith("|")]
    table = table[: next((i for i, line in enumerate(table) if line.startswith("| measure |")), len(table))]
    verdict = next(line for line in lines if "faults pass." in line)
    text = docs.read_text()
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    docs.write_text(f"{head}{START}\n{verdict}\n\n" + "\n".join(table) + f"\n{END}{tail}")


def main(argv: Optional[List[str]] = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", nargs="*", default=[*FAULTS, NETWORK], choices=[*FAULTS, NETWORK])
    parser.add_argument("--cycles", type=int, default=200, help="soak cycles (0: no soak)")
    parser.add_argument("--notebooks", type=int, default=4, help="notebooks side by side (0: none)")
    parser.add_argument("--rounds", type=int, default=3, help="trainings of each notebook")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--docs", type=Path, default=None,
                        help="page to copy the table into (default: docs/faults.md when --out is the default)")
    parser.add_argument("--splice-only", action="store_true", help="only copy the table of --out into --docs")
    args = parser.parse_args(argv)
    docs = args.docs or (DOCS if args.out == RESULTS else None)
    if args.splice_only:
        splice(args.out, docs or DOCS)
        return args.out
    with tempfile.TemporaryDirectory(prefix="nbscaler-faults-") as tmp:
        folder = Path(tmp)
        start = time.monotonic()
        rows = run_faults(args.faults, folder / "faults")
        print(f"faults: {time.monotonic() - start:.0f} s", flush=True)
        result = run_soak(args.cycles, folder / "soak") if args.cycles else None
        side = soak.side_by_side(args.notebooks, folder / "side", args.rounds) if args.notebooks else None
    out = write(args.out, rows, result, side, args.rounds)
    if docs is not None:
        splice(out, docs)
    return out


if __name__ == "__main__":
    print(main())
