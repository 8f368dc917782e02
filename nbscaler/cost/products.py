"""Which ops are matrix products: the ops whose FLOPs run at a GPU's matmul rate.

A GPU runs a matrix product on its tensor cores and everything else on its vector units, an order
of magnitude slower (``Hardware.vector_flops``). Whether an op is a product is read from what it
computes, not from a list of kinds, so no spelling of a product is missed (``linear``, ``matmul``,
``bmm``, GPT-2's ``addmm``, ``baddbmm``, a convolution, an ``einsum``, a user's ``register_op``,
routed experts and ``torch._grouped_mm``, whose annotations keep every axis whole):
an op is a product when two of its inputs share an axis it sums over and each has an axis the other
lacks (``m k, k n -> m n``; the output keeps ``m`` and ``n``). A dot product (``k, k ->``), a
loss summed over samples (``n c, n ->``) or a sum are not: they read each element once. A
convolution is a product of its data and its kernel whatever its groups (each group is one).

>>> product_operands(graph.select(op="addmm")[0])          # doctest: +SKIP
(1, 2)
"""

from __future__ import annotations

from typing import Sequence, Tuple

from nbscaler.cost.einsum import EINSUM_TARGET, einsum_contracts
from nbscaler.ir.graph import IRNode
from nbscaler.ir.expert_rules import EXPERT_OPS, EXPERT_WEIGHTS

GROUPED_MM = "torch._grouped_mm"
"""Hugging Face's experts' grouped product: rows sorted by expert ``(m, a)`` by weights ``(E, a, b)``."""


def product_operands(node: IRNode) -> Tuple[int, ...]:
    """The inputs ``node`` multiplies as a matrix product (each one's gradient is one more product
    of the forward's size); ``()`` when it is no product. Attention is priced on its own."""
    if node.op == "attention":
        return ()
    if node.op == "conv":
        return (0, 1)
    if node.target in EXPERT_OPS:         # each row by its experts' weights (``cost.flops.expert_flops``)
        return (0,) + EXPERT_WEIGHTS
    if node.target == GROUPED_MM:         # rows sorted by expert, by the experts' weights
        return (0, 1)
    if node.target == EINSUM_TARGET:
        shapes = [tuple(t.shape) for t in node.inputs]
        return tuple(range(len(shapes))) if einsum_contracts(node.args[0], shapes) else ()
    ann = node.annotation
    return () if ann is None else contracted_inputs([set(n or ()) for n in ann.inputs], ann.reduce,
                                                    {n for names in ann.outputs for n in names or ()})


def contracted_inputs(inputs: Sequence[set], reduce: frozenset, outputs: set) -> Tuple[int, ...]:
    """Indices of the inputs (each a set of axis names) that take part in a contraction: a pair that
    shares a summed axis (in ``reduce``, not in ``outputs``) and where each has an axis the other lacks."""
    summed = set(reduce) - outputs
    found = set()
    for i, a in enumerate(inputs):
        for j in range(i + 1, len(inputs)):
            b = inputs[j]
            if a & b & summed and a - b and b - a:
                found.update((i, j))
    return tuple(sorted(found))


def is_product(node: IRNode) -> bool:
    """Whether ``node``'s FLOPs run at the matmul rate (``product_operands``)."""
    return bool(product_operands(node))
