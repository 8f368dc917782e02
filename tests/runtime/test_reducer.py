"""The plain Reducer over a single rank: nothing to sum, so nothing is copied unless a hook asks; and
how it buckets the gradients."""

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


def test_hooks_see_one_bucket_at_a_time_in_the_reduction_dtype():
    """48 bytes then 20 of fp32 gradients in buckets of at most 48 bytes: two flat buckets, each
    packed in the reduction dtype when it is summed, not one copy of every gradient."""
    from nbscaler.recipe import Recipe
    params = _params_with_grads()
    reducer = Reducer(params, group=None, bucket_bytes=48)
    reducer.set_precision(Recipe(master_dtype=None, grad_reduce_dtype=torch.float64), masters=False)
    seen = []
    reducer.pre_hooks.append(lambda r, flat: seen.append((flat.numel(), flat.dtype)))
    reducer.sync()
    assert [len(b.params) for b in reducer.buckets] == [1, 1]
    assert seen == [(12, torch.float64), (5, torch.float64)]
