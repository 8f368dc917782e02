"""ZeRO stage 3's units in a rank's program: which parameters gather together, where each unit is
gathered and freed, and what passes through the hook that gathers it again for the backward."""

import pytest

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.comm.program import Reshard, Unshard
from nbscaler.comm.unit_gathers import read_by
from nbscaler.ir.graph import REST_UNIT, SHARD_UNITS
from nbscaler.policy.primitives import PolicyError
from nbscaler.models.gpt import GPT, GPTConfig, sample_batch

MODEL = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=64)


def gpt_plan(stage=3, **zero):
    return nbscaler.plan(GPT(MODEL), {"batch": sample_batch(MODEL, 2)}, "dp",
                         ComputeConfig(1, 2, use_zero=True, zero_stage=stage, **zero))


def marks(section):
    return [(type(i).__name__, i.unit) for i in section.instructions if isinstance(i, (Unshard, Reshard))]


def test_each_layer_is_a_unit_gathered_before_it_and_freed_after_it():
    plan = gpt_plan()
    units = plan.graph.meta[SHARD_UNITS]
    assert units["blocks.0.attn.qkv.weight"] == "blocks.0" and units["head.weight"] == REST_UNIT
    section = plan.programs[0].sections[0]
    # the rest runs at both ends of the forward: gathered once and kept; each layer freed after it
    assert marks(section) == [("Unshard", REST_UNIT), ("Unshard", "blocks.0"), ("Reshard", "blocks.0"),
                              ("Unshard", "blocks.1"), ("Reshard", "blocks.1")]
    first = next(i for i in section.instructions if isinstance(i, Unshard))
    assert first.prefetch == "blocks.0"
    assert set(plan.programs[0].units) == {REST_UNIT, "blocks.0", "blocks.1"}


def test_a_freed_unit_passes_on_exactly_what_later_code_reads():
    section = gpt_plan().programs[0].sections[0]
    body = section.instructions
    at = next(k for k, i in enumerate(body) if isinstance(i, Reshard))
    later = {id(v) for ins in body[at + 1:] for v in read_by(ins)}
    # the residual stream after attention and the MLP's output: both read by the block's last add
    assert [v.tensor.name for v in body[at].outputs] == ["add_1", "linear_3"]
    assert all(id(v) in later for v in body[at].outputs)


def test_kept_units_and_named_units():
    kept = gpt_plan(zero_reshard_after_forward=False).programs[0].sections[0]
    assert [m for m in marks(kept) if m[0] == "Reshard"] == []
    mlps = gpt_plan(zero_units=("MLP",))
    units = set(mlps.graph.meta[SHARD_UNITS].values())
    assert units == {REST_UNIT, "blocks.0.mlp", "blocks.1.mlp"}
    # the attention sits between the MLPs and belongs to the rest: the rest is kept, each MLP freed
    assert ("Reshard", "blocks.0.mlp") in marks(mlps.programs[0].sections[0])
    with pytest.raises(PolicyError, match=r"zero_units names \['Nope'\].*The model has: "):
        gpt_plan(zero_units=("Nope",))


def test_no_units_without_stage_3():
    plan = gpt_plan(stage=2)
    assert SHARD_UNITS not in plan.graph.meta and plan.programs[0].units == {}
    assert marks(plan.programs[0].sections[0]) == []
