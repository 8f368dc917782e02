"""Soak under load: many compile-and-train cycles on one cluster, and clusters side by side.

``soak`` alternates two policies (``tp`` and ``dp``) on the same engines, compiling anew every cycle,
and samples after each cycle what every engine holds: resident memory, open descriptors, threads,
and the processes of the cluster. The growth per cycle is the least-squares slope of each engine's
resident memory over the cycles after the first quarter (imports, caches and the allocator's
pools fill there), the largest of the engines'.

``side_by_side`` starts several clusters at once, as several notebooks on one machine do, and
checks that they share nothing: names, cluster ids, profile folders, the controller's ports, the
rendezvous ports, and the folders their modules are generated into; then trains on all of them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List

import psutil
import torch

from nbscaler.cluster import Cluster
from nbscaler.cluster.watchdog import cluster_processes
from tests.faults.staging import TP
from tests.multiprocess import Case, case_batch, parallelize_on

DP = Case("mlp", "dp", 1, 2)
MB = 1e6


@dataclass
class Soak:
    """What a soak measured: one sample per engine before the first cycle and after each."""

    cycles: int
    seconds: float = 0.0
    rss: List[List[int]] = field(default_factory=list)        # [sample][rank] bytes
    fds: List[List[int]] = field(default_factory=list)
    threads: List[List[int]] = field(default_factory=list)
    processes: List[int] = field(default_factory=list)        # processes of the cluster

    @property
    def growth_mb_per_cycle(self) -> float:
        """The largest engine's slope of resident memory per cycle, after the first quarter."""
        start = max(1, len(self.rss) // 4)
        return max(_slope(list(range(start, len(self.rss))), [s[r] / MB for s in self.rss[start:]])
                   for r in range(len(self.rss[0])))

    @property
    def leaked_descriptors(self) -> int:
        """Descriptors open after the last cycle beyond those after the first (across engines)."""
        return sum(self.fds[-1]) - sum(self.fds[1])

    @property
    def leaked_processes(self) -> int:
        return self.processes[-1] - self.processes[0]


def _slope(xs: List[int], ys: List[float]) -> float:
    if len(xs) < 2:
        return 0.0
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def sample(cluster: Cluster, soak: Soak) -> None:
    engines = [psutil.Process(slot.pid) for slot in cluster.engines]
    soak.rss.append([p.memory_info().rss for p in engines])
    soak.fds.append([p.num_fds() for p in engines])
    soak.threads.append([p.num_threads() for p in engines])
    soak.processes.append(len(cluster_processes(cluster.cluster_id)))


def soak(cluster: Cluster, folder: Path, cycles: int) -> Soak:
    """``cycles`` compile-and-train cycles (two steps each), ``tp`` and ``dp`` in turn."""
    result = Soak(cycles)
    sample(cluster, result)
    start = time.monotonic()
    for cycle in range(cycles):
        case = (TP, DP)[cycle % 2]
        remote = parallelize_on(cluster, case, str(folder / "gen"))
        remote.train(lambda step, unit, case=case: case_batch(case, step, unit), 2, torch.optim.SGD, lr=0.1,
                     progress=False)
        sample(cluster, result)
    result.seconds = time.monotonic() - start
    return result


def side_by_side(n: int, folder: Path, rounds: int = 3) -> Dict[str, Any]:
    """``n`` notebook processes at once, each with a cluster of the default name, each compiling and
    training ``TP`` ``rounds`` times into one shared ``gen_savedir``; what they used, and clashes."""
    gen = folder / "shared-gen"
    outs = [folder / f"notebook{i}.json" for i in range(n)]
    start = time.monotonic()
    notebooks = [subprocess.Popen([sys.executable, "-m", "tests.faults.notebook", str(gen), str(out), str(rounds)])
                 for out in outs]
    for process in notebooks:
        process.wait()
    seen = [json.loads(out.read_text()) if out.exists() else {"error": "wrote nothing"} for out in outs]
    keys = ("cluster_id", "profile_dir", "controller_ports", "rendezvous", "engine_pids")
    values = {k: [v for s in seen for v in (s.get(k) if isinstance(s.get(k), list) else [s.get(k)])] for k in keys}
    return {"notebooks": n, "seconds": time.monotonic() - start, "seen": seen,
            "clashes": {k: len(v) - len(set(v)) for k, v in values.items()},
            "trained": sum(s.get("trained", 0) for s in seen), "errors": [s["error"] for s in seen if "error" in s]}
