"""parallelize / train / infer through the cluster give what one process, or spawn, gives."""

import functools

import pytest
import torch

from nbscaler import ComputeConfig
from nbscaler.cluster import RankError
from nbscaler.cluster.training import parallelize_here, train_here
from nbscaler.runtime.checkpoint import local_pieces
from tests.models import batch, build
from tests.multiprocess import EVAL_SEED, Case, check_equivalence, data_seed, run_ranks

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

CASES = {
    2: [Case("mlp", "dp", 1, 2), Case("mlp", "tp", 2, 2)],
    4: [Case("mlp", "dp", 1, 4), Case("mlp", "tp", 4, 4), Case("mlp", "tp", 2, 4)],
}


def unit_batch(model: str, step: int, unit: int):
    return batch(model, data_seed(step, unit))


def merged_grad_pieces(module, optimizer, step):
    return local_pieces(module, grads=True), {}


def parallelize_case(cl, case: Case, gen_dir: str):
    return cl.parallelize(build(case.model), batch(case.model, 12345), case.policy,
                          ComputeConfig(plan_ngpus=case.plan_ngpus, runtime_ngpus=case.runtime_ngpus),
                          gen_savedir=gen_dir, reuse="override",
                          instance_name=f"{case.policy}_{case.plan_ngpus}_{case.runtime_ngpus}")


@pytest.mark.parametrize("nranks", [2, 4])
def test_losses_and_gradients_equal_one_process(nranks, request, tmp_path):
    cl = request.getfixturevalue("cluster" if nranks == 2 else "cluster4")
    for case in CASES[nranks]:
        remote = parallelize_case(cl, case, str(tmp_path))
        result = remote.train(functools.partial(unit_batch, case.model), case.steps, torch.optim.SGD, lr=0.1,
                              after_backward=merged_grad_pieces, progress=False)
        eval_losses = remote.infer(batch(case.model, EVAL_SEED))
        per_rank = [{"losses": result.steps[result.steps["rank"] == r]["loss"].tolist(),
                     "grads": result.probes[r], "eval_loss": eval_losses[r].item()} for r in range(nranks)]
        check_equivalence(case, per_rank)


def train_with_spawn(case: Case, gen_dir: str):
    cfg = ComputeConfig(plan_ngpus=case.plan_ngpus, runtime_ngpus=case.runtime_ngpus)
    parallelize_here("m", build(case.model), batch(case.model, 12345), case.policy, cfg,
                     {"gen_savedir": gen_dir, "reuse": "override"})
    return train_here("m", functools.partial(unit_batch, case.model), case.steps, torch.optim.SGD,
                      {"lr": 0.1}, None, None)["steps"]


def test_the_cluster_and_spawn_train_alike(cluster, tmp_path):
    case = Case("mlp", "tp", 2, 2)
    spawned = run_ranks(train_with_spawn, 2, case, str(tmp_path / "spawn"))
    remote = parallelize_case(cluster, case, str(tmp_path / "cluster"))
    result = remote.train(functools.partial(unit_batch, case.model), case.steps, torch.optim.SGD, lr=0.1,
                          progress=False)
    assert result.steps["loss"].tolist() == [row["loss"] for rows in spawned for row in rows]


def test_telemetry_comes_back_as_dataframes(cluster, tmp_path):
    remote = parallelize_case(cluster, Case("mlp", "tp", 2, 2), str(tmp_path))
    first = remote.train(functools.partial(unit_batch, "mlp"), 2, torch.optim.AdamW, lr=1e-3, progress=False)
    again = remote.train(functools.partial(unit_batch, "mlp"), 1, progress=False)  # keeps the optimizer
    assert first.steps["step"].tolist() == [0, 1, 0, 1] and again.steps["step"].tolist() == [2, 2]
    assert (first.steps["t_end"] >= first.steps["t_start"]).all()
    assert list(first.losses.columns) == [0, 1]
    memory = first.memory.set_index("rank")
    assert (memory["param_bytes"] > 0).all() and (memory["peak_rss_bytes"] > 0).all()
    assert (memory["optimizer_bytes"] >= 2 * memory["param_bytes"]).all()  # AdamW: two moments per weight
    numels = remote.run(lambda module: sum(p.numel() for p in module.parameters()))
    assert [4 * n for n in numels] == memory["param_bytes"].tolist()  # fp32 shards


def test_the_progress_bar_follows_the_ranks(cluster, tmp_path, capsys):
    remote = parallelize_case(cluster, Case("mlp", "dp", 1, 2), str(tmp_path))
    remote.train(functools.partial(unit_batch, "mlp"), 3, torch.optim.SGD, lr=0.1)
    bar = capsys.readouterr().err
    assert "train dp_1_2" in bar and "3/3" in bar and "loss=" in bar


def test_training_without_an_optimizer_says_how_to_fix_it(cluster, tmp_path):
    remote = parallelize_case(cluster, Case("mlp", "dp", 1, 2), str(tmp_path))
    with pytest.raises(RankError, match="optimizer_fn"):
        remote.train(functools.partial(unit_batch, "mlp"), 1, progress=False)


def test_a_plan_for_another_world_size_is_refused_before_it_runs(cluster, tmp_path):
    with pytest.raises(ValueError, match="runtime_ngpus=2"):
        parallelize_case(cluster, Case("mlp", "dp", 1, 4), str(tmp_path))
