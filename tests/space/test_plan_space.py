"""PlanSpace: a knob change re-prices the sweep from what it kept, and prices it as a fresh sweep would."""

import dataclasses

import pandas as pd
import pytest
import torch

import nbscaler
from nbscaler import Hardware
from nbscaler.models.gpt import GPT, GPTConfig
from nbscaler.space.plan_space import PlanSpace

SEQ = 32
CFG = GPTConfig(vocab_size=256, seq_len=2 * SEQ, n_layer=4, d_model=64, n_head=4)
RANGES = dict(tp=(1, 2), pp=(1, 2), micro_batch=(1, 2), zero_stage=(1,))


def tokens(seq: int = SEQ):
    idx = torch.zeros(1, seq, dtype=torch.long)
    return {"batch": {"idx": idx, "targets": idx.clone()}}


def fresh(hardware: Hardware, seq: int = SEQ, **kw) -> pd.DataFrame:
    kw = {"global_batch": 8, **kw}
    return nbscaler.sweep(GPT(CFG), tokens(seq), hardware, **RANGES, progress=False, **kw)


def a100_space() -> PlanSpace:
    return PlanSpace(GPT(CFG), tokens(), Hardware.named("A100-SXM-40GB"), global_batch=8, **RANGES)


@pytest.fixture
def space():
    return a100_space()


@pytest.fixture(scope="module")
def kept_space():
    """One space for the tests that only try knobs it must refuse, each leaving it as it was."""
    return a100_space()


@pytest.mark.slow
def test_the_space_is_the_sweep(space):
    pd.testing.assert_frame_equal(space.frame, fresh(Hardware.named("A100-SXM-40GB")))


@pytest.mark.slow
def test_a_target_batch_or_master_dtype_change_reprices_without_tracing(space):
    traces = space.traces
    frame = space.set(hardware="H100-SXM-80GB", nodes=2, gpus_per_node=2, global_batch=16, master_dtype=torch.bfloat16)
    assert space.traces == traces
    target = dataclasses.replace(Hardware.named("H100-SXM-80GB", nodes=2), gpus_per_node=2)
    pd.testing.assert_frame_equal(frame, fresh(target, global_batch=16, master_dtype=torch.bfloat16))
    assert space.last_price_s > 0
    frame = space.set(hardware="A100-SXM-80GB", gpus_per_node=2)     # the same configurations: peaks kept
    target = dataclasses.replace(Hardware.named("A100-SXM-80GB", nodes=2), gpus_per_node=2)
    pd.testing.assert_frame_equal(frame, fresh(target, global_batch=16, master_dtype=torch.bfloat16))


@pytest.mark.slow       # seconds on its own: make test runs it, the edit-test loop does not
def test_a_repriced_frame_is_a_fresh_sweeps_bit_for_bit():
    """What the space keeps across knobs (schedules, simulated pipelines shared by the ZeRO stages,
    bucket bytes, peaks, the spans replayed) changes no figure: after turning knobs away and back,
    and onto a target it has not priced, each frame is a fresh sweep's, to the last bit."""
    a100, h100 = Hardware.named("A100-SXM-40GB"), Hardware.named("H100-SXM-80GB")
    ranges = {**RANGES, "zero_stage": (0, 1, 2)}
    space = PlanSpace(GPT(CFG), tokens(), a100, global_batch=8, **ranges)
    first = space.frame
    space.set(hardware=h100, global_batch=16, master_dtype=torch.bfloat16)
    pd.testing.assert_frame_equal(space.set(hardware=a100, global_batch=8, master_dtype=torch.float32), first,
                                  check_exact=True)
    for hardware, batch in ((h100, 16), (dataclasses.replace(h100, nodes=2, gpus_per_node=4), 8)):
        frame = space.set(hardware=hardware, global_batch=batch)
        sweep = nbscaler.sweep(GPT(CFG), tokens(), hardware, global_batch=batch, progress=False, **ranges)
        pd.testing.assert_frame_equal(frame, sweep, check_exact=True)


@pytest.mark.slow       # a second or so: make test runs it, the edit-test loop does not
def test_a_sequence_change_traces_again_and_turning_it_back_does_not(space):
    before, traces = space.frame, space.traces
    frame = space.set(sequence=2 * SEQ)
    assert space.traces == traces + 2                        # one trace per micro-batch size
    pd.testing.assert_frame_equal(frame, fresh(Hardware.named("A100-SXM-40GB"), seq=2 * SEQ))
    assert (frame.tokens_per_s != before.tokens_per_s).any()
    pd.testing.assert_frame_equal(space.set(sequence=SEQ), before)
    assert space.traces == traces + 2


@pytest.mark.parametrize("knobs, message", [
    ({"hardware": "B300"}, "no hardware named 'B300'"),
    ({"nodes": 0}, "nodes=0"),
    ({"global_batch": 0}, "global_batch=0"),
    ({"sequence": -4}, "sequence=-4"),
    ({"module_dtype": "bf16"}, "module_dtype='bf16'"),
    ({"hardware": "T4", "module_dtype": torch.bfloat16}, "no bfloat16 peak"),
    ({"stages": 2}, "no knob stages"),
])
def test_a_bad_knob_says_which_and_leaves_the_space_as_it_was(kept_space, knobs, message):
    before, hardware = kept_space.frame, kept_space.hardware
    with pytest.raises(ValueError, match=message):
        kept_space.set(**knobs)
    assert kept_space.frame is before and kept_space.hardware is hardware and kept_space.sequence == SEQ
