"""FLOP counts of ops (``nbscaler.cost.flops``), on real models."""

import math

import torch

import pytest

import nbscaler
from nbscaler import ComputeConfig, Hardware
from nbscaler.planning.step import flops_per_device
from tests.models import batch, build, hf


@pytest.mark.slow
@pytest.mark.parametrize("policy, ngpus", [("dp", 1), ("tp", 2)])
def test_an_embedding_lookup_is_a_gather_not_a_product_over_its_table(policy, ngpus):
    """An embedding copies rows: nothing computed forward, and backward a scatter-add of its
    output's gradient into the table (one addition an element), not the product with a one-hot
    matrix its annotation reads as (``2 B T D V``: 4.3 TFLOP forward for one 2048-token sequence of
    Llama-3-70B, as much as its output head, which made it the plan's heaviest op)."""
    p = nbscaler.plan(build("hf_llama"), batch("hf_llama", 0), policy, ComputeConfig(ngpus, ngpus))
    lookup = next(n for n in p.graph.nodes if n.op == "embedding")
    elements = math.prod(lookup.output_tensors[0].shape)                      # B T D
    assert (lookup.meta["flops_fwd"], lookup.meta["flops_bwd"]) == (0.0, elements)
    assert (lookup.meta["local_flops_fwd"], lookup.meta["local_flops_bwd"]) == (0.0, elements / ngpus)
    head = next(n for n in p.graph.nodes if n.module_path.endswith("lm_head"))
    vocab = head.inputs[1].shape[0]
    assert head.meta["flops_fwd"] == 2 * elements * vocab                     # the head is a product
    heaviest = [line for line in p.explain().splitlines() if "heaviest op" in line]
    assert heaviest and not any("embed_tokens" in line for line in heaviest)


def test_model_flops_of_a_step_count_the_lookup_as_its_scatter_add():
    """The summary's ``flops`` (the model FLOPs behind ``mfu``) of one device running all of a real
    model: every op's forward and backward, the lookup adding only its ``B T D`` backward."""
    p = nbscaler.plan(build("hf_llama"), batch("hf_llama", 0), "dp", ComputeConfig(1, 1))
    lookup = next(n for n in p.graph.nodes if n.op == "embedding")
    others = sum(n.meta["flops_fwd"] + n.meta["flops_bwd"] for n in p.graph.nodes if n is not lookup)
    elements = math.prod(lookup.output_tensors[0].shape)
    assert flops_per_device(p) == {0: others + elements}
    summary = p.summary(hardware=Hardware.named("H100-SXM-80GB"))
    assert summary.flops.tolist() == [others + elements]


@pytest.mark.parametrize("model", ["moe", "moe_capacity"])
def test_routed_experts_are_counted_as_their_swiglu_products_and_split_by_expert_parallelism(model):
    """Dropless: three d x h products per (token, expert) pair; capacity: per slot of every expert's
    buffers. Expert parallelism over 2 devices halves each device's share when every expert is
    loaded alike."""
    from nbscaler.cost.flops import node_flops
    whole = nbscaler.plan(build(model), batch(model, 0), "dp", ComputeConfig(1, 1))
    node = next(n for n in whole.graph.nodes if n.target.startswith("nbscaler.experts.routing."))
    x, chosen, w1 = node.inputs[0].shape, node.inputs[2].shape, node.inputs[3].shape
    rows = math.prod(x[:-1]) * chosen[-1] if model == "moe" else w1[0] * x[0] * node.args[6]
    assert node_flops(node) == node.meta["flops_fwd"] == 6 * rows * w1[1] * w1[2]
    assert node.meta["flops_bwd"] == 2 * node.meta["flops_fwd"]           # for the rows and for the weights
    assert node.meta["product"]                                            # at the matmul rate on a target
    split = nbscaler.plan(build(model), batch(model, 0), "tp", ComputeConfig(2, 2, pas_config={"expert_parallel": 2}))
    for ep in (n for n in split.graph.nodes if n.target == node.target):
        assert ep.meta["local_flops_fwd"] == node.meta["flops_fwd"] / 2


def test_hugging_face_experts_grouped_products_count_each_row_once():
    """Hugging Face experts traced call by call (Mixtral's with GELU, which nbscaler does not record as
    its own op): ``torch._grouped_mm`` of the (token, expert) rows sorted by expert ``(m, a)`` by the
    experts' weights ``(E, a, b)`` costs ``2 m a b``, as one product per row."""
    torch.manual_seed(0)
    p = nbscaler.plan(hf.LossOf(hf.mixtral(hidden_act="gelu")), batch("hf_mixtral", 0), "dp", ComputeConfig(1, 1))
    grouped = [n for n in p.graph.nodes if n.target == "torch._grouped_mm"]
    assert len(grouped) == 2 * 2                                           # 2 layers: gate_up, down
    for node in grouped:
        (m, a), b = node.inputs[0].shape, node.inputs[1].shape[-1]
        assert node.meta["flops_fwd"] == 2 * m * a * b
        assert node.meta["product"]
