"""parallelize / train / infer through the cluster give what one process, or spawn, gives."""

import functools

import pandas as pd
import pytest
import torch

import nbscaler
from nbscaler.cluster import RankError
from nbscaler.cluster.training import parallelize_here, train_here
from nbscaler.columns import MEMORY_CATEGORIES, SummaryColumn
from nbscaler.runtime.scaler import LossScaler
from tests.models import batch, build
from tests.multiprocess import (EVAL_SEED, OPTIMIZERS, Case, case_batch, check_equivalence, check_on_cluster,
                                grad_pieces, parallelize_on, pipeline, reference_loss_scaled, run_ranks, samples,
                                save_checkpoint, train_single, zero)

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

CASES = {
    2: [Case("mlp", "dp", 1, 2), Case("mlp", "tp", 2, 2)],
    4: [Case("mlp", "dp", 1, 4), Case("mlp", "tp", 4, 4), Case("mlp", "tp", 2, 4),
        Case("llama", "dp", 1, 4, config=zero(stage=3))],                 # fully sharded, from a notebook
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
    assert first.steps["compile_s"].isna().all()       # an eager module: no torch.compile time to report
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


FP16_DP = Case("mlp", "dp", 1, 2, steps=4, optimizer="adamw", module_dtype=torch.float16, master_dtype=torch.float32)


def test_fp16_with_loss_scaling_trains_on_the_cluster_and_reports_the_skipped_step(cluster, tmp_path):
    """fp16 through ``train()``: the scaler goes in with the optimizer's keywords, the first scale
    overflows (the scaled loss is inf), so every rank skips step 0 and lowers the scale; the losses,
    scales and final weights are those of the recipe written out in one process."""
    case = FP16_DP
    scale, backoff, interval = 2.0 ** 20, 2.0 ** -8, 2
    remote = cluster.parallelize(build(case.model), samples(case, 0, 0)[0], case.policy, case.compute_config,
                                 gen_savedir=str(tmp_path), reuse="override", instance_name="fp16_dp",
                                 module_dtype=case.module_dtype)
    result = remote.train(functools.partial(case_batch, case), case.steps, torch.optim.AdamW,
                          master_dtype=case.master_dtype, progress=False,
                          scaler=LossScaler(init_scale=scale, backoff_factor=backoff, growth_interval=interval),
                          **OPTIMIZERS[case.optimizer][1])
    ref = reference_loss_scaled(case, scale, backoff, interval)
    assert ref["skipped"] == [True, False, False, False]
    for rank in range(case.runtime_ngpus):
        steps = result.steps[result.steps["rank"] == rank]
        assert steps["skipped"].tolist() == ref["skipped"], f"rank {rank}"
        assert steps["loss_scale"].tolist() == ref["scales"] == [scale, scale * backoff, scale * backoff,
                                                                  scale * backoff * 2], f"rank {rank}"
        assert steps["loss"].tolist() == [losses[rank] for losses in ref["losses"]], f"rank {rank}"
    for rank, params in enumerate(remote.run(lambda module: [p.detach().clone() for p in module.parameters()])):
        assert {p.dtype for p in params} == {torch.float16}
        assert all(torch.equal(a, b) for a, b in zip(params, ref["params"])), f"rank {rank} weights"


def test_steps_without_a_loss_scaler_report_no_scale_and_no_skip(cluster, tmp_path):
    case = Case("mlp", "dp", 1, 2)
    result = parallelize_on(cluster, case, str(tmp_path)).train(functools.partial(case_batch, case), 2,
                                                                torch.optim.SGD, lr=0.1, progress=False)
    assert result.steps["loss_scale"].isna().all() and not result.steps["skipped"].any()
