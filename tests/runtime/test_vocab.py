"""Both ends of a language model split by vocabulary (``nbscaler.runtime.vocab``) against the
same math on the whole vocabulary: the devices' parts sum to the whole result, and each device's
gradient is the whole gradient's share."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from nbscaler.runtime.groups import get_group
from nbscaler.runtime.vocab import vocab_cross_entropy, vocab_embedding
from tests.multiprocess import run_ranks

ROWS, CLASSES = 6, 12
REDUCTIONS = ("mean", "sum", "none")


def test_vocab_embedding_parts_sum_to_the_whole_lookup():
    """Each device's masked lookup in its rows; the sum over devices is the lookup in the whole
    table, and each device's gradient is the whole table's gradient restricted to its rows."""
    table = torch.randn(12, 5, requires_grad=True)
    tokens = torch.tensor([[0, 3, 11, 4], [7, 7, 2, 8]])
    expected = F.embedding(tokens, table)
    upstream = torch.randn_like(expected)
    (expected * upstream).sum().backward()
    for parts in (2, 3, 4):
        rows = [table.detach()[i * 12 // parts:(i + 1) * 12 // parts].clone().requires_grad_() for i in range(parts)]
        outs = [vocab_embedding(tokens, w, i * 12 // parts) for i, w in enumerate(rows)]
        assert torch.allclose(sum(outs), expected)
        for w, out in zip(rows, outs):
            (out * upstream).sum().backward()
        assert torch.allclose(torch.cat([w.grad for w in rows]), table.grad)


def _problem():
    """Logits in float64 (so equality is to rounding), targets with two rows ignored, and an
    upstream gradient for the ``none`` reduction."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(ROWS, CLASSES, generator=g, dtype=torch.float64) * 4
    target = torch.tensor([0, 11, -100, 5, 6, -100])
    return logits, target, torch.randn(ROWS, generator=g, dtype=torch.float64)


def _whole(reduction: str):
    logits, target, upstream = _problem()
    x = logits.clone().requires_grad_()
    loss = F.cross_entropy(x, target, ignore_index=-100, reduction=reduction)
    (loss * upstream if reduction == "none" else loss).sum().backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_vocab_cross_entropy_on_one_device_is_the_cross_entropy(reduction):
    logits, target, upstream = _problem()
    x = logits.clone().requires_grad_()
    loss = vocab_cross_entropy(x, target, 0, None, ignore_index=-100, reduction=reduction)
    (loss * upstream if reduction == "none" else loss).sum().backward()
    expected, grad = _whole(reduction)
    assert torch.allclose(loss, expected, rtol=1e-12) and torch.allclose(x.grad, grad, rtol=1e-12)


def _cross_entropy_on_ranks():
    """Each rank's columns of the logits: its part of the loss, summed over the ranks, and its
    gradient, for each reduction."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = get_group(range(world))
    logits, target, upstream = _problem()
    cols = CLASSES // world
    out = {}
    for reduction in REDUCTIONS:
        x = logits[:, rank * cols:(rank + 1) * cols].clone().requires_grad_()
        part = vocab_cross_entropy(x, target, rank * cols, group, ignore_index=-100, reduction=reduction)
        (part * upstream if reduction == "none" else part).sum().backward()
        total = part.detach().clone()
        dist.all_reduce(total, group=group)
        out[reduction] = (total, x.grad)
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_vocab_cross_entropy_parts_sum_to_the_whole_loss(world):
    """The logits are never gathered: the ranks' parts sum to one process's loss, and their
    gradients are its columns, with ignored rows counting for nothing."""
    outs = run_ranks(_cross_entropy_on_ranks, world)
    for reduction in REDUCTIONS:
        expected, grad = _whole(reduction)
        for rank, out in enumerate(outs):
            total, local = out[reduction]
            assert torch.allclose(total, expected, rtol=1e-12), (reduction, rank, total, expected)
            assert torch.allclose(local, grad.chunk(world, 1)[rank], rtol=1e-12), (reduction, rank)


def test_vocab_cross_entropy_names_an_unknown_reduction():
    logits, target, _ = _problem()
    with pytest.raises(ValueError, match="reduction='avg'.*mean"):
        vocab_cross_entropy(logits, target, 0, None, reduction="avg")
