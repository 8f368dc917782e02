"""The correctness oracle: every built-in policy, on 1, 2 and 4 ranks, trains exactly like one process.

Each test spawns the ranks once and runs several cases in them (a spawn costs seconds); the
comparison covers every rank's loss and every parameter's merged gradient at every step.
"""

import pytest

from tests.multiprocess import Case, check_equivalence, run_ranks, train_parallel

MODELS = ["mlp", "llama", "cnn", "branch"]

# (policy, plan_ngpus, runtime_ngpus) per rank count; runtime > plan means data-parallel units.
PLANS = {
    1: [("dp", 1, 1), ("tp", 1, 1), ("data", 1, 1)],
    2: [("dp", 1, 2), ("tp", 2, 2), ("data", 2, 2)],
    4: [("dp", 1, 4), ("tp", 4, 4), ("data", 4, 4), ("tp", 2, 4), ("data", 2, 4)],
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("nranks", [1, 2, 4])
@pytest.mark.parametrize("model", MODELS)
def test_policies_equal_single_process(model, nranks, tmp_path):
    cases = [Case(model, policy, plan, runtime) for policy, plan, runtime in PLANS[nranks]]
    per_rank = run_ranks(train_parallel, nranks, cases, str(tmp_path))
    for i, case in enumerate(cases):
        check_equivalence(case, [res[i] for res in per_rank])


@pytest.mark.multiprocess
def test_parallel_submodule_inside_plain_model(tmp_path):
    """Only ``trunk`` is parallel (tp inside 2 units); the plain layers around it sync through
    the optimizer's non-parallel reducer."""
    cases = [Case("with_trunk", "tp", 2, 4), Case("with_trunk", "dp", 1, 4)]
    per_rank = run_ranks(train_parallel, 4, cases, str(tmp_path))
    for i, case in enumerate(cases):
        check_equivalence(case, [res[i] for res in per_rank])


@pytest.mark.multiprocess
def test_registered_user_op_is_split_and_trains_like_one_process(tmp_path):
    """``project`` is a register_op function: tp splits it by its annotation like a built-in op."""
    cases = [Case("user_op", "tp", 2, 2), Case("user_op", "data", 2, 2)]
    per_rank = run_ranks(train_parallel, 2, cases, str(tmp_path))
    for i, case in enumerate(cases):
        check_equivalence(case, [res[i] for res in per_rank])
    code = next(tmp_path.rglob("gencode1.py")).read_text()
    assert "from tests.models import project as _op_tests_models_project" in code


@pytest.mark.multiprocess
def test_fused_grouped_query_projection_split_by_heads_trains_like_one_process(tmp_path):
    """One Linear makes q, k and v in blocks of unequal size (4 query heads, 2 key/value heads):
    tp splits its weight rows strided in blocks 2:1:1, so each device holds its own query heads
    and the key/value heads they read; checkpoints merge the slices back into one weight. The split's
    sizes shrink on each device whether given by position or by keyword (the tracer records them
    by position)."""
    cases = [Case("fused_gqa", "tp", 2, 2), Case("fused_gqa", "tp", 2, 2, optimizer="adamw"),
             Case("fused_gqa_keyword", "tp", 2, 2)]
    per_rank = run_ranks(train_parallel, 2, cases, str(tmp_path))
    for i, case in enumerate(cases):
        check_equivalence(case, [res[i] for res in per_rank])
    keyword = [p.read_text() for p in tmp_path.rglob("gencode1.py") if "FusedGQAByKeyword" in p.read_text()]
    assert len(keyword) == 1 and "= torch.split(linear_0, [16, 8, 8], dim=-1)" in keyword[0]
