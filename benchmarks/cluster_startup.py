"""How long ``Cluster(n)`` takes to be ready, next to a bare ipyparallel cluster of the same size.

"Ready" means: for ipyparallel, ``Cluster(n=n).start_and_connect_sync()`` has returned (controller
up, ``n`` engines registered, client connected); for nbscaler, ``Cluster(n=n)`` has returned
(the same, plus nbscaler imported on every engine and the process group formed).

The two are started in turns (ipyparallel, nbscaler, ipyparallel, ...) so that load on the machine
hits both alike, and the medians are compared. Each cluster is stopped before the next starts, and
stopping is not timed.

    PYTHONPATH=$PWD python -m benchmarks.cluster_startup --n 4 --repeats 5
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from typing import Callable, Dict, List

import ipyparallel

from nbscaler.cluster import Cluster


def bare_ipyparallel(n: int) -> Callable[[], None]:
    """Start a plain ipyparallel cluster; returns how to stop it."""
    profile_dir = tempfile.mkdtemp(prefix="ipp-bench-")
    cluster = ipyparallel.Cluster(n=n, profile_dir=profile_dir, log_level=logging.ERROR, shutdown_atexit=False)
    client = cluster.start_and_connect_sync()

    def stop() -> None:
        client.close()
        cluster.stop_cluster_sync()
    return stop


def nbscaler_cluster(n: int) -> Callable[[], None]:
    """Start an nbscaler cluster (engines, nbscaler imported, process group); returns how to stop it."""
    return Cluster(n=n, timeout=60, name="startup-benchmark").stop


def measure(n: int, repeats: int) -> Dict[str, List[float]]:
    """Seconds to ready, ``repeats`` times each, interleaved."""
    times: Dict[str, List[float]] = {"ipyparallel": [], "nbscaler": []}
    for _ in range(repeats):
        for label, start in (("ipyparallel", bare_ipyparallel), ("nbscaler", nbscaler_cluster)):
            t0 = time.perf_counter()
            stop = start(n)
            times[label].append(time.perf_counter() - t0)
            stop()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4, help="engines per cluster")
    parser.add_argument("--repeats", type=int, default=5, help="starts of each kind")
    args = parser.parse_args()
    load = os.getloadavg()
    times = measure(args.n, args.repeats)
    medians = {label: statistics.median(values) for label, values in times.items()}
    for label, values in times.items():
        print(f"{label:12s} median {medians[label]:6.2f} s   runs: " + " ".join(f"{v:.2f}" for v in values))
    print(f"ratio nbscaler / ipyparallel: {medians['nbscaler'] / medians['ipyparallel']:.2f} "
          f"(n={args.n}, {os.cpu_count()} cores, load average before: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f})")


if __name__ == "__main__":
    main()
