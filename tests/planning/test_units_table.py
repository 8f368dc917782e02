"""``Plan.units``: ZeRO stage 3's units as a table, and nothing without stage 3."""

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.models.gpt import GPT, GPTConfig, sample_batch
from nbscaler.planning.units_table import UNIT_COLUMNS

MODEL = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=64)


def plan(**zero):
    return nbscaler.plan(GPT(MODEL), {"batch": sample_batch(MODEL, 2)}, "dp", ComputeConfig(1, 4, use_zero=True, **zero))


def test_each_unit_with_its_bytes_whole_and_sharded_and_whether_the_forward_frees_it():
    p = plan(zero_stage=3)
    units = p.units.set_index("unit")
    assert list(p.units.columns) == UNIT_COLUMNS and list(units.index) == ["(rest)", "blocks.0", "blocks.1"]
    block = sum(t.numel() for name, t in GPT(MODEL).named_parameters() if name.startswith("blocks.0."))
    assert units.numel["blocks.0"] == block and units.parameters["blocks.0"] == 12
    assert units.gathered_bytes["blocks.0"] == -(-block // 4) * 4 * 4          # fp32, padded to 4 ranks
    assert (units.shard_bytes * 4 == units.gathered_bytes).all()
    assert units.freed_after_forward.tolist() == [False, True, True]           # the rest runs at both ends
    # what a rank stores of the parameters is its shards (fp32, no master copies)
    assert (p.memory(master_dtype=None)["param_bytes"] == units.shard_bytes.sum()).all()


def test_no_units_without_stage_3():
    assert plan(zero_stage=2).units.empty


def test_the_plan_card_shows_the_units_with_their_bytes():
    card = plan(zero_stage=3)._repr_html_()
    assert "ZeRO-3 units" in card and "blocks.0" in card and "freed_after_forward" in card
    assert "ZeRO-3 units" not in plan(zero_stage=2)._repr_html_()
