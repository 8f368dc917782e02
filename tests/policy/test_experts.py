"""Expert parallelism's placement (``pas_config={"expert_parallel": n}``): the experts' weights
split by expert, everything else by batch, and a clear refusal of what it cannot do."""

import pytest

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.ir.graph import EXPERT_PARALLEL
from nbscaler.policy.primitives import PolicyError
from tests.models import batch, build


def ep_plan(model: str = "moe", n: int = 2, policy: str = "tp", **pas):
    cfg = ComputeConfig(n, n, pas_config={"expert_parallel": n, **pas})
    return nbscaler.plan(build(model), batch(model, 0, n=4 * n if n > 2 else 8), policy, cfg)


@pytest.mark.parametrize("model, axis", [("moe", "n"), ("moe_capacity", "b")])
def test_experts_split_by_expert_and_every_other_op_by_batch(model, axis):
    plan = ep_plan(model)
    experts = [n for n in plan.graph.nodes if n.meta.get(EXPERT_PARALLEL)]
    assert len(experts) == 2 and all(n.placement.split == axis for n in experts)
    weights = {w.name: w for w in plan.programs.device(1).weights}
    w1 = weights["blocks.0.moe.experts.w1"]
    assert w1.shape == (2, 32, 16)                     # 2 of the 4 experts on each device
    heavy = [n for n in plan.graph.nodes if n.op == "linear"]
    assert all(n.placement.split is not None for n in heavy)      # batch-split around the experts
    code = plan.sources[1]
    assert "# expert parallel: this device holds experts 2..3 of 4" in code
    assert f"{'expert_parallel_dropless' if axis == 'n' else 'expert_parallel_capacity'}(" in code


@pytest.mark.parametrize("pas, words", [
    ({"sequence_parallel": True}, "'expert_parallel' and 'sequence_parallel'"),
    ({"context_parallel": 2}, "'expert_parallel' and 'context_parallel'"),
])
def test_expert_parallelism_beside_another_dimension_is_refused_by_name(pas, words):
    with pytest.raises(PolicyError, match=words):
        ep_plan(**pas)


def test_an_expert_parallel_size_other_than_the_stages_devices_names_the_fix():
    cfg = ComputeConfig(4, 4, pas_config={"expert_parallel": 2})
    with pytest.raises(PolicyError, match="expert_parallel=2, but each stage has 4 devices.*set expert_parallel=4, "
                                          "or expert_tensor_parallel=2"):
        nbscaler.plan(build("moe"), batch("moe", 0, n=8), "tp", cfg)


def test_experts_that_do_not_divide_over_the_devices_are_refused():
    with pytest.raises(PolicyError, match="has 4 experts, which do not split over 3 expert groups"):
        ep_plan(n=3)


def test_a_model_without_routed_experts_is_refused():
    with pytest.raises(PolicyError, match="the model calls none"):
        ep_plan("llama")


@pytest.mark.parametrize("value", [0, True, "2"])
def test_a_wrong_value_is_refused(value):
    with pytest.raises(ValueError, match="pas_config\\['expert_parallel'\\]"):
        nbscaler.plan(build("moe"), batch("moe", 0), "tp", ComputeConfig(2, 2, pas_config={"expert_parallel": value}))


@pytest.mark.parametrize("model", ["moe", "moe_capacity"])
def test_tp_without_expert_parallel_splits_each_expert_by_its_hidden_width(model):
    """Tensor parallel for the experts: every device holds every expert, a slice of each one's
    hidden units, and reads the tokens whole (their gradient summed); the experts' sum is partial."""
    plan = nbscaler.plan(build(model), batch(model, 0, n=8), "tp", ComputeConfig(2, 2))
    experts = [n for n in plan.graph.nodes if n.target.endswith("_experts")]
    assert len(experts) == 2 and all(n.placement.split == "h" and not n.meta.get(EXPERT_PARALLEL) for n in experts)
    weights = {w.name: w for w in plan.programs.device(1).weights}
    assert weights["blocks.0.moe.experts.w1"].shape == (4, 32, 8)     # all 4 experts, 8 of 16 hidden units
    assert weights["blocks.0.moe.experts.w2"].shape == (4, 8, 32)
    code = plan.sources[1]
    assert "# tensor parallel inside the experts: this device holds hidden units 8..15 of each expert's 16" in code
    call = next(line for line in code.splitlines() if line.strip().startswith(f"{experts[0].name}:"))
    assert "_sum_grad" in call and "first_only" not in call      # the tokens are factors, read whole
    from nbscaler.planning.expert_tables import expert_rows
    rows = expert_rows(plan)
    held = sum(w.nbytes for w in plan.programs.device(1).weights if ".experts." in w.name)
    assert rows[rows.device == 1].held_bytes.sum() == held              # the plan card counts the width split
    assert rows.layout.str.startswith("every expert split by its hidden width").all()


