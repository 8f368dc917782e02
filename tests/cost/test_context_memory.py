"""The cost model replays a context-parallel rank as its generated code runs: a mirrored slice of
the sequence (chunks i and 2n-1-i) is a new tensor, not a view of the whole one, and the loss is
``context_cross_entropy`` called with the arguments the generated code passes. The ranks' measured
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
