"""fp8 products against the meter: the memory model equals ``MemoryMeter`` to the byte with
``Recipe(float8=...)``, as without it (``tests/cost/test_memory.py``).

Where fp8 copies live: a product casts its operands to fp8 (one byte an element) with their scales
(one fp32 number per tensor, or per row) inside ``float8_linear``, takes the product and lets
them go before it returns; the backward casts again from the high-precision tensors it saved (the
input, and the weight, a parameter). So the copies and scales live within one product at a time,
never across a moment of the step: in every category (parameters, gradients, optimizer state,
buffers, saved activations) an fp8 run holds exactly what the same run holds without fp8, which the
second test checks against the meter itself.
"""

import dataclasses

import pytest
import torch

from tests.cost.test_memory import _check
from tests.multiprocess import Case, measure_memory, pipeline, predicted_memory, run_cases, zero

BF16, FP32 = torch.bfloat16, torch.float32

FP8 = [
    Case("mlp", "data", 2, 2, optimizer="adamw", float8="tensorwise"),
    Case("gpt", "tp", 2, 2, optimizer="momentum", float8="rowwise"),
    Case("llama", "tp", 2, 2, optimizer="adamw", module_dtype=BF16, master_dtype=FP32, float8="tensorwise"),
    Case("gpt", "pp", 2, 2, config=pipeline("1f1b", 2, 4), float8="tensorwise"),
    Case("llama", "dp", 1, 2, optimizer="adamw", config=zero(stage=3), float8="rowwise"),
]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Each fp8 case and the same case without fp8, measured on 2 ranks in one spawn."""
    plain = [dataclasses.replace(c, float8=None) for c in FP8]
    return run_cases(measure_memory, 2, FP8 + plain, str(tmp_path_factory.mktemp("gen")))


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", FP8, ids=str)
def test_memory_model_is_exact_with_fp8_products(measured, case):
    _check(case, predicted_memory(case), measured[case])


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", FP8, ids=str)
def test_fp8_copies_and_scales_live_within_one_product(measured, case):
    assert measured[case] == measured[dataclasses.replace(case, float8=None)]
