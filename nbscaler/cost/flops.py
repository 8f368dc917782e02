"""Forward FLOPs of one op, from its annotation and shapes.

For an annotated op, every output element is computed from the product of the sizes of the axes
it sums over: a linear ``'* k+, n k+ -> * n'`` costs ``2 * (* x n) * k``. Ops without a reduction
cost one operation per output element; opaque ones cost what their inputs and outputs weigh.
That is coarse, but it is what balancing stages needs: a matmul-heavy layer must weigh far more
than a reshape. An embedding is a gather, not a product with a one-hot matrix: its annotation sums
over the table's rows (which is what lets a split table leave partial sums), but its forward
computes nothing, and its backward adds each output element's gradient into a row of the table.
Attention is counted as its two products: ``2 (d + e)`` FLOPs per query-key pair and head
(``attention_flops``), the causal mask not subtracted: these are the *model* FLOPs, as published
counts (Megatron-LM's, PaLM's, torchtitan's) and so MFU count them. A causal kernel that skips the
masked blocks performs only ``causal_fraction`` of them, a sliding window's kernel only its band's (``cost.roofline`` prices and counts that). An ``einsum`` is
counted from its equation (``cost.einsum``): it has no annotation. Routed experts
(``nbscaler.experts``) are counted as the SwiGLU products of every pair (dropless) or every slot of
their capacity buffers (``expert_flops``); ``torch._grouped_mm`` (Hugging Face's experts) as one
product of each row with its expert's weight.

>>> node_flops(graph.select(op='linear')[0])              # doctest: +SKIP
2 * 8 * 64 * 256
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from nbscaler.cost.einsum import EINSUM_TARGET, einsum_flops
from nbscaler.cost.products import GROUPED_MM, product_operands
from nbscaler.ir.graph import IRNode, IRTensor
from nbscaler.ir.expert_rules import EXPERT_OPS, EXPERT_WEIGHTS
from nbscaler.ir.layer_rules import window_of
from nbscaler.ir.shape_rules import arg


def attention_flops(q: Sequence[int], k: Sequence[int], v: Sequence[int]) -> float:
    """Forward FLOPs of attention on queries ``(..., h, t, d)``, keys ``(..., hk, s, d)`` and values
    ``(..., hk, s, e)``: the scores ``q k^T`` (``2 t s d`` per head) and ``p v`` (``2 t s e``)."""
    *lead, t, d = q
    s, e = k[-2], v[-1]
    return float(2 * math.prod(lead) * t * s * (d + e))


def causal_fraction(t: int, s: int, window: Optional[int] = None) -> float:
    """The share of the ``t x s`` query-key pairs a causal mask keeps (PyTorch's ``is_causal``: the
    lower triangle aligned to the top-left corner): about half when ``t == s``. With a ``window``,
    the share of a sliding window's band (``nbscaler.attention.window.band``): query ``i`` keeps
    keys ``i - window < j <= i``."""
    if window is None:
        kept = t * (t + 1) / 2 if t <= s else s * (s + 1) / 2 + (t - s) * s
    else:
        i = torch.arange(t, dtype=torch.float64)
        kept = float((torch.minimum(i, torch.tensor(s - 1.0)) - (i - window + 1).clamp(min=0) + 1).clamp(min=0).sum())
    return kept / (t * s)


def attention_causal_fraction(node: IRNode) -> float:
    """``causal_fraction`` of an attention node called with ``is_causal=True`` and no mask, or of a
    ``sliding_window_attention``; 1.0 for any other op (an explicit mask tensor hides its shape from
    the kernel, which computes every pair)."""
    if node.op != "attention":
        return 1.0
    t, s = node.inputs[0].shape[-2], node.inputs[1].shape[-2]
    window = window_of(node)
    if window is not None:
        return causal_fraction(t, s, window)
    if not arg(node, 5, "is_causal", False) or arg(node, 3, "attn_mask", None) is not None:
        return 1.0
    return causal_fraction(t, s)


def expert_flops(node: IRNode, in_shapes: Sequence[Sequence[int]]) -> float:
    """Forward FLOPs of a routed-experts op on inputs of ``in_shapes``: three products of ``d x h``
    (``w1``, ``w3``, ``w2``) for each (token, expert) pair under dropless routing, for each slot of
    every expert's capacity buffer (used or not) under capacity routing. With the experts split over
    devices (local ``w1`` of ``E/n``), a device multiplies as many rows as it routes when every expert
    is loaded alike."""
    x, chosen, w1 = in_shapes[0], in_shapes[2], in_shapes[EXPERT_WEIGHTS[0]]
    d, h = w1[-2], w1[-1]
    if node.target.endswith("capacity_experts"):
        experts = node.inputs[EXPERT_WEIGHTS[0]].shape[0]
        rows = experts * x[0] * node.args[6]                       # E x local sequences x capacity
    else:
        rows = math.prod(x[:-1]) * chosen[-1]                      # local tokens x top_k
    return float(6 * rows * d * h)


def backward_flops(node: IRNode, forward: float, takes_grad: Callable[[IRTensor], bool]) -> float:
    """Backward FLOPs of ``node``, whose forward costs ``forward``: one forward's worth for each
    input that ``takes_grad``, of a product only its operands (``cost.products``: a bias added to
    a linear or an ``addmm`` gets a sum, not a product); attention's gradients are four products, two
    forwards' worth, whichever of q, k and v take one; an embedding's is the scatter-add of its
    output's gradient into the table (one addition an output element)."""
    if node.op == "embedding":
        return float(sum(math.prod(t.shape) for t in node.output_tensors)) if takes_grad(node.inputs[1]) else 0.0
    if node.op == "attention":
        return forward * min(sum(1 for t in node.inputs[:3] if takes_grad(t)), 2)
    if node.target in EXPERT_OPS:              # each product's gradient for its rows, and for its weight
        return forward * (takes_grad(node.inputs[0]) + takes_grad(node.inputs[EXPERT_WEIGHTS[0]]))
    operands = product_operands(node) or range(len(node.inputs))
    return forward * sum(1 for i in operands if takes_grad(node.inputs[i]))


