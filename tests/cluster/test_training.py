"""parallelize / train / infer through the cluster give what one process, or spawn, gives."""

import functools

import pandas as pd
import pytest
import torch

import nbscaler
from nbscaler.cluster import RankError
from nbscaler.cluster.training import parallelize_here, train_here
from nbscaler.columns import MEMORY_CATEGORIES, SummaryColumn
from tests.models import batch, build
from tests.multiprocess import (EVAL_SEED, Case, case_batch, check_equivalence, check_on_cluster, grad_pieces,
                                parallelize_on, pipeline, run_ranks, save_checkpoint, train_single)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

CASES = {
    2: [Case("mlp", "dp", 1, 2), Case("mlp", "tp", 2, 2)],
    4: [Case("mlp", "dp", 1, 4), Case("mlp", "tp", 4, 4), Case("mlp", "tp", 2, 4)],
}
PIPELINE = Case("gpt", "pp", 2, 2, config=pipeline("1f1b", 2, 4))


@pytest.mark.parametrize("nranks", [2, 4])
def test_losses_and_gradients_equal_one_process(nranks, request, tmp_path):
    cl = request.getfixturevalue("cluster" if nranks == 2 else "cluster4")
    for case in CASES[nranks]:
        remote = parallelize_on(cl, case, str(tmp_path))
        result = remote.train(functools.partial(case_batch, case), case.steps, torch.optim.SGD, lr=0.1,
                              after_backward=grad_pieces, progress=False)
        eval_losses = remote.infer(batch(case.model, EVAL_SEED))
        per_rank = [{"losses": [[loss] for loss in result.steps[result.steps["rank"] == r]["loss"]],
                     "grads": result.probes[r], "eval_loss": [eval_losses[r].item()]} for r in range(nranks)]
        check_equivalence(case, per_rank)


def test_a_meta_model_reads_its_slices_on_the_engines(cluster, tmp_path):
    """The notebook builds the model on meta and sends it; each engine reads its own slices."""
    case = Case("llama", "tp", 2, 2, weights=save_checkpoint("llama", str(tmp_path / "llama")))
    check_on_cluster(cluster, case, str(tmp_path))


def train_with_spawn(case: Case, gen_dir: str):
    parallelize_here("m", build(case.model), batch(case.model, 12345), case.policy, case.compute_config,
                     {"gen_savedir": gen_dir, "reuse": "override"})
    return train_here("m", functools.partial(case_batch, case), case.steps, torch.optim.SGD,
                      {"lr": 0.1}, None, None)["steps"]


def test_a_pipeline_trains_as_under_spawn_and_reports_its_schedule(cluster, tmp_path):
    spawned = run_ranks(train_with_spawn, 2, PIPELINE, str(tmp_path / "spawn"))
    remote = parallelize_on(cluster, PIPELINE, str(tmp_path / "cluster"))
    result = remote.train(functools.partial(case_batch, PIPELINE), PIPELINE.steps, torch.optim.SGD, lr=0.1,
                          progress=False)
    assert result.steps["loss"].tolist() == [row["loss"] for rows in spawned for row in rows]
    reference = train_single(PIPELINE)  # the step's loss is the sum over its micro-batches
    expected = [sum(reference["losses"][step][0]) for step in range(PIPELINE.steps)]
    assert result.losses[0].tolist() == pytest.approx(expected, rel=1e-5)

    blocks = result.schedule
    assert len(blocks) == 2 * PIPELINE.steps * 2 * 4  # ranks x steps x (F, B) x micro-batches
    assert (blocks["stage"] == blocks["rank"]).all()  # 1f1b on 2 devices: stage s on rank s
    assert (blocks["t_end"] >= blocks["t_start"]).all()
    line = result.timeline(step=1)
    assert 0 <= line.bubble_fraction < 1 and line.makespan > 0

    # The ranks count their memory in the columns the plan predicts, to the byte (SGD: no state).
    predicted = nbscaler.plan(build(PIPELINE.model), batch(PIPELINE.model, 12345), PIPELINE.policy,
                              PIPELINE.compute_config).summary(torch.optim.SGD, lr=0.1).set_index("rank")
    measured = result.memory.set_index("rank")
    columns = [str(c) for c in (*MEMORY_CATEGORIES, SummaryColumn.PEAK_BYTES)]
    pd.testing.assert_frame_equal(measured[columns], predicted[columns], check_dtype=False)
    assert (measured["activation_bytes"] > 0).all()


def test_telemetry_comes_back_as_dataframes(cluster, tmp_path):
    remote = parallelize_on(cluster, Case("mlp", "tp", 2, 2), str(tmp_path))
    first = remote.train(functools.partial(case_batch, Case("mlp", "dp", 1, 2)), 2, torch.optim.AdamW, lr=1e-3, progress=False)
    again = remote.train(functools.partial(case_batch, Case("mlp", "dp", 1, 2)), 1, progress=False)  # keeps the optimizer
    assert first.steps["step"].tolist() == [0, 1, 0, 1] and again.steps["step"].tolist() == [2, 2]
    assert first.schedule.empty  # no pipeline, no blocks
    assert (first.steps["t_end"] >= first.steps["t_start"]).all()
    assert list(first.losses.columns) == [0, 1]
    memory = first.memory.set_index("rank")
    assert (memory["param_bytes"] > 0).all() and (memory["peak_rss_bytes"] > 0).all()
    assert (memory["optimizer_bytes"] >= 2 * memory["param_bytes"]).all()  # AdamW: two moments per weight
    numels = remote.run(lambda module: sum(p.numel() for p in module.parameters()))
    assert [4 * n for n in numels] == memory["param_bytes"].tolist()  # fp32 shards


def test_the_progress_bar_follows_the_ranks(cluster, tmp_path, capsys):
    remote = parallelize_on(cluster, Case("mlp", "dp", 1, 2), str(tmp_path))
    remote.train(functools.partial(case_batch, Case("mlp", "dp", 1, 2)), 3, torch.optim.SGD, lr=0.1)
    bar = capsys.readouterr().err
    assert "train dp_1_2" in bar and "3/3" in bar and "loss=" in bar


def test_training_without_an_optimizer_says_how_to_fix_it(cluster, tmp_path):
    remote = parallelize_on(cluster, Case("mlp", "dp", 1, 2), str(tmp_path))
    with pytest.raises(RankError, match="optimizer_fn"):
        remote.train(functools.partial(case_batch, Case("mlp", "dp", 1, 2)), 1, progress=False)


def test_a_plan_for_another_world_size_is_refused_before_it_runs(cluster, tmp_path):
    with pytest.raises(ValueError, match="runtime_ngpus=2"):
        parallelize_on(cluster, Case("mlp", "dp", 1, 4), str(tmp_path))
