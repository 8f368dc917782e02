"""Each differentiable collective, forward and backward, against the same math on full tensors."""

import pytest
import torch
import torch.distributed as dist

from nbscaler.runtime import collectives as comm
from nbscaler.runtime.groups import get_group
from tests.multiprocess import run_ranks


def _collectives_on_ranks():
    rank, world = dist.get_rank(), dist.get_world_size()
    group = get_group(range(world))
    full = torch.arange(world * 6, dtype=torch.float64).reshape(world * 2, 3)   # same on every rank
    mine = full.chunk(world, 0)[rank]
    out = {}

    x = mine.clone().requires_grad_()
    y = comm.all_gather(x, dim=0, group=group)
    (y * full).sum().backward()                          # d/dx = my slice of full
    out["all_gather"] = (y, x.grad)

    x = mine.clone().requires_grad_()
    y = comm.all_gather_sum_grad(x, dim=0, group=group)
    (y * full * (rank + 1)).sum().backward()             # partial grads (rank + 1) * full, summed, sliced
    out["all_gather_sum_grad"] = (y, x.grad)

    x = full.clone().requires_grad_()
    y = comm.chunk(x, dim=0, group=group)
    y.sum().backward()                                   # every rank's slice grads gathered
    out["chunk"] = (y, x.grad)

    x = (full * (rank + 1)).requires_grad_()
    y = comm.all_reduce(x, group=group)
    y.sum().backward()
    out["all_reduce"] = (y, x.grad)

    x = (full * (rank + 1)).requires_grad_()
    y = comm.reduce_scatter(x, dim=0, group=group)
    y.sum().backward()
    out["reduce_scatter"] = (y, x.grad)

    square = torch.arange(world * world * 4, dtype=torch.float64).reshape(2 * world, 2 * world)
    x = square.chunk(world, 0)[rank].clone().requires_grad_()
    y = comm.all_to_all(x, dim=1, dim2=0, group=group)      # split rows -> split columns
    (y * square.chunk(world, 1)[rank]).sum().backward()
    out["all_to_all"] = (y, x.grad)

    # strided: rows are 3 blocks (q, k, v); a rank holds its share of each block
    fused = torch.arange(world * 6 * 2, dtype=torch.float64).reshape(world * 6, 2)
    heads = torch.cat([b.chunk(world, 0)[rank] for b in fused.chunk(3, 0)])
    x = heads.clone().requires_grad_()
    y = comm.all_gather(x, dim=0, group=group, blocks=3)
    (y * fused).sum().backward()
    out["all_gather_blocks"] = (y, x.grad, heads)
    x = heads.clone().requires_grad_()
    y = comm.all_gather_sum_grad(x, dim=0, group=group, blocks=3)
    (y * fused * (rank + 1)).sum().backward()
    out["all_gather_sum_grad_blocks"] = (y, x.grad, heads)
    x = fused.clone().requires_grad_()
    y = comm.chunk(x, dim=0, group=group, blocks=3)
    y.sum().backward()
    out["chunk_blocks"] = (y, x.grad, heads)

    x = full.clone().requires_grad_()
    y = comm.sum_grad(x, group=group)
    (y * (rank + 1)).sum().backward()
    out["sum_grad"] = (y, x.grad)

    x = full.clone().requires_grad_()
    y = comm.first_only(x, group=group)
    y.sum().backward()
    out["first_only"] = (y, x.grad)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_collectives_forward_and_backward(world):
    outs = run_ranks(_collectives_on_ranks, world)
    full = torch.arange(world * 6, dtype=torch.float64).reshape(world * 2, 3)
    tri = sum(range(1, world + 1))
    fused = torch.arange(world * 6 * 2, dtype=torch.float64).reshape(world * 6, 2)
    for r, o in enumerate(outs):
        y, g, heads = o["all_gather_blocks"]
        assert torch.equal(y, fused) and torch.equal(g, heads)
        y, g, heads = o["all_gather_sum_grad_blocks"]
        assert torch.equal(y, fused) and torch.equal(g, heads * tri)
        y, g, heads = o["chunk_blocks"]
        assert torch.equal(y, heads) and torch.equal(g, torch.ones_like(fused))
        y, g = o["all_gather"]
        assert torch.equal(y, full) and torch.equal(g, full.chunk(world, 0)[r])
        y, g = o["all_gather_sum_grad"]
        assert torch.equal(y, full) and torch.equal(g, (full * tri).chunk(world, 0)[r])
        y, g = o["chunk"]
        assert torch.equal(y, full.chunk(world, 0)[r]) and torch.equal(g, torch.ones_like(full))
        y, g = o["all_reduce"]
        assert torch.equal(y, full * tri) and torch.equal(g, torch.ones_like(full))
        y, g = o["reduce_scatter"]
        assert torch.equal(y, (full * tri).chunk(world, 0)[r]) and torch.equal(g, torch.ones_like(full))
        square = torch.arange(world * world * 4, dtype=torch.float64).reshape(2 * world, 2 * world)
        y, g = o["all_to_all"]
        assert torch.equal(y, square.chunk(world, 1)[r]) and torch.equal(g, square.chunk(world, 0)[r])
        y, g = o["sum_grad"]
        assert torch.equal(y, full) and torch.equal(g, torch.full_like(full, tri))
        y, g = o["first_only"]
        assert torch.equal(y, full if r == 0 else torch.zeros_like(full)) and torch.equal(g, torch.ones_like(full))

