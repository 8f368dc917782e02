"""Forward FLOPs of one op, from its annotation and shapes.

For an annotated op, every output element is computed from the product of the sizes of the axes
it sums over: a linear ``'* k+, n k+ -> * n'`` costs ``2 * (* x n) * k``. Ops without a reduction
cost one operation per output element; opaque ones cost what their inputs and outputs weigh.
That is coarse, but it is what balancing stages needs: a matmul-heavy layer must weigh far more
than a reshape. Attention is counted as its two products: ``2 (d + e)`` FLOPs per query-key pair
and head (``attention_flops``), the causal mask not subtracted, as published counts do.

>>> node_flops(graph.select(op='linear')[0])              # doctest: +SKIP
2 * 8 * 64 * 256
"""

from __future__ import annotations

import math
from typing import Sequence

from nbscaler.ir.graph import IRNode


def attention_flops(q: Sequence[int], k: Sequence[int], v: Sequence[int]) -> float:
    """Forward FLOPs of attention on queries ``(..., h, t, d)``, keys ``(..., hk, s, d)`` and values
    ``(..., hk, s, e)``: the scores ``q k^T`` (``2 t s d`` per head) and ``p v`` (``2 t s e``)."""
    *lead, t, d = q
    s, e = k[-2], v[-1]
    return float(2 * math.prod(lead) * t * s * (d + e))


def node_flops(node: IRNode) -> float:
    if node.op == "attention":
        return attention_flops(*(tuple(t.shape) for t in node.inputs[:3]))
    out_elems = sum(math.prod(t.shape) for t in node.output_tensors)
    ann = node.annotation
    if ann is None:
        return float(out_elems + sum(math.prod(t.shape) for t in node.inputs))
    reduced = math.prod(ann.sizes.get(name, 1) for name in ann.reduce
                        if all(name not in (o or ()) for o in ann.outputs))
    if node.op == "conv":                      # the kernel window is a reduction too
        w = node.inputs[1]
        reduced = math.prod(w.shape[1:])
    return float(out_elems * (2 * reduced if reduced > 1 else 1))
