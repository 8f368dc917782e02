"""B then W equals one backward: input gradients first, weight gradients later, each walked once."""

import torch
import torch.nn as nn

from nbscaler.runtime.split_backward import split
from tests.models import batch, build


class CountedIdentity(torch.autograd.Function):
    """Stands for a collective on the data path: counts how often its backward runs."""

    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        CountedIdentity.calls += 1
        return grad


class Stage(nn.Module):
    def __init__(self, reuse: bool = False):
        super().__init__()
        self.up, self.down, self.norm = nn.Linear(8, 16), nn.Linear(16, 8), nn.LayerNorm(8)
        self.reuse = reuse

    def forward(self, x):
        h = self.norm(x + self.down(torch.tanh(CountedIdentity.apply(self.up(x)))))
        return self.down(torch.relu(self.up(h))) if self.reuse else h     # reuse: weights met twice on the path


def whole_and_split(stage, x, grad):
    params = list(stage.parameters())
    expected_x, *expected_w = torch.autograd.grad(stage(x), [x] + params, grad)
    CountedIdentity.calls = 0
    (found_x,), weights = split(([stage(x)], [grad]), [x], params)
    in_b = CountedIdentity.calls
    assert all(p.grad is None for p in params)              # B leaves the weights alone
    starts = len(weights.starts)
    weights.run()
    assert torch.allclose(found_x, expected_x, rtol=1e-6, atol=1e-7)
    for p, e in zip(params, expected_w):
        assert torch.allclose(p.grad, e, rtol=1e-6, atol=1e-7)
    return weights.whole, starts, in_b, CountedIdentity.calls - in_b


def test_w_starts_where_b_left_the_data_path():
    torch.manual_seed(0)
    whole, _, in_b, in_w = whole_and_split(Stage(), torch.randn(4, 8, requires_grad=True), torch.randn(4, 8))
    assert not whole and (in_b, in_w) == (1, 0)      # the data path's "collective" ran in B only


def test_weights_met_twice_on_the_path_fall_back_to_a_second_walk():
    torch.manual_seed(0)
    whole, _, in_b, in_w = whole_and_split(Stage(reuse=True), torch.randn(4, 8, requires_grad=True),
                                           torch.randn(4, 8))
    assert whole and (in_b, in_w) == (1, 1)


def test_shipped_llama_first_layers_split_like_one_backward():
    """A stage with no input gradient to find (the first): B runs nothing, W the whole backward."""
    model = build("llama")
    params = list(model.parameters())
    loss = model(**batch("llama", 0))
    expected = torch.autograd.grad(loss, params)
    found, weights = split(([model(**batch("llama", 0))], [None]), [], params)
    weights.run()
    assert found == [] and all(torch.allclose(p.grad, e, rtol=1e-6, atol=1e-8) for p, e in zip(params, expected))


def test_a_shipped_gpt_block_splits_without_a_second_walk():
    from nbscaler.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    block = GPT(GPTConfig(vocab_size=64, seq_len=8, n_layer=1, d_model=32, n_head=4)).blocks[0]
    whole, starts, _, _ = whole_and_split(block, torch.randn(2, 8, 32, requires_grad=True), torch.randn(2, 8, 32))
    assert not whole and starts == 6      # fused qkv, attention projection, two LayerNorms, the MLP's two linears


def test_the_meter_sees_a_split_stage_free_everything_once_w_has_run():
    """Under ``SavedTensorMeter`` a stage whose data path saves an output (``tanh`` keeps its
    result) is counted until its W has run and the graph is dropped, then not at all. The meter
    once kept such a result with its ``grad_fn``, a cycle through autograd's nodes that nothing
    collects: B leaves the data path's buffers for W, W never runs those nodes, so they were
    counted for ever."""
    from nbscaler.runtime.memory import SavedTensorMeter
    torch.manual_seed(0)
    stage = Stage()
    x = torch.randn(4, 8, requires_grad=True)
    with SavedTensorMeter(_weights(stage)) as meter:
        out = stage(x)
        saved = meter.live
        (_,), weights = split(([out], [torch.ones(4, 8)]), [x], list(stage.parameters()))
        del out
        assert meter.live == saved > 0             # B keeps the graph for W
        weights.run()
        del weights
    assert meter.live == 0


def _weights(module: nn.Module):
    return [p.untyped_storage()._cdata for p in module.parameters()]


def test_b_lets_go_of_what_lies_above_the_last_weight():
    """A last stage's loss sits above its last weighted op, where W never walks: B drops the
    stage's outputs, so the loss's saved log-softmax (and its targets) die with B, and W keeps
    only what its weight branches read. Before, W held the loss as a root and with it those bytes
    for every micro-batch waiting for its W."""
    from nbscaler.runtime.memory import SavedTensorMeter
    torch.manual_seed(0)
    stage, head = Stage(), nn.Linear(8, 5)
    params = list(stage.parameters()) + list(head.parameters())
    x, target = torch.randn(4, 8, requires_grad=True), torch.tensor([0, 1, 2, 3])
    expected = torch.autograd.grad(nn.functional.cross_entropy(head(stage(x)), target), [x] + params)
    with SavedTensorMeter(_weights(stage) + _weights(head)) as meter:
        logits = head(stage(x))
        before_loss = meter.live
        loss = nn.functional.cross_entropy(logits, target)       # saves its log-softmax and the targets
        loss_bytes = meter.live - before_loss
        del logits
        (found_x,), weights = split(([loss], [None]), [x], params)
        del loss
        assert loss_bytes == 4 * 5 * 4 + 4 * 8 + 4 and meter.live == before_loss    # log-softmax, targets, total weight
        weights.run()
        del weights
    assert meter.live == 0
    assert torch.allclose(found_x, expected[0], rtol=1e-6, atol=1e-7)
    assert all(torch.allclose(p.grad, e, rtol=1e-6, atol=1e-7) for p, e in zip(params, expected[1:]))
