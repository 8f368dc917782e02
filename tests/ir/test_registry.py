"""Every op family the policies rely on gets the annotation that makes its splits correct."""

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nbscaler.trace import trace_module


class Fn(nn.Module):
    def __init__(self, fn, params=()):
        super().__init__()
        self.fn = fn
        for i, p in enumerate(params):
            self.register_parameter(f"p{i}", nn.Parameter(p))

    def forward(self, x, y=None):
        return self.fn(self, x, y)


def annotation_of(fn, x, y=None, params=()):
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # every op here must be known to the registry
        g = trace_module(Fn(fn, params), {"x": x, "y": y})
    return g.nodes[-1]


CASES = [
    ("linear", lambda m, x, y: F.linear(x, m.p0, m.p1), (torch.randn(2, 4, 8),), (torch.randn(6, 8), torch.randn(6)),
     ["*0", "*1", "n"], ["k"]),
    ("matmul", lambda m, x, y: x @ y, (torch.randn(2, 4, 8), torch.randn(2, 8, 6)), (), ["b0", "m", "n"], []),
    ("bmm", lambda m, x, y: torch.bmm(x, y), (torch.randn(2, 4, 8), torch.randn(2, 8, 6)), (), ["b0", "m", "n"], []),
    ("conv2d", lambda m, x, y: F.conv2d(x, m.p0, padding=1), (torch.randn(2, 4, 5, 5),), (torch.randn(4, 4, 3, 3),),
     ["n", "o"], ["c"]),
    ("conv1d", lambda m, x, y: F.conv1d(x, m.p0), (torch.randn(2, 4, 7),), (torch.randn(4, 4, 3),), ["n", "o"], ["c"]),
    ("embedding", lambda m, x, y: F.embedding(x, m.p0), (torch.zeros(2, 6, dtype=torch.long),), (torch.randn(10, 4),),
     ["*0", "*1", "d"], ["v"]),
    ("layer_norm", lambda m, x, y: F.layer_norm(x, (8,)), (torch.randn(2, 4, 8),), (), ["*0", "*1"], []),
    ("batch_norm eval", lambda m, x, y: F.batch_norm(x, torch.zeros(4), torch.ones(4), training=False),
     (torch.randn(4, 4, 6),), (), ["n", "c", "s0"], []),
    ("batch_norm train", lambda m, x, y: F.batch_norm(x, None, None, training=True), (torch.randn(4, 4, 6),), (),
     ["c"], []),
    ("softmax", lambda m, x, y: F.softmax(x, dim=-1), (torch.randn(2, 8),), (), ["d0"], []),
    ("gelu", lambda m, x, y: F.gelu(x), (torch.randn(2, 8),), (), ["d0", "d1"], []),
    ("silu", lambda m, x, y: F.silu(x), (torch.randn(2, 8),), (), ["d0", "d1"], []),
    ("relu", lambda m, x, y: F.relu(x), (torch.randn(2, 8),), (), ["d0", "d1"], []),
    ("tanh", lambda m, x, y: torch.tanh(x), (torch.randn(2, 8),), (), ["d0", "d1"], []),
    ("sigmoid", lambda m, x, y: torch.sigmoid(x), (torch.randn(2, 8),), (), ["d0", "d1"], []),
    ("dropout", lambda m, x, y: F.dropout(x, 0.1, training=False), (torch.randn(2, 8),), (), ["d0", "d1"], []),
    ("cross_entropy sum", lambda m, x, y: F.cross_entropy(x, y, reduction="sum"),
     (torch.randn(4, 6), torch.zeros(4, dtype=torch.long)), (), [], ["n", "c"]),
    ("cross_entropy mean", lambda m, x, y: F.cross_entropy(x, y), (torch.randn(4, 6), torch.zeros(4, dtype=torch.long)),
     (), [], ["c"]),
    ("mse_loss sum", lambda m, x, y: F.mse_loss(x, y, reduction="sum"), (torch.randn(4, 6), torch.randn(4, 6)), (),
     [], ["d0", "d1"]),
    ("broadcast add", lambda m, x, y: x + y, (torch.randn(2, 4, 8), torch.randn(8)), (), ["d0", "d1", "d2"], []),
    ("view", lambda m, x, y: x.view(2, 4, 2, 4), (torch.randn(2, 4, 8),), (), ["g0", "g1", "g2"], []),
    ("reshape", lambda m, x, y: x.reshape(8, 8), (torch.randn(2, 4, 8),), (), ["g0", "g1"], []),
    ("transpose", lambda m, x, y: x.transpose(0, 2), (torch.randn(2, 4, 8),), (), ["d0", "d1", "d2"], []),
    ("permute", lambda m, x, y: x.permute(2, 0, 1), (torch.randn(2, 4, 8),), (), ["d0", "d1", "d2"], []),
    ("flatten", lambda m, x, y: x.flatten(1), (torch.randn(2, 4, 8),), (), ["g0", "g1"], []),
    ("unsqueeze", lambda m, x, y: x.unsqueeze(1), (torch.randn(2, 8),), (), ["g0", "g1"], []),
    ("squeeze", lambda m, x, y: x.squeeze(1), (torch.randn(2, 1, 8),), (), ["g0", "g1"], []),
    ("split", lambda m, x, y: x.split(4, dim=-1)[1], (torch.randn(2, 8),), (), ["d0"], []),
    ("chunk", lambda m, x, y: x.chunk(2, dim=0)[0], (torch.randn(2, 8),), (), ["d1"], []),
    ("cat", lambda m, x, y: torch.cat([x, y], dim=1), (torch.randn(2, 3), torch.randn(2, 5)), (), ["d0"], []),
    ("stack", lambda m, x, y: torch.stack([x, y]), (torch.randn(2, 4), torch.randn(2, 4)), (), ["d1", "d2"], []),
    ("slice", lambda m, x, y: x[:, 1:3, ...], (torch.randn(2, 4, 8),), (), ["d0", "d2"], []),
    ("index", lambda m, x, y: x[:, 0], (torch.randn(2, 4, 8),), (), ["d0", "d2"], []),
    ("masked_fill", lambda m, x, y: x.masked_fill(y, 0.0), (torch.randn(2, 4), torch.zeros(4, dtype=torch.bool)), (),
     ["d0", "d1"], []),
    ("ones", lambda m, x, y: torch.ones(3, 4) + 0 * x.sum(), (torch.randn(2),), (), [], []),
    ("arange", lambda m, x, y: torch.arange(4) + 0, (torch.randn(2),), (), ["d0"], []),
    ("triu", lambda m, x, y: torch.triu(x), (torch.randn(2, 4, 4),), (), ["d0"], []),
    ("repeat_interleave", lambda m, x, y: x.repeat_interleave(2, dim=1), (torch.randn(2, 4, 4),), (),
     ["d0", "d1", "d2"], []),
    ("sdpa", lambda m, x, y: F.scaled_dot_product_attention(x, x, x, is_causal=True), (torch.randn(2, 4, 6, 8),), (),
     ["b0", "h"], []),
    ("sdpa gqa", lambda m, x, y: F.scaled_dot_product_attention(x, y, y, enable_gqa=True),
     (torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8)), (), ["b0", "h"], []),
    ("addmm", lambda m, x, y: torch.addmm(m.p1, x, m.p0), (torch.randn(6, 8),), (torch.randn(8, 4), torch.randn(4)),
     ["m", "n"], ["k"]),
    ("baddbmm", lambda m, x, y: torch.baddbmm(y, x, x.transpose(1, 2)), (torch.randn(2, 4, 8), torch.randn(2, 4, 4)),
     (), ["b", "m", "n"], ["k"]),
    ("pad", lambda m, x, y: F.pad(x, (0, 1)), (torch.randn(4, 6),), (), ["d0"], []),
    ("gather", lambda m, x, y: torch.gather(x, 1, y), (torch.randn(4, 6), torch.zeros(4, 2, dtype=torch.long)), (),
     ["d0", "pick"], []),
    ("topk", lambda m, x, y: torch.topk(x, 2, dim=-1)[0], (torch.randn(4, 6),), (), ["d0"], []),
    ("max_pool2d", lambda m, x, y: F.max_pool2d(x, 2), (torch.randn(2, 4, 6, 6),), (), ["n", "c"], []),
    ("adaptive_avg_pool2d", lambda m, x, y: F.adaptive_avg_pool2d(x, 1), (torch.randn(2, 4, 6, 6),), (),
     ["n", "c"], []),
    ("hardswish", lambda m, x, y: F.hardswish(x), (torch.randn(2, 8),), (), ["d0", "d1"], []),
    ("hardsigmoid", lambda m, x, y: F.hardsigmoid(x), (torch.randn(2, 8),), (), ["d0", "d1"], []),
    ("fused qkv split", lambda m, x, y: x.split(4, dim=-1)[1], (torch.randn(2, 12),), (), ["d0", "h"], []),
    ("depthwise conv2d", lambda m, x, y: F.conv2d(x, m.p0, padding=1, groups=4), (torch.randn(2, 4, 5, 5),),
     (torch.randn(4, 1, 3, 3),), ["n", "g"], []),
]


