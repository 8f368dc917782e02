"""Sequence parallelism (``pas_config={'sequence_parallel': True}``) trains like one process.

The shipped GPT and Llama and transformers' Llama, under ``tp``, ``hybrid`` and ``autodist`` with
sequence parallelism, on 2 and 4 gloo ranks: losses, merged gradients and final parameters over 3
steps equal one process's (``tests.multiprocess.check_equivalence``). Norms, residual adds and the
embeddings' sum then run on a sequence slice, with a reduce-scatter after each row-parallel linear
and an all-gather (its backward a reduce-scatter) before each column-parallel one.
"""

import pytest

from tests.multiprocess import Case, check_equivalence, pipeline, run_cases, sequence_parallel, train_parallel

SP = sequence_parallel()

TWO = [
    Case("gpt", "tp", 2, 2, config=SP),
    Case("llama", "tp", 2, 2, optimizer="adamw", config=SP),
    Case("hf_llama", "tp", 2, 2, config=SP),
    Case("gpt", "autodist", 2, 2, config=SP),
]

FOUR = [
    Case("gpt", "tp", 4, 4, optimizer="adamw", config=SP),          # one head per device
    Case("llama", "tp", 2, 4, config=SP),                           # two data-parallel units
    Case("hf_llama", "tp", 4, 4, config=SP),
    Case("gpt", "hybrid", 4, 4, config=pipeline("1f1b", 2, 4) + SP),  # two stages, each tp over two
]


@pytest.mark.multiprocess
def test_sequence_parallel_equals_single_process_on_two_ranks(tmp_path):
    for case, per_rank in run_cases(train_parallel, 2, TWO, str(tmp_path)).items():
        check_equivalence(case, per_rank)


@pytest.mark.multiprocess
def test_sequence_parallel_equals_single_process_on_four_ranks(tmp_path):
    for case, per_rank in run_cases(train_parallel, 4, FOUR, str(tmp_path)).items():
        check_equivalence(case, per_rank)
