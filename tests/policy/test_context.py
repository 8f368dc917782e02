"""Context parallelism's placement and its refusals: every op on a slice of the sequence, attention
split by its queries, the loss by its tokens, and a clear error, naming the fix, for each config
it cannot run."""

import pytest

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.blocks import MIRRORED
from nbscaler.ir.layer_rules import context_parallel
from nbscaler.policy.primitives import PolicyError
from tests.models import batch, build


def _plan(model, n, kind="all_gather", policy="tp", **pas):
    cfg = ComputeConfig(plan_ngpus=n, runtime_ngpus=n,
                        pas_config={"context_parallel": n, "context_parallel_kind": kind, **pas})
    return nbscaler.plan(build(model), batch(model, 0), policy, cfg)


@pytest.mark.parametrize("model", ["gpt", "llama", pytest.param("hf_llama", marks=pytest.mark.slow)])
def test_every_op_that_reads_the_sequence_runs_on_its_mirrored_slice(model):
    plan = _plan(model, 2)
    placed = [n for n in plan.graph.nodes if n.placement.split is not None]
    assert placed and all(n.placement.blocks == MIRRORED for n in placed)
    linears = plan.graph.select(op="linear")
    assert linears and all(n.placement.parts == 2 for n in linears)          # on this device's tokens
    sdpa = plan.graph.select(op="attention")
    assert all(context_parallel(n) == "attention" for n in sdpa)


def test_generated_code_says_which_chunks_a_device_holds_and_passes_keys_round_a_ring():
    plan = _plan("gpt", 2, "ring")             # 8 tokens: 4 chunks of 2, rank 1 holds chunks 1 and 2
    code = plan.sources[1]
    assert "queries are positions 2:4 and 4:6 of 8 (chunks 1 and 2 of 4)" in code
    assert "context_attention(" in code and "kind='ring', blocks='mirrored'" in code
    assert "comm.all_gather_sum_grad" not in code                  # the keys never arrive whole
    assert "comm.chunk(batch_idx, dim=1, blocks='mirrored'" in code       # the tokens, cut as they arrive
    gathered = _plan("gpt", 2, "all_gather").sources[1]
    assert gathered.count("comm.all_gather_sum_grad(") == 2 * 4      # keys and values of 4 layers


def test_the_loss_is_each_devices_part_of_the_mean_when_the_batch_is_one_sequence():
    from tests.models import Llama
    import torch
    model = Llama()
    tokens = torch.randint(0, 64, (1, 17))
    plan = nbscaler.plan(model, {"idx": tokens[:, :-1], "targets": tokens[:, 1:]}, "tp",
                         ComputeConfig(plan_ngpus=2, runtime_ngpus=2, pas_config={"context_parallel": 2}))
    loss = plan.graph.select(op="loss")[0]
    assert context_parallel(loss) == "loss"
    assert "split_cross_entropy(" in plan.sources[0]
    assert "whole sequence" not in plan.explain()


def test_a_batch_merged_into_the_sequence_runs_whole_and_the_plan_says_so():
    plan = _plan("gpt", 2)                     # (2, 8, V) logits viewed as (16, V): batch and sequence merged
    assert "whole sequence" in str(plan.explain())


@pytest.mark.parametrize("pas, message", [
    ({"context_parallel": 3}, "8 tokens: trace with a sequence that is a multiple of 6"),
    ({"context_parallel": 2, "context_parallel_kind": "ring"}, "cannot pass its keys round a ring"),
    ({"context_parallel": 2, "context_parallel_kind": "spiral"}, "give 'all_gather' or 'ring'"),
    ({"context_parallel": 2, "sequence_parallel": True}, "drop 'sequence_parallel'"),
    ({"context_parallel": 0}, "an int >= 1"),
])
def test_configs_it_cannot_run_are_refused_naming_the_fix(pas, message):
    n = pas["context_parallel"] if pas["context_parallel"] > 1 else 2
    cfg = ComputeConfig(plan_ngpus=n, runtime_ngpus=n, pas_config=pas)
    with pytest.raises((PolicyError, ValueError), match=message.replace("(", r"\(").replace("'", "'")):
        nbscaler.plan(build("llama"), batch("llama", 0), "tp", cfg)


@pytest.mark.parametrize("kind", ["all_gather", "ring"])
def test_a_sliding_window_is_refused_naming_what_splits_it_instead(kind):
    with pytest.raises(PolicyError, match="window of 3 keys.*split its batch or heads instead"):
        _plan("moe_window", 2, kind)