def test_gqa_attention_splits_heads_only_as_far_as_the_key_heads_go():
    node = annotation_of(lambda m, x, y: F.scaled_dot_product_attention(x, y, y, enable_gqa=True),
                         torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8))
    assert node.annotation.can_split("h", 2) is None and node.annotation.can_split("h", 4) is not None


def test_routing_runs_whole_on_purpose():
    node = annotation_of(lambda m, x, y: torch.histc(x, bins=4, min=0, max=4), torch.rand(8))
    assert node.op == "routing" and node.annotation.splittable(2) == []


@pytest.mark.parametrize("name, fn, inputs, params, splittable, reducible", CASES, ids=[c[0] for c in CASES])
def test_annotations(name, fn, inputs, params, splittable, reducible):
    node = annotation_of(fn, *inputs, params=params)
    ann = node.annotation
    assert ann is not None, f"{name}: no annotation"
    ok = set(ann.splittable(2))
    assert set(splittable) <= ok, f"{name}: {ann} should allow splitting {splittable}, allows {sorted(ok)}"
    assert set(reducible) <= set(ann.reduce) and set(reducible) <= ok, f"{name}: {ann}"


def test_reshape_pairs_outer_axes():
    node = annotation_of(lambda m, x, y: x.view(2, 4, 4, 2), torch.randn(2, 4, 8))
    assert str(node.annotation) == "g0 g1 g2 -> g0 g1 g2 g2_b3^"
    assert node.annotation.can_split("g2", 4) is None and node.annotation.can_split("g2", 8) is not None


