"""The memory model against exact measured counts (``nbscaler.runtime.memory``).

On the CPU both sides are deterministic, so every category must match to the byte: parameters,
gradients, optimizer state (by optimizer, without ZeRO and with ZeRO stages 1 and 2), buffers and the activations
saved for the backward (per pipeline schedule, over the micro-batches in flight).
"""

import pytest
import torch

from nbscaler.columns import MEMORY_COLUMNS
from nbscaler.cost.memory import in_flight_peak, optimizer_state_bytes
from nbscaler.schedule import PipelineGeometry, build_schedule
from tests.multiprocess import Case, measure_memory, pipeline, predicted_memory, recompute, run_ranks, zero


@pytest.mark.parametrize("optimizer, kwargs, expected", [
    (torch.optim.SGD, {"lr": 0.1}, 0),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, 10 * 4),
    (torch.optim.Adam, {}, 2 * 10 * 4 + 4),
    (torch.optim.AdamW, {"amsgrad": True}, 3 * 10 * 4 + 4),
])
def test_optimizer_state_is_learnt_per_class(optimizer, kwargs, expected):
    assert optimizer_state_bytes(optimizer, kwargs, 10, torch.float32) == expected


def test_in_flight_activations_follow_the_schedule():
    saved = {0: 100, 1: 10}
    gpipe = PipelineGeometry(build_schedule("gpipe", 2, 4), 2)
    one_f_one_b = PipelineGeometry(build_schedule("1f1b", 2, 4), 2)
    assert in_flight_peak(saved, gpipe, 0) == 400            # every forward before any backward
    assert in_flight_peak(saved, one_f_one_b, 0) == 200      # stage 0 of 2 holds two micro-batches
    assert in_flight_peak(saved, one_f_one_b, 1) == 10
    assert in_flight_peak({None: 7}, None, 0) == 7


def test_split_backward_frees_activations_at_the_weight_block():
    saved = {0: 100, 1: 10}
    zb_h1 = PipelineGeometry(build_schedule("zb_h1", 2, 4), 2)
    assert in_flight_peak(saved, zb_h1, 0) == 200            # as 1F1B: two micro-batches on stage 0
    assert in_flight_peak(saved, zb_h1, 1) == 20             # its W runs one backward late


def _check(case, predicted, measured):
    assert len(predicted) == len(measured) == case.runtime_ngpus
    for p, m in zip(predicted, measured):
        for column in MEMORY_COLUMNS:
            assert p[column] == m[column], f"{case} rank {m['rank']}: {column} predicted {p[column]}, measured {m[column]}"
    assert all(m["activation_bytes"] > 0 and m["param_bytes"] > 0 for m in measured)


IN_PROCESS = [
    Case("mlp", "dp", 1, 1),
    Case("mlp", "dp", 1, 1, optimizer="momentum"),
    Case("llama", "dp", 1, 1, optimizer="adamw"),
    Case("cnn", "dp", 1, 1, optimizer="adam_amsgrad"),               # buffers, train/eval graphs
    Case("gpt", "dp", 1, 1, optimizer="adamw", config=zero()),         # ZeRO with one rank
    Case("gpt", "pp", 1, 1, config=pipeline("gpipe", 1, 3)),           # three micro-batches in flight
    Case("gpt", "pp", 1, 1, optimizer="momentum", config=pipeline("1f1b", 1, 3)),
    Case("gpt", "dp", 1, 1, config=recompute("gpt.blocks")),          # only the blocks' inputs are kept
    Case("gpt", "pp", 1, 1, config=pipeline("1f1b", 1, 3) + recompute("Block")),
]


@pytest.mark.parametrize("case", IN_PROCESS, ids=str)
def test_memory_model_is_exact_in_one_process(case, tmp_path):
    _check(case, predicted_memory(case), [measure_memory([case], str(tmp_path))[0]])


MULTI = [
    Case("llama", "tp", 2, 2, optimizer="adamw"),
    Case("gpt", "tp", 2, 2, optimizer="momentum"),
    Case("mlp", "data", 2, 2, optimizer="adamw"),
    Case("llama", "dp", 1, 2, optimizer="adamw", config=zero()),
    Case("gpt", "pp", 2, 2, config=pipeline("1f1b", 2, 4)),
    Case("gpt", "pp", 2, 2, optimizer="adamw", config=pipeline("gpipe", 2, 4) + zero()),
    Case("llama", "dp", 1, 2, optimizer="adamw", config=zero(stage=2)),
    Case("gpt", "tp", 2, 2, config=recompute("gpt.blocks.1", "gpt.blocks.3")),
    Case("gpt", "pp", 2, 2, config=pipeline("1f1b_interleaved", 4, 4)),
]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    per_rank = run_ranks(measure_memory, 2, MULTI, str(tmp_path_factory.mktemp("gen")))
    return {case: [res[i] for res in per_rank] for i, case in enumerate(MULTI)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", MULTI, ids=str)
def test_memory_model_is_exact_on_two_ranks(measured, case):
    _check(case, predicted_memory(case), measured[case])


FOUR = [
    Case("gpt", "hybrid", 4, 4, optimizer="adamw", config=pipeline("1f1b", 2, 4)),
    Case("gpt", "pp", 4, 4, config=pipeline("chimera_direct", 4, 4)),
    Case("mlp", "dp", 1, 4, optimizer="adamw", config=zero(2)),
    Case("llama", "tp", 2, 4, optimizer="momentum", config=zero()),
    Case("mlp", "dp", 1, 4, optimizer="adamw", config=zero(2, stage=2)),
    Case("gpt", "pp", 2, 4, optimizer="adamw", config=pipeline("1f1b", 2, 4) + zero(stage=2)),
]


@pytest.mark.multiprocess
def test_memory_model_is_exact_on_four_ranks(tmp_path):
    per_rank = run_ranks(measure_memory, 4, FOUR, str(tmp_path))
    for i, case in enumerate(FOUR):
        _check(case, predicted_memory(case), [res[i] for res in per_rank])
