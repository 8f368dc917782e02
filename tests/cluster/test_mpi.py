"""The same Cluster on ipyparallel's MPI launcher, for real, with the local ``mpiexec``."""

import os
import shutil

import psutil
import pytest
import torch.distributed as dist

from nbscaler.cluster import Cluster
from nbscaler.cluster.watchdog import cluster_processes

pytestmark = [
    pytest.mark.cluster, pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec (apt-get install openmpi-bin)"),
]
pytest.importorskip("mpi4py", reason="ipengine --mpi needs mpi4py (pip install 'nbscaler[mpi]')")


def where_am_i():
    return dist.get_rank(), dist.get_world_size(), int(os.environ["OMPI_COMM_WORLD_RANK"])


def test_mpi_engines_form_the_group_in_mpi_rank_order():
    with Cluster(n=2, engines="mpi", timeout=20, name="mpi") as cl:
        assert cl.run(where_am_i) == [(0, 2, 0), (1, 2, 1)]
        pids, cluster_id = [s.pid for s in cl.engines], cl.cluster_id
    assert not any(psutil.pid_exists(pid) for pid in pids)
    assert cluster_processes(cluster_id) == []
