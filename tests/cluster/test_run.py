"""What a notebook relies on when it calls ``Cluster.run``."""

import os

import pytest
import torch
import torch.distributed as dist

from nbscaler.cluster import report
from nbscaler.config import threads_per_rank

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]


def rank_and_sum(offset, scale=1):
    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), t.item() * scale


def test_results_come_back_in_rank_order(cluster):
    assert cluster.run(rank_and_sum, 1, scale=2) == [(0, 2, 6.0), (1, 2, 6.0)]


def test_ranks_follow_engine_order_and_set_the_torchrun_environment(cluster):
    env = cluster.run(lambda: {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")})
    assert [s.engine_id for s in cluster.engines] == sorted(s.engine_id for s in cluster.engines)
    assert env == [{"RANK": str(r), "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2"}
                   for r in range(2)]
    assert cluster.run(dist.get_backend) == ["gloo", "gloo"]


def test_threads_are_shared_out(cluster):
    expected = threads_per_rank(os.cpu_count(), 2)
    assert cluster.run(lambda: (torch.get_num_threads(), os.environ["OMP_NUM_THREADS"])) == \
        [(expected, str(expected))] * 2


NOTEBOOK_CELL = '''
import torch

class Doubler(torch.nn.Module):
    def forward(self, x):
        return 2 * x

def use_doubler(x):
    import torch.distributed as dist
    return Doubler()(x + dist.get_rank())
'''


def test_functions_and_classes_defined_in_the_notebook_run_on_engines(cluster):
    namespace = {"__name__": "__main__"}  # what a notebook cell defines things in
    exec(NOTEBOOK_CELL, namespace)
    out = cluster.run(namespace["use_doubler"], torch.ones(2))
    assert [o.tolist() for o in out] == [[2.0, 2.0], [4.0, 4.0]]


def test_connection_files_live_in_the_clusters_own_profile_dir(cluster):
    security = os.path.join(cluster.profile_dir, "security")
    assert any(name.startswith("ipcontroller-nbscaler-tests-") for name in os.listdir(security))


def count_steps(steps):
    for step in range(steps):
        report(step=step + 1)
    return steps


def test_reports_reach_the_notebook_while_the_call_runs(cluster):
    seen = []
    assert cluster.call(count_steps, (3,), on_report=seen.append) == [3, 3]
    assert seen[-1] == [{"step": 3}, {"step": 3}]


def test_report_outside_a_cluster_does_nothing():
    assert count_steps(2) == 2


def test_px_magic_runs_on_every_rank(cluster, shell):
    cluster.view.activate()  # %px follows the cluster started last; other tests started theirs
    shell.run_cell_magic("px", "", "import torch.distributed as dist\nrank_times_ten = dist.get_rank() * 10")
    assert cluster.view["rank_times_ten"] == [0, 10]
