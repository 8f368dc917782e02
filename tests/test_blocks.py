"""Strided splits cut and rebuild tensors the same way everywhere (``nbscaler.blocks``)."""

import doctest

import pytest
import torch

import nbscaler.blocks as blocks
from nbscaler.runtime.module import WeightSpec


def test_doctests():
    assert doctest.testmod(blocks).failed == 0


@pytest.mark.parametrize("spec", [1, 3, (2, 1, 1)])
def test_take_then_join_gives_the_tensor_back(spec):
    full = torch.arange(48.0).view(24, 2)
    slices = [blocks.take(full, 0, spec, 2, i) for i in range(2)]
    assert torch.equal(blocks.join(slices, 0, spec), full)


def test_unequal_blocks_give_each_device_its_share_of_each_block():
    rows = torch.arange(8)                       # q: 0..3, k: 4..5, v: 6..7
    assert blocks.take(rows, 0, (2, 1, 1), 2, 0).tolist() == [0, 1, 4, 6]
    assert blocks.take(rows, 0, (2, 1, 1), 2, 1).tolist() == [2, 3, 5, 7]


def test_one_spelling_per_cut():
    assert blocks.normalize([8, 8, 8]) == 3 and blocks.normalize((32, 16, 16)) == (2, 1, 1)
    assert blocks.units((2, 1, 1)) == 4 and blocks.divide((2, 1, 1), (2, 1, 1)) == 1
    assert blocks.divide(6, 3) == 2 and blocks.divide((2, 1, 1), 3) is None


def test_weight_spec_with_unequal_blocks_survives_a_checkpoint():
    spec = WeightSpec("qkv.weight", "param", (8, 4), torch.float32, (0, 1), 0, 2, 1, blocks=(2, 1, 1))
    again = WeightSpec.from_dict(spec.to_dict())
    assert again == spec
    full = torch.randn(8, 4)
    assert torch.equal(again.join([WeightSpec.from_dict({**spec.to_dict(), "index": i}).take(full) for i in range(2)]), full)