def node_flops(node: IRNode) -> float:
    """Forward FLOPs of ``node`` at its (global) shapes."""
    if node.op == "attention":
        return attention_flops(*(tuple(t.shape) for t in node.inputs[:3]))
    return shape_flops(node, [tuple(t.shape) for t in node.inputs], [tuple(t.shape) for t in node.output_tensors])


def shape_flops(node: IRNode, in_shapes: Sequence[Sequence[int]], out_shapes: Sequence[Sequence[int]]) -> float:
    """Forward FLOPs of ``node``'s op (not attention: ``attention_flops``) on inputs and outputs of
    the given shapes (the node's own, or one device's local ones), the sizes of its reduced axes
    read from the input that names them."""
    if node.op == "embedding":                 # a gather: rows are copied, nothing is computed
        return 0.0
    if node.target == EINSUM_TARGET:
        return einsum_flops(node.args[0], in_shapes)
    if node.target in EXPERT_OPS:
        return expert_flops(node, in_shapes)
    if node.target == GROUPED_MM and len(in_shapes[0]) == 2 and len(in_shapes[1]) == 3:
        return float(2 * math.prod(in_shapes[0]) * in_shapes[1][-1])     # each row by its expert's (a, b) weight
    out_elems = sum(math.prod(s) for s in out_shapes)
    ann = node.annotation
    if ann is None:
        return float(out_elems + sum(math.prod(s) for s in in_shapes))
    size = {name: n for names, s in zip(ann.inputs, in_shapes) for name, n in zip(names or (), s)}
    reduced = math.prod(size.get(name, 1) for name in ann.reduce
                        if all(name not in (o or ()) for o in ann.outputs))
    if node.op == "conv":                      # the kernel window is a reduction too
        reduced = math.prod(in_shapes[1][1:])
    return float(out_elems * (2 * reduced if reduced > 1 else 1))
