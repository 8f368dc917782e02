"""Broadcast strategies, with one folder per rank standing in for machines that share no disk."""

import os

import pytest
import torch.distributed as dist

from nbscaler import ComputeConfig, parallelize
from nbscaler.genfiles import module_dir
from tests.models import MLP, batch, build
from tests.multiprocess import run_ranks

ALL = ["config.json", "gencode0.py", "gencode1.py", "graph.pkl", "plan.json", "weights.pt"]


def _compile_per_node(root, strategy, load):
    rank = dist.get_rank()
    savedir = os.path.join(root, f"node{rank}")
    out = parallelize(build("mlp"), batch("mlp", 0), "tp", ComputeConfig(2, 2), gen_savedir=savedir,
                      broadcast_strategy=strategy, load_module=load,
                      init_module_params=strategy != "no_weights" or rank == 0)
    path = module_dir(MLP, savedir, None)
    files = sorted(os.listdir(path)) if path.exists() else []
    loss = out(**batch("mlp", 1)).item() if load else None
    return files, loss


@pytest.mark.multiprocess
def test_broadcast_strategies(tmp_path):
    results = {}
    for strategy, load in (("all", True), ("no_weights", True), ("code", False), ("none", False)):
        results[strategy] = run_ranks(_compile_per_node, 2, str(tmp_path / strategy), strategy, load)
    for strategy, per_rank in results.items():
        assert per_rank[0][0] == ALL, strategy               # rank 0 generated everything
    assert results["all"][1][0] == ALL
    assert results["all"][0][1] == results["all"][1][1]      # both ranks computed the same loss
    assert results["no_weights"][1][0] == [f for f in ALL if f != "weights.pt"]
    assert results["code"][1][0] == ["gencode0.py", "gencode1.py"]
    assert results["none"][1][0] == []
