"""Mixture-of-experts models train on ranks exactly as in one process: the shipped MoE Llama,
dropless (grouped products over tokens sorted by expert) and with a capacity (fixed buffers,
dropped pairs), under data parallelism, a batch split, tensor parallelism around the experts, and
expert parallelism (each device a share of the experts, the pairs sent to them by all-to-all).

Each test spawns its ranks once and runs every case in them.
"""

import pytest

from tests.multiprocess import Case, check_equivalence, expert_parallel, pipeline, run_ranks, train_parallel, zero

MODELS = ("moe", "moe_capacity")
HF_MODELS = ("hf_mixtral", "hf_qwen3_moe")
PLANS = {
    1: [("dp", 1, 1), ("tp", 1, 1)],
    2: [("dp", 1, 2), ("data", 2, 2), ("tp", 2, 2)],
    4: [("dp", 1, 4), ("data", 4, 4), ("tp", 4, 4), ("tp", 2, 4)],
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_experts_train_like_one_process(nranks, tmp_path):
    cases = [Case(model, policy, plan, runtime) for model in MODELS for policy, plan, runtime in PLANS[nranks]]
    per_rank = run_ranks(train_parallel, nranks, cases, str(tmp_path))
    for i, case in enumerate(cases):
        check_equivalence(case, [res[i] for res in per_rank])


@pytest.mark.multiprocess
def test_experts_in_pipelines_and_under_zero_train_like_one_process(tmp_path):
    """The dropless MoE cut into two pipeline stages (1f1b, two micro-batches); both routings with
    their optimizer state, gradients (ZeRO-2) and weights (ZeRO-3) sharded over two ranks."""
    cases = [Case("moe_e2e", "pp", 2, 2, config=pipeline("1f1b", 2, 2)),
             Case("moe", "dp", 1, 2, config=zero(stage=2), optimizer="adamw"),
             Case("moe_capacity", "dp", 1, 2, config=zero(stage=3), optimizer="adamw")]
    per_rank = run_ranks(train_parallel, 2, cases, str(tmp_path))
    for i, case in enumerate(cases):
        check_equivalence(case, [res[i] for res in per_rank])


@pytest.mark.multiprocess
@pytest.mark.parametrize("nranks", [2, 4])
def test_expert_parallel_trains_like_one_process(nranks, tmp_path):
    """Experts split over every device of a unit, the layers around them split by batch or
    tensor-parallel (and with 4 ranks also over 2, in 2 data-parallel
    units, also under ZeRO-2 and ZeRO-3), both routings; the dropless one also in a two-stage
    pipeline whose stages are each expert-parallel over 2 devices."""
    cases = [Case(model, "tp", nranks, nranks, config=expert_parallel(nranks)) for model in MODELS]
    cases += [Case(model, "tp", nranks, nranks, config=expert_parallel(nranks, around="tp")) for model in MODELS]
    if nranks == 4:
        cases += [Case(model, "tp", 2, 4, config=expert_parallel(2), optimizer="adamw") for model in MODELS]
        cases += [Case("moe_e2e", "hybrid", 4, 4, config=pipeline("1f1b", 2, 2) + expert_parallel(2))]
        cases += [Case("moe", "tp", 2, 4, config=expert_parallel(2) + zero(stage=3), optimizer="adamw"),
                  Case("moe_capacity", "tp", 2, 4, config=expert_parallel(2) + zero(stage=2), optimizer="adamw")]
    per_rank = run_ranks(train_parallel, nranks, cases, str(tmp_path))
    for i, case in enumerate(cases):
        check_equivalence(case, [res[i] for res in per_rank])


@pytest.mark.multiprocess
@pytest.mark.parametrize("nranks", [2, 4])
def test_hugging_face_experts_split_like_nbscalers_train_like_one_process(nranks, tmp_path):
    """Mixtral's and Qwen3-MoE's own expert modules (recorded as ``dropless_experts``,
    ``nbscaler.experts.huggingface``) expert-parallel over every device, the layers around them split
    by batch or tensor-parallel, and tensor-parallel inside; with 4 ranks also expert-parallel over 2
    in 2 data-parallel units under ZeRO-3, and over 2 expert groups of 2 (each group's experts cut by
    hidden unit: the fused ``gate_up_proj`` strided)."""
    cases = [Case(model, "tp", nranks, nranks, config=expert_parallel(nranks)) for model in HF_MODELS]
    cases += [Case("hf_mixtral", "tp", nranks, nranks, config=expert_parallel(nranks, around="tp")),
              Case("hf_qwen3_moe", "tp", nranks, nranks)]
    if nranks == 4:
        cases += [Case("hf_qwen3_moe", "tp", 2, 4, config=expert_parallel(2) + zero(stage=3), optimizer="adamw")]
        cases += [Case(model, "tp", 4, 4, config=expert_parallel(2, around, hidden=2))
                  for model, around in zip(HF_MODELS, ("data", "tp"))]
    per_rank = run_ranks(train_parallel, nranks, cases, str(tmp_path))
    for i, case in enumerate(cases):
        check_equivalence(case, [res[i] for res in per_rank])


@pytest.mark.multiprocess
def test_expert_parallel_with_experts_cut_by_hidden_unit_trains_like_one_process(tmp_path):
    """4 devices as 2 expert groups of 2 (``expert_tensor_parallel``): each group holds half the
    experts, each device half of their hidden units; both routings, the layers around the experts
    split by batch or tensor-parallel, with AdamW."""
    cases = [Case(model, "tp", 4, 4, config=expert_parallel(2, around, hidden=2), optimizer="adamw")
             for model in MODELS for around in ("data", "tp")]
    per_rank = run_ranks(train_parallel, 4, cases, str(tmp_path))
    for i, case in enumerate(cases):
        check_equivalence(case, [res[i] for res in per_rank])


@pytest.mark.multiprocess
def test_expert_groups_in_pipeline_stages_and_zero_units_train_like_one_process(tmp_path):
    """8 ranks: a two-stage 1F1B pipeline whose stages are each 2 expert groups of 2, and two
    data-parallel units of 2 expert groups of 2 under ZeRO-3 (each rank half of its slice's state)."""
    cases = [Case("moe_e2e", "hybrid", 8, 8, config=pipeline("1f1b", 2, 2) + expert_parallel(2, hidden=2)),
             Case("moe", "tp", 4, 8, config=expert_parallel(2, hidden=2) + zero(stage=3), optimizer="adamw")]
    per_rank = run_ranks(train_parallel, 8, cases, str(tmp_path))
    for i, case in enumerate(cases):
        check_equivalence(case, [res[i] for res in per_rank])


@pytest.mark.multiprocess
@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_sliding_window_attention_trains_like_one_process(nranks, tmp_path):
    """GPT-OSS's attention (every other layer over a sliding window, ``sliding_window_attention``)
    around experts: split by batch, by heads, and with the experts split over every device; with 4
    ranks also in a two-stage pipeline whose stages are each expert-parallel over 2."""
    cases = [Case("moe_window", "dp", 1, nranks), Case("moe_window", "tp", nranks, nranks)]
    if nranks > 1:
        cases += [Case("moe_window", "tp", nranks, nranks, config=expert_parallel(nranks, around="tp"))]
    if nranks == 4:
        cases += [Case("moe_window_e2e", "hybrid", 4, 4, config=pipeline("1f1b", 2, 2) + expert_parallel(2))]
    per_rank = run_ranks(train_parallel, nranks, cases, str(tmp_path))
    for i, case in enumerate(cases):
        check_equivalence(case, [res[i] for res in per_rank])
