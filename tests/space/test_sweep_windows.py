"""A sweep prices a model whose every layer attends over a sliding window as the full plan does, and
refuses, naming the layer, one whose layers do not all attend alike (GPT-OSS's alternating window):
it reads every layer after the first off the second."""

import pytest
import torch

import nbscaler
from nbscaler.models.llama import Llama, LlamaConfig
from tests.space.test_sweep import TARGET, full_plan_figures

SEQ = 2048          # long enough for attention's arithmetic to outweigh its bytes and kernel floors


def _llama(**window) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=256, seq_len=SEQ, n_layer=4, d_model=64, n_head=4, n_kv_head=2, sdpa=True,
                             **window))


def _tokens(batch: int = 1):
    ids = torch.zeros(batch, SEQ, dtype=torch.long)
    return {"idx": ids, "targets": ids.clone()}


def _sweep(model):
    return nbscaler.sweep(model, _tokens(), TARGET, global_batch=8, tp=(1, 2), pp=(1, 2), micro_batch=(2,),
                          recompute=("none",), zero_stage=(0,), sequence_parallel=(False,), progress=False)


def test_a_window_on_every_layer_is_priced_as_the_full_plan_prices_it():
    windowed = _llama(sliding_window=64)
    frame = _sweep(windowed)
    assert (frame.step_time_s.values < _sweep(_llama()).step_time_s.values).all()      # fewer pairs each
    row = frame.iloc[0]
    whole = full_plan_figures(windowed, _tokens(int(row.micro_batch)), row, frame.attrs["stack"])
    for column, value in whole.items():
        assert row[column] == pytest.approx(value, rel=1e-9), column


def test_layers_that_do_not_attend_alike_are_refused_naming_the_layer_and_the_way_out():
    with pytest.raises(ValueError, match=r"blocks\.1\.attn\.window is None where blocks\.2\.attn\.window is 64.*"
                                         r"plan it with nbscaler\.plan"):
        _sweep(_llama(sliding_window=64, window_layers="alternate"))
