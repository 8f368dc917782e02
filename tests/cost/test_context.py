"""The cost model replays a context-parallel rank as its generated code runs: a mirrored slice of
the sequence (chunks i and 2n-1-i) is a new tensor, not a view of the whole one, and the loss is
``split_cross_entropy`` called with the arguments the generated code passes. The ranks' measured
memory, equal to these predictions to the byte, is notebook 19's."""

import warnings

import pytest
import torch

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.blocks import MIRRORED
from nbscaler.cost.local import _collective
from nbscaler.layouts import Collective
from nbscaler.models.llama import Llama, LlamaConfig, sample_batch


def test_a_mirrored_slice_is_a_new_tensor_and_a_plain_one_a_view():
    whole = torch.ones(16, 8, dtype=torch.bool)
    mirrored = _collective(Collective.CHUNK, whole, 0, None, 4, 1, MIRRORED)
    plain = _collective(Collective.CHUNK, whole, 0, None, 4, 1)
    assert mirrored.shape == plain.shape == (4, 8)
    assert mirrored.untyped_storage().nbytes() == 32                     # rows 2:4 and 12:14, joined
    assert plain.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()


def test_a_context_parallel_plan_replays_every_op_and_counts_its_own_mask_slice():
    cfg = LlamaConfig(vocab_size=64, seq_len=64, n_layer=1, d_model=32, n_head=2, n_kv_head=1)
    batch = sample_batch(cfg, 1)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # a call the replay cannot make warns
        plans = {n: nbscaler.plan(Llama(cfg), batch, "tp", ComputeConfig(
            n, n, pas_config={"context_parallel": n})) if n > 1 else nbscaler.plan(Llama(cfg), batch, "dp",
                                                                                    ComputeConfig(1, 1))
                 for n in (1, 4)}
        memory = {n: p.memory().iloc[0] for n, p in plans.items()}
    # the explicit mask the masked_fill saves: (T, T) bools in one process, this rank's (T/4, T) under CP
    one, four = memory[1].activation_bytes, memory[4].activation_bytes
    assert four < one / 2, (one, four)


@pytest.mark.parametrize("kind", ["ring", "all_gather"])
def test_on_a_target_each_device_computes_its_share_of_attention_against_every_key(kind):
    """A ring's attention meets the other devices' keys as they arrive: on a target it is priced
    against the whole sequence, so 4 devices take no less than a quarter of one device's step."""
    import nbscaler
    from nbscaler import ComputeConfig
    from nbscaler.cost.hardware import Hardware
    from nbscaler.models.gpt import GPT, GPTConfig, sample_batch
    hw = Hardware.named("H100-SXM-80GB")
    cfg = GPTConfig(vocab_size=512, seq_len=4096, n_layer=2, d_model=512, n_head=8)
    with torch.device("meta"):
        model = GPT(cfg)
    batch = {"batch": sample_batch(cfg, 1)}
    one = nbscaler.plan(model, batch, "tp", ComputeConfig(1, 1, use_end2end=True)).summary(hardware=hw)
    four = nbscaler.plan(model, batch, "tp", ComputeConfig(plan_ngpus=4, runtime_ngpus=4, use_end2end=True, pas_config={
        "context_parallel": 4, "context_parallel_kind": kind})).summary(hardware=hw)
    ratio = one.step_time_s.max() / four.step_time_s.max()
    assert 2.0 < ratio < 4.0, ratio


def test_a_rings_passes_count_in_the_step_by_the_overlap_rule():
    """The forward's passes hide behind (n-1)/n of the attention's compute; the backward's too, but
    for the last pass, which takes the gradients home: a section's collective seconds hold exactly that."""
    import nbscaler
    from nbscaler import ComputeConfig
    from nbscaler.cost.context_calls import ring_seconds
    from nbscaler.cost.hardware import Hardware
    from nbscaler.ir.layer_rules import context_ring
    from nbscaler.models.gpt import GPT, GPTConfig, sample_batch
    cfg = GPTConfig(vocab_size=512, seq_len=1024, n_layer=2, d_model=256, n_head=4)
    with torch.device("meta"):
        model = GPT(cfg)
    plan = nbscaler.plan(model, {"batch": sample_batch(cfg, 1)}, "tp", ComputeConfig(4, 4, use_end2end=True, pas_config={
        "context_parallel": 4, "context_parallel_kind": "ring"}))
    step = plan.step_model(Hardware.named("H100-SXM-80GB"))
    run = step.runs[0][None]
    rings = [op for op in run.ops if context_ring(op.node)]
    assert len(rings) == 2
    expected_f = expected_b = 0.0
    for op in rings:
        passes_f, passes_b = ring_seconds(op.node, step.comm)
        assert passes_f > 0 and passes_b > passes_f          # the backward passes blocks and gradients
        compute_f, compute_b = step.profiler.time(op)
        expected_f += max(0.0, passes_f - compute_f * 3 / 4)
        expected_b += passes_b / 7 + max(0.0, passes_b * 6 / 7 - compute_b * 3 / 4)
    others_f = sum(step.comm.forward(c.fn, c.in_bytes, len(c.devices), ranks=c.devices) for c in run.collectives)
    # the cuts of the token ids, the targets and the positions have no backward to run (no gradient)
    assert [c.tensor for c in run.collectives if not c.backward] == ["batch_idx", "constructor_0", "batch_targets"]
    others_b = sum(step.comm.backward(c.fn, c.in_bytes, len(c.devices), ranks=c.devices)
                   for c in run.collectives if c.backward)
    fwd, bwd = step.collective_times[0][None]
    assert fwd == pytest.approx(others_f + expected_f) and bwd == pytest.approx(others_b + expected_b)
    assert expected_b > 0