def test_a_fused_qkv_view_splits_the_heads_of_its_three_blocks():
    """timm's attention views its qkv output as ``(B, T, 3, nh, hs)``: the heads carry the split,
    and the input is read as 3 blocks (q, k, v), so a split of it must be strided."""
    node = annotation_of(lambda m, x, y: x.reshape(2, 5, 3, 4, 8), torch.randn(2, 5, 96))
    assert str(node.annotation) == "g0 g1 g2 -> g0 g1 g2_blocks^ g2 g2_b4^"
    assert node.annotation.grouped == {(0, "g2"): 3} and node.annotation.can_split("g2", 4) is None


def test_a_grouped_conv_splits_in_whole_groups():
    node = annotation_of(lambda m, x, y: F.conv2d(x, m.p0, groups=2), torch.randn(2, 8, 5, 5),
                         params=(torch.randn(6, 4, 3, 3),))
    assert node.annotation.can_split("g", 2) is None and node.annotation.can_split("g", 4) is not None


def test_batch_norm_training_splits_the_batch_but_not_the_maps():
    """Generated code then calls comm.batch_norm, which sums the statistics across the devices."""
    node = annotation_of(lambda m, x, y: F.batch_norm(x, None, None, training=True), torch.randn(4, 3, 5))
    assert node.annotation.can_split("n", 2) is None
    assert "must not be split" in node.annotation.can_split("s0", 2)


def test_an_embedding_splits_its_vocabulary_only_when_the_lookup_is_plain():
    """Rows split across devices give partial sums of masked lookups; a padding row (whose
    gradient is held at zero) or a max_norm renormalisation keeps the table whole."""
    table = (torch.randn(10, 4),)
    ids = torch.zeros(2, 6, dtype=torch.long)
    plain = annotation_of(lambda m, x, y: F.embedding(x, m.p0), ids, params=table).annotation
    assert plain.can_split("v", 2) is None and "v" in plain.reduce
    for kwargs in ({"padding_idx": 0}, {"max_norm": 1.0}):
        node = annotation_of(lambda m, x, y: F.embedding(x, m.p0, **kwargs), ids, params=table)
        assert node.annotation.can_split("v", 2) is not None, kwargs


def test_a_cross_entropy_splits_its_classes_only_when_plain():
    """(N, C) logits against class indices leave partial sums of the loss when the classes split
    (the vocabulary-parallel cross-entropy); class weights, label smoothing or classes on another
    axis than the last keep them whole."""
    logits, target = torch.randn(4, 6), torch.zeros(4, dtype=torch.long)
    plain = annotation_of(lambda m, x, y: F.cross_entropy(x, y, ignore_index=0), logits, target).annotation
    assert plain.can_split("c", 2) is None and "c" in plain.reduce
    for fn in (lambda m, x, y: F.cross_entropy(x, y, weight=torch.ones(6)),
               lambda m, x, y: F.cross_entropy(x, y, label_smoothing=0.1),
               lambda m, x, y: F.cross_entropy(x.view(2, 2, 6).transpose(1, 2), y.view(2, 2))):
        ann = annotation_of(fn, logits, target).annotation
        assert ann.can_split("c", 2) is not None, ann
    assert annotation_of(lambda m, x, y: F.nll_loss(x, y), logits, target).annotation.can_split("c", 2) is not None
