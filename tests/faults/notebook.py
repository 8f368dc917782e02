"""One notebook of ``side_by_side``: a process that starts a cluster under the default name, trains
into a shared ``gen_savedir`` and says what it used.

    python -m tests.faults.notebook GEN_SAVEDIR OUT_JSON ROUNDS
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, Dict, List

from nbscaler.cluster import Cluster
from tests.faults.staging import TP
from tests.multiprocess import check_on_cluster


def where_it_talks() -> Dict[str, Any]:
    """On a rank: the rendezvous it joined and its pid."""
    return {"master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}", "pid": os.getpid()}


def controller_ports(cluster: Cluster) -> List[int]:
    """The ports in the controller's client connection file."""
    found = sorted(Path(cluster.profile_dir, "security").glob("ipcontroller-*client.json"))
    info = json.loads(found[0].read_text())
    return sorted(v for v in info.values() if isinstance(v, int))


def main(gen: str, out: str, rounds: int) -> None:
    seen: Dict[str, Any] = {"trained": 0}
    try:
        with Cluster(n=2, timeout=20) as cluster:
            seen.update(name=cluster.name, cluster_id=cluster.cluster_id, profile_dir=cluster.profile_dir,
                        controller_ports=controller_ports(cluster))
            ranks = cluster.run(where_it_talks)
            seen.update(rendezvous=ranks[0]["master"], engine_pids=[r["pid"] for r in ranks])
            for _ in range(rounds):
                check_on_cluster(cluster, TP, gen)
                seen["trained"] += 1
    except Exception:            # the parent reports it
        seen["error"] = traceback.format_exc()[-2000:]
    Path(out).write_text(json.dumps(seen))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
