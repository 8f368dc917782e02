"""WeightSpec: which slice of an original tensor a rank holds, contiguous or strided by blocks."""

import torch

from nbscaler.runtime.module import WeightSpec


def test_strided_slices_hold_each_devices_heads_and_join_back():
    full = torch.arange(12.0).reshape(12, 1)                     # rows: q0..q3, k0..k3, v0..v3
    specs = [WeightSpec("qkv.weight", "param", (12, 1), torch.float32, (0, 1), split_dim=0, parts=2, index=i, blocks=3)
             for i in range(2)]
    pieces = [s.take(full) for s in specs]
    assert pieces[0].flatten().tolist() == [0, 1, 4, 5, 8, 9]     # first half of q, of k and of v
    assert specs[0].local_shape == (6, 1)
    assert torch.equal(specs[0].join(pieces), full)
    assert WeightSpec.from_dict(specs[1].to_dict()) == specs[1]
