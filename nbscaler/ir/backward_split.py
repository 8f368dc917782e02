"""Which part of a split backward each op's gradient belongs to: ``B``, ``W`` or both.

Zero-bubble schedules (``zb_h1``, ``zbv``) run a stage's backward in two blocks. ``B`` computes the
gradient of the stage's input, which the previous stage waits for: it walks the *data path*, the
ops between the tensors that came in from the previous stage and the stage's outputs. ``W``
computes the gradients of the weights, later: the branches that leave the data path towards a
weight. An op's backward therefore falls in

- ``B``: it is on the data path and reads no weight-side tensor (an activation, a residual add);
- ``B+W``: it is on the data path and also reads a weight-side tensor (a linear's input gradient
  ``dY W^T`` is in ``B``, its weight gradient ``X^T dY`` in ``W``);
- ``W``: its inputs carry gradients to weights only (a transposed weight, every op of the first
  stage, whose input is data with no gradient);
- nothing (``""``): no input carries a gradient.

This is what the runtime does (``nbscaler.runtime.split_backward``), read from the IR: the pass
writes ``node.meta['backward_part']`` (a :class:`BackwardPart`) on every node of a staged graph.
Where a weight is read twice along the data path the runtime's ``W`` walks the data path again
(correct, slower); the labels still say where each gradient is wanted.

>>> mark_backward_split(graph)                                # doctest: +SKIP
>>> graph.nodes[5].meta["backward_part"]                      # doctest: +SKIP
<BackwardPart.BOTH: 'B+W'>
"""

from __future__ import annotations

from typing import Dict, List, Set

from nbscaler.columns import StrEnum
from nbscaler.ir.graph import IRGraph, requires_grad_of

KEY = "backward_part"
"""The ``node.meta`` key this pass writes."""


class BackwardPart(StrEnum):
    """The block of a split backward that runs an op's gradient."""

    B = "B"
    W = "W"
    BOTH = "B+W"
    NONE = ""


def mark_backward_split(graph: IRGraph) -> None:
    """The pass: ``node.meta['backward_part']`` for every node, per the stage it is in (nodes
    without a stage form one stage: no data path, every gradient in ``W``)."""
    for node, part in zip(graph.nodes, backward_parts(graph)):
        node.meta[KEY] = part


def backward_parts(graph: IRGraph) -> List[BackwardPart]:
    """The :class:`BackwardPart` of each node of ``graph``, in node order (what the pass writes)."""
    grad = requires_grad_of(graph)
    stage_of: Dict[int, object] = {}                 # tensor id -> the stage of its producer
    on_path: Set[int] = set()                        # tensors on their stage's data path
    parts: List[BackwardPart] = []
    for node in graph.nodes:
        path_in = [t for t in node.inputs if grad.get(id(t), False) and
                   (id(t) in on_path or stage_of.get(id(t), node.stage) != node.stage)]
        side_in = [t for t in node.inputs if grad.get(id(t), False) and t not in path_in]
        parts.append(BackwardPart.BOTH if path_in and side_in else BackwardPart.B if path_in
                     else BackwardPart.W if side_in else BackwardPart.NONE)
        for t in node.output_tensors:
            stage_of[id(t)] = node.stage
            if path_in and grad.get(id(t), False):
                on_path.add(id(t))
    return parts
