"""The plain Reducer over a single rank: nothing to sum, so nothing is copied unless a hook asks."""

import torch

from nbscaler.runtime.reducer import Reducer


def _params_with_grads():
    params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
    for p in params:
        p.grad = torch.randn_like(p)
    return params


def test_single_rank_sync_leaves_the_gradients_alone():
    params = _params_with_grads()
    before = [(p.grad, p.grad.clone()) for p in params]
    Reducer(params, group=None).sync()
    for p, (grad, value) in zip(params, before):
        assert p.grad is grad and torch.equal(p.grad, value)          # the same tensor: no copy made


def test_single_rank_sync_still_runs_hooks_on_the_flat_bucket():
    params = _params_with_grads()
    expected = [2 * p.grad for p in params]
    reducer = Reducer(params, group=None)
    seen = []
    reducer.pre_hooks.append(lambda r, flat: (seen.append(flat.numel()), flat.mul_(2)))
    reducer.sync()
    assert seen == [17]
    for p, e in zip(params, expected):
        assert torch.equal(p.grad, e)