def test_tensor_parallelism_runs_inside_each_context_parallel_group():
    """Four devices as two context-parallel groups of two tensor-parallel neighbours: every op on
    its group's mirrored chunks, split Megatron's way inside the group; each collective on one axis."""
    cfg = ComputeConfig(plan_ngpus=4, runtime_ngpus=4, pas_config={"context_parallel": 2})
    plan = nbscaler.plan(build("llama"), batch("llama", 0), "tp", cfg)
    (q,) = [n for n in plan.graph.select(op="linear") if n.module_path.endswith("blocks.0.attn.q")]
    assert (q.placement.blocks, q.placement.inner) == (MIRRORED, ("n", 2, 1))      # tokens across, columns inside
    code = plan.sources[3]                      # device 3: second in the tensor group (2, 3), in the sequence group (1, 3)
    assert "comm.all_reduce(linear_3, group=g2_3)" in code                     # row-parallel output, inside the group
    assert "comm.all_gather_sum_grad(transpose_3, dim=3, blocks='mirrored', group=g1_3)" in code   # keys, across
    assert "comm.chunk(getitem_0, dim=0, blocks='mirrored', group=g1_3)" in code                 # rotary rows
    assert ("'blocks.0.attn.q.weight', 'param', (32, 32), torch.float32, devices=(0, 1, 2, 3), split_dim=0, "
            "parts=2, index=1, partial_grads=True, partial_devices=(1, 3)") in code
    ring = nbscaler.plan(build("gpt"), batch("gpt", 0), "tp",
                         ComputeConfig(plan_ngpus=4, runtime_ngpus=4, pas_config={
                             "context_parallel": 2, "context_parallel_kind": "ring"})).sources[3]
    assert ("# tensor parallel inside: devices [2, 3] split this attention's heads between them, each with its own "
            "context-parallel group (this device's: [1, 3])") in ring
    assert "1: device 1's chunks" in ring and "group=g1_3)" in ring


def test_context_parallel_groups_must_divide_the_stage():
    cfg = ComputeConfig(plan_ngpus=4, runtime_ngpus=4, pas_config={"context_parallel": 3})
    with pytest.raises(PolicyError, match="do not divide into 3 groups"):
        nbscaler.plan(build("gpt"), batch("gpt", 0), "tp", cfg)


@pytest.mark.parametrize("policy", ["dp", "data", "pp"])
def test_a_policy_that_does_not_split_the_sequence_refuses_the_key(policy):
    cfg = ComputeConfig(plan_ngpus=1, runtime_ngpus=2, pas_config={"context_parallel": 2})
    with pytest.raises(ValueError, match=f"'context_parallel'.*policy '{policy}' does not read"):
        nbscaler.plan(build("gpt"), batch("gpt", 0), policy, cfg)


def test_the_ring_is_priced_as_the_bytes_it_passes():
    """Keys and values of ``T`` bytes over ``n`` devices: each device passes its block on ``n-1``
    times in the forward, ``(n-1)/n T``; the backward passes the blocks and their gradients, home
    after ``n`` steps, ``(2n-1)/n T``. Gathered keys cost the same forward and a reduce-scatter back."""
    for n in (2, 4):
        ring = _plan("gpt", n, "ring").collectives
        passes = ring[ring.collective == "ring_pass"]
        keys = passes.tensor_bytes
        assert len(passes) == 2 * 4 * 2                               # keys and values, 4 layers, F and B
        forward, backward = passes[passes.phase == "F"], passes[passes.phase == "B"]
        assert (forward.bytes_per_device == (keys[forward.index] * (n - 1) / n).round()).all()
        assert (backward.bytes_per_device == (keys[backward.index] * (2 * n - 1) / n).round()).all()
        gathered = _plan("gpt", n).collectives
        assert (gathered.collective == "all_gather_sum_grad").sum() == 2 * 4
        assert gathered[gathered.collective == "all_gather_sum_grad"].bytes_per_device.sum() == forward.bytes_per_device.sum()


def test_an_empty_kv_cache_passes_the_keys_through_without_gathering_them():
    """transformers' Llama joins its keys to an empty cache (``torch.cat([empty, k], dim=-2)``):
    the join passes the split keys through, so a ring never sees them gathered."""
    code = _plan("hf_llama", 2, "ring").sources[1]
    assert code.count("comm.all_gather(") == 1          # only the logits, for a loss over a merged batch
    assert "context_attention(" in code


def test_a_rings_code_lists_whose_block_each_step_computes_against():
    code = _plan("gpt", 4, "ring").sources[1]          # 8 tokens, 8 chunks: rank 1 holds 1 and 6
    assert ("ring steps, each computing against the block in hand while passing it on: 0: its own chunks 1 and 6; "
            "1: device 0's chunks 0 and 7; 2: device 3's chunks 3 and 4; 3: device 2's chunks 2 and 5") in code


def test_a_learned_position_embedding_looks_up_only_this_devices_positions():
    """``self.pos(torch.arange(T))``: the positions are sliced before the lookup, so the backward
    gathers nothing and the embedding's weight gradient is summed with the others'."""
    plan = _plan("gpt", 2, "ring")
    (pos,) = [n for n in plan.graph.select(op="embedding") if n.inputs[0].ndim == 1]
    assert pos.placement.parts == 2 and pos.placement.blocks == MIRRORED
    code = plan.sources[0]
    assert 'embedding_1: "f32[4, 32]" = F.embedding(constructor_0_split0xmirrored, self.gpt_pos_weight)' in code
    assert "'gpt.pos.weight', 'param', (8, 32), torch.float32, devices=(0, 1), partial_grads=True" in code
