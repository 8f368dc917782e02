"""What ``tp`` splits on real models: Megatron's layout, fused qkv projections split by heads, and
almost every matmul-like op split (the rest of the model stays replicated on purpose)."""

import pytest

from nbscaler import ComputeConfig
from nbscaler.planning.planner import plan
from tests.models import batch, build

MATMUL_LIKE = {"linear", "matmul", "addmm", "baddbmm", "attention", "conv", "routing", "dropless_experts",
               "capacity_experts"}


def tp_plan(model: str, ngpus: int = 2):
    return plan(build(model), batch(model, 0), "tp", ComputeConfig(plan_ngpus=ngpus, runtime_ngpus=ngpus))


def split_fraction(graph) -> float:
    """The share of matmul-like ops (linear, matmul, bmm, addmm, baddbmm, attention, convolutions,
    routed-experts ops, grouped expert matmuls) split."""
    heavy = [n for n in graph.nodes if n.op in MATMUL_LIKE and (n.op != "routing" or "mm" in n.target)]
    return sum(1 for n in heavy if n.placement.split is not None) / len(heavy)


# The transformers models in make test: their traces are checked in the loop (tests/trace), and the
# fused-projection test below splits the GPT-2's.
@pytest.mark.parametrize("model", ["gpt", pytest.param("hf_gpt2", marks=pytest.mark.slow),
                                   pytest.param("hf_llama", marks=pytest.mark.slow), "llama", "vit", "mobilenet",
                                   pytest.param("hf_mixtral", marks=pytest.mark.slow), "moe"])
def test_tp_splits_nine_tenths_of_the_matmuls(model):
    assert split_fraction(tp_plan(model).graph) >= 0.9


@pytest.mark.parametrize("model, fused", [("gpt", "gpt.blocks.0.attn.qkv"), ("hf_gpt2", "model.transformer.h.0.attn.c_attn"),
                                          ("vit", "net.blocks.0.attn.qkv")])
def test_a_fused_qkv_projection_is_split_by_heads(model, fused):
    """Each device holds its own heads of q, k and v (the weight rows strided in 3 blocks), so
    attention runs on local heads and only the output projection's partial sums are reduced."""
    p = tp_plan(model)
    qkv = [n for n in p.graph.nodes if n.module_path == fused and n.op in ("linear", "addmm")][0]
    assert qkv.placement.blocks == 3 and qkv.placement.split == "n"
    attention = p.graph.select(op="attention")
    assert attention and all(n.placement.split == "h" for n in attention)
    code = p.sources[1]
    assert "blocks=3" in code                                    # the weight spec says how it is cut
    forward = code.split("def _forward")[1]
    first_projection = min(forward.index(call) for call in ("linear(", "addmm(") if call in forward)
    assert "all_gather" not in forward[first_projection:forward.index("scaled_dot_product_attention")]


def test_a_fused_grouped_query_projection_is_split_by_heads_in_unequal_blocks():
    """q, k, v = qkv(x).split([C, C_kv, C_kv]) with twice as many query heads as key/value heads:
    the weight rows are cut strided in blocks 2:1:1, and attention runs on local heads."""
    p = tp_plan("fused_gqa")
    qkv = [n for n in p.graph.nodes if n.module_path == "qkv"][0]
    assert qkv.placement.split == "n" and qkv.placement.blocks == (2, 1, 1)
    assert all(n.placement.split == "h" for n in p.graph.select(op="attention"))
    forward = p.sources[1].split("def _forward")[1]
    assert "blocks=(2, 1, 1)" in p.sources[1]
    assert "split([16, 8, 8]" in forward                     # each device cuts its share of each block
    assert "all_gather" not in forward[:forward.index("scaled_dot_product_attention")]
