"""Starting, re-running a notebook cell, and stopping: nothing leaks, nothing re-initialises."""

import os

import psutil
import pytest

from nbscaler.cluster import Cluster, ClusterError, engine
from nbscaler.cluster.cluster import cluster_processes

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