def test_tensor_parallel_around_the_experts_slices_their_tokens_in_and_gathers_them_back():
    """around_experts='tp': attention Megatron-style over the devices, each device's 1/n of the
    tokens into the experts op (a chunk, no traffic) and the op's output all-gathered back."""
    plan = ep_plan(around_experts="tp")
    linears = [n for n in plan.graph.nodes if n.op == "linear"]
    assert {n.placement.split for n in linears} >= {"n", "k"}           # column- and row-parallel
    experts = [n for n in plan.graph.nodes if n.meta.get(EXPERT_PARALLEL)]
    assert len(experts) == 2 and all(n.placement.split == "n" for n in experts)
    code = plan.sources[0]
    assert "# expert parallel: this device holds experts 0..1 of 4" in code
    name = experts[0].name
    assert f"{name}_full" in code and f"comm.all_gather({name}, dim=0" in code
    with pytest.raises(ValueError, match=r"pas_config\['around_experts'\]='sp' is invalid: give 'data' or 'tp'"):
        ep_plan(around_experts="sp")


def test_tensor_parallel_around_the_experts_plans_in_each_pipeline_stage():
    config = ComputeConfig(4, 4, use_end2end=True, use_pipeline=True, pipeline_nstages=2, pipeline_nmicros=2,
                           pas_config={"expert_parallel": 2, "around_experts": "tp"})
    plan = nbscaler.plan(build("moe_e2e"), batch("moe_e2e", 0, n=8), "hybrid", config)
    experts = [n for n in plan.graph.nodes if n.meta.get(EXPERT_PARALLEL)]
    assert experts and {n.placement.devices for n in experts} == {(0, 1), (2, 3)}


def test_experts_cut_by_expert_and_by_hidden_unit_over_a_grid_of_devices():
    """``expert_tensor_parallel=2`` beside ``expert_parallel=2`` on 4 devices: two expert groups of
    two, each device a quarter of each expert weight, both cuts named in its weight spec and code."""
    plan = ep_plan(n=4, expert_parallel=2, expert_tensor_parallel=2)
    weights = {w.name: w for w in plan.programs.device(3).weights}
    assert weights["blocks.0.moe.experts.w1"].shape == (2, 32, 8)         # experts 2..3, hidden units 8..15
    assert weights["blocks.0.moe.experts.w2"].shape == (2, 8, 32)
    assert str(weights["blocks.0.moe.experts.w1"].layout) == "S(0)xS(2)"
    code = plan.sources[3]
    assert "split_dim=0, parts=4, index=3, inner_dim=2, inner_parts=2" in code
    assert "holds hidden units 8..15 of 16 of experts 2..3 of 4" in code
    assert "group=g0_1_2_3, hidden_parts=2)" in code


@pytest.mark.parametrize("pas, words", [
    ({"expert_parallel": 1, "expert_tensor_parallel": 2}, "'expert_parallel' is not set"),
    ({"expert_parallel": 2, "expert_tensor_parallel": 3}, "expert_parallel=2 x expert_tensor_parallel=3 = 6, but each "
                                                          "stage has 4 devices"),
    ({"expert_parallel": 2, "expert_tensor_parallel": 0}, "pas_config\\['expert_tensor_parallel'\\]=0 is invalid"),
])
def test_a_wrong_expert_grid_names_the_fix(pas, words):
    with pytest.raises((PolicyError, ValueError), match=words):
        nbscaler.plan(build("moe"), batch("moe", 0, n=16), "tp", ComputeConfig(4, 4, pas_config=pas))


def test_hidden_units_that_do_not_cut_are_refused():
    with pytest.raises(PolicyError, match="16 hidden units, which do not cut into expert_tensor_parallel=3"):
        nbscaler.plan(build("moe"), batch("moe", 0, n=12), "tp",
                      ComputeConfig(6, 6, pas_config={"expert_parallel": 2, "expert_tensor_parallel": 3}))


def test_hugging_face_experts_cut_two_ways_store_a_quarter_each():
    """Mixtral's fused ``gate_up_proj`` and its ``down_proj`` reach the op through a chunk and
    transposes: the views pass both cuts to the parameters, so each device stores 2 of 4 experts'
    half of the hidden units (the gate's and the up rows' halves, strided) and nothing else."""
    plan = nbscaler.plan(build("hf_mixtral"), batch("hf_mixtral", 0), "tp",
                         ComputeConfig(4, 4, pas_config={"expert_parallel": 2, "expert_tensor_parallel": 2}))
    weights = {w.name.rsplit(".", 1)[-1]: w for w in plan.programs.device(1).weights if ".experts." in w.name}
    assert weights["gate_up_proj"].shape == (2, 64, 32) and str(weights["gate_up_proj"].layout) == "S(0)xS(1, 2 blocks)"
    assert weights["down_proj"].shape == (2, 32, 32) and str(weights["down_proj"].layout) == "S(0)xS(2)"
    assert ".chunk(2, dim=1)    # f32[2, 32, 32], f32[2, 32, 32]" in plan.sources[1]
