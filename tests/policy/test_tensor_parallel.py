"""What ``tp`` splits on real models: Megatron's layout, fused qkv projections split by heads, and
almost every matmul-like op split (the rest of the model stays replicated on purpose)."""

import pytest

from nbscaler import ComputeConfig
from nbscaler.planning.planner import plan
from tests.models import batch, build

MATMUL_LIKE = {"linear", "matmul", "addmm", "baddbmm", "attention", "routing"}


def tp_plan(model: str, ngpus: int = 2):
    return plan(build(model), batch(model, 0), "tp", ComputeConfig(plan_ngpus=ngpus, runtime_ngpus=ngpus))


def split_fraction(graph) -> float:
    """The share of matmul-like ops (linear, matmul, addmm, attention, grouped expert matmuls) split."""
    heavy = [n for n in graph.nodes if n.op in MATMUL_LIKE and (n.op != "routing" or "mm" in n.target)]
    return sum(1 for n in heavy if n.placement.split is not None) / len(heavy)


@pytest.mark.parametrize("model", ["gpt", "hf_gpt2", "hf_llama"])
def test_tp_splits_nine_tenths_of_the_matmuls(model):
    assert split_fraction(tp_plan(model).graph) >= 0.9


@pytest.mark.parametrize("model, fused", [("gpt", "gpt.blocks.0.attn.qkv"), ("hf_gpt2", "model.transformer.h.0.attn.c_attn")])
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
    assert "all_gather" not in code.split("def _forward")[1].split("scaled_dot_product_attention")[0]
