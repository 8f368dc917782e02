"""The cost pass: write each node's FLOPs and bytes onto ``node.meta``, as fx's shape propagation does.

After ``annotate_costs(graph)`` every node carries:

=================  ==============================================================================
``flops_fwd``      forward FLOPs of the whole op (``node_flops``)
``flops_bwd``      backward FLOPs (``backward_flops``): one forward's worth for each input that
                   receives a gradient (a linear whose input and weight both need gradients costs
                   two forwards back, its bias nothing); attention's gradients are four products,
                   two forwards' worth; an embedding's a scatter-add, one addition an output element
``bytes_read``     bytes of the op's tensor inputs, whole
``bytes_written``  bytes of its tensor outputs, whole
``local_flops_fwd`` / ``local_flops_bwd``
                   the same per device that runs it, once the node is placed (a split op's share)
``product``        whether its FLOPs are a matrix product's (``cost.products``), which a GPU runs
                   at its matmul rate; the others run at its vector rate (``cost.roofline``)
``causal_fraction`` the share of an attention's FLOPs a causal kernel performs
                   (``flops.attention_causal_fraction``; 1.0 for every other op)
``into_add``       whether the op's one output is read by a residual add alone (a dropout there
                   fuses with the add where the software fuses bias-dropout-add)
``fused_reads`` / ``fused_write``
                   what a compiled element-wise chain keeps out of memory (``cost.fusion``)
=================  ==============================================================================

The IR never imports this module: views, autodist and the Plan read the facts from ``node.meta``.

>>> annotate_costs(graph)                                     # doctest: +SKIP
>>> graph.nodes[0].meta["flops_fwd"], graph.nodes[0].meta["bytes_read"]
(8388608.0, 1310720)
"""

from __future__ import annotations

from nbscaler.cost.flops import attention_causal_fraction, backward_flops, node_flops
from nbscaler.cost.fusion import FUSION_KEYS, annotate_fusion
from nbscaler.cost.products import is_product
from nbscaler.ir.float8_layers import is_linear_layer
from nbscaler.ir.graph import IRGraph, requires_grad_of

COST_KEYS = ("flops_fwd", "flops_bwd", "bytes_read", "bytes_written", "local_flops_fwd", "local_flops_bwd",
             "product", "causal_fraction", "into_add", *FUSION_KEYS, "linear_layer")
ADD_TARGETS = frozenset({"Tensor.add", "Tensor.__add__", "Tensor.__radd__", "torch.add", "_operator.add"})


def annotate_costs(graph: IRGraph) -> IRGraph:
    """Write the cost facts above onto every node of ``graph`` (placed or not); returns ``graph``."""
    grad = requires_grad_of(graph)
    readers = graph.consumers()
    layers = set(graph.meta["linear_modules"]) if "linear_modules" in graph.meta else None
    for node in graph.nodes:
        outs = node.output_tensors
        read_by = readers.get(id(outs[0]), []) if len(outs) == 1 else []
        fwd = node_flops(node)
        bwd = backward_flops(node, fwd, lambda t: grad.get(id(t), False))
        parts = node.placement.work_parts if node.placement is not None else 1
        node.meta.update(
            flops_fwd=fwd, flops_bwd=bwd,
            bytes_read=sum(t.nbytes for t in node.inputs),
            bytes_written=sum(t.nbytes for t in node.output_tensors),
            local_flops_fwd=fwd / parts, local_flops_bwd=bwd / parts, product=is_product(node),
            causal_fraction=attention_causal_fraction(node),
            into_add=len(read_by) == 1 and read_by[0].target in ADD_TARGETS,
            linear_layer=None if layers is None else is_linear_layer(node, layers))
    return annotate_fusion(graph)
