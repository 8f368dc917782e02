"""Starting, re-running a notebook cell, and stopping: nothing leaks, nothing re-initialises."""

import os
import subprocess
import sys
from typing import List

import psutil
import pytest

from nbscaler.cluster import Cluster, ClusterError, engine
from nbscaler.cluster.watchdog import cluster_processes

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(180)]


def joins():
    return engine.joins


def test_stop_leaves_no_process_and_no_files():
    with Cluster(n=2, timeout=20, name="lifecycle") as cl:
        pids = [s.pid for s in cl.engines]
        cluster_id, profile_dir = cl.cluster_id, cl.profile_dir
        assert set(pids) < {p.pid for p in cluster_processes(cluster_id)}  # and the controller
    assert not any(psutil.pid_exists(pid) for pid in pids)
    assert cluster_processes(cluster_id) == []
    assert not os.path.exists(profile_dir)
    with pytest.raises(ClusterError, match="not running"):
        cl.run(joins)


def test_rerunning_a_cell_reuses_the_engines_or_replaces_them():
    clusters = [Cluster(n=1, timeout=20, name="lifecycle")]
    try:
        pids = [s.pid for s in clusters[0].engines]
        clusters.append(Cluster(n=1, timeout=20, name="lifecycle"))  # the same cell, run again
        assert [s.pid for s in clusters[1].engines] == pids
        assert clusters[1].run(joins) == [1]  # the process group was not initialised twice
        with pytest.raises(ClusterError, match="took over"):
            clusters[0].run(joins)
        clusters.append(Cluster(n=1, timeout=30, name="lifecycle"))  # the cell, edited
        assert not any(psutil.pid_exists(pid) for pid in pids)
        assert clusters[2].run(joins) == [1]
    finally:
        for cl in clusters:
            cl.stop()


NOTEBOOK = """
import sys
from nbscaler.cluster import Cluster
cl = Cluster(n=2, timeout=20, name="doomed")
print(cl.cluster_id, *[slot.pid for slot in cl.engines], flush=True)
sys.stdin.read()  # a notebook kernel, busy with something else until it is killed
"""


def process_tree(pid: int) -> List[psutil.Process]:
    """``pid`` and everything it started, however deep."""
    parent = psutil.Process(pid)
    return [parent, *parent.children(recursive=True)]


def test_a_killed_notebook_leaves_no_process_behind():
    notebook = subprocess.Popen([sys.executable, "-c", NOTEBOOK], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
    try:
        cluster_id, *engine_pids = notebook.stdout.readline().split()  # the cluster is up once this line comes
        assert cluster_id.startswith("nbscaler-doomed-"), "the notebook failed to start its cluster"
        tree = process_tree(notebook.pid)
        assert {int(pid) for pid in engine_pids} < {p.pid for p in tree}
        names = " ".join(" ".join(p.cmdline()) for p in tree)
        assert "ipyparallel.controller" in names and "watchdog" in names
        notebook.kill()  # no atexit hook runs
        _, alive = psutil.wait_procs(tree, timeout=60)
        assert alive == [], f"left behind: {[' '.join(p.cmdline()) for p in alive]}"
        assert cluster_processes(cluster_id) == []
    finally:
        notebook.kill()
        notebook.wait()


def test_restarting_the_kernel_leaves_no_process_behind():
    from jupyter_client.manager import KernelManager

    manager = KernelManager(kernel_name="python3")
    manager.start_kernel(env={**os.environ})
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=120)
        reply = client.execute_interactive(
            "from nbscaler.cluster import Cluster\ncl = Cluster(n=2, timeout=20, name='kernel')", timeout=180,
            user_expressions={"pids": "[slot.pid for slot in cl.engines]"})
        assert reply["content"]["status"] == "ok", reply["content"]
        engine_pids = eval(reply["content"]["user_expressions"]["pids"]["data"]["text/plain"])
        tree = process_tree(manager.provisioner.pid)
        assert set(engine_pids) < {p.pid for p in tree} and len(engine_pids) == 2
        manager.restart_kernel(now=False)  # what the notebook's "restart kernel" does
        _, alive = psutil.wait_procs(tree, timeout=60)
        assert alive == [], f"left behind: {[' '.join(p.cmdline()) for p in alive]}"
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def world_sum():
    import torch
    import torch.distributed as dist
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def test_two_clusters_run_side_by_side():
    with Cluster(n=2, timeout=20, name="left") as left, Cluster(n=2, timeout=20, name="right") as right:
        assert left.profile_dir != right.profile_dir and left.cluster_id != right.cluster_id
        assert left.run(world_sum) == [2.0, 2.0] and right.run(world_sum) == [2.0, 2.0]
        right_pids = {p.pid for p in cluster_processes(right.cluster_id)}
        left.stop()
        assert right.run(world_sum) == [2.0, 2.0]
        assert {p.pid for p in cluster_processes(right.cluster_id)} == right_pids
