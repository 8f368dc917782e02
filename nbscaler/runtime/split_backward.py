"""A stage's backward in two passes: input gradients now (``B``), weight gradients later (``W``).

Autograd runs a stage's backward as one graph walk from its outputs. ``B`` asks it only for the
gradients of the stage's inputs (``torch.autograd.grad(..., inputs=stage inputs)``): it walks the
*data path*, the nodes that lead to an input, and computes no weight gradient. Where the data path
touches a weight (a matmul node has an edge to its input and one to its weight) ``B`` records the
gradient that reached that node. ``W`` then starts from each such node with the recorded gradient
and asks only for the weights on that node's *weight side*, so it runs the weight branches and
nothing of the data path again, collectives included:

::

    outputs -> ... -> [mm]  -> ... -> [mm] -> stage input        B: the data path, grads recorded at [mm]
                        \\                \\
                         W2                W1                      W: from each [mm], its own weights only

That split holds when a node's own weights are not also reached through its data edges (a weight
used twice along the path); then ``W`` walks again from the outputs to the weights, which is
correct but repeats the data path. :func:`split` decides which, per stage and micro-batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

Roots = Tuple[List[torch.Tensor], List[Optional[torch.Tensor]]]     # tensors and their output gradients


@dataclass
class _Start:
    """Where ``W`` starts: a node on the data path (``grads`` recorded there by ``B``), or an
    output whose whole graph is on the weight side (``tensor``)."""

    weights: List[torch.Tensor]
    node: Optional[Node] = None
    recorded: List[Tuple[Optional[torch.Tensor], ...]] = field(default_factory=list)    # B's hook fills it
    tensor: Optional[torch.Tensor] = None
    grad: Optional[torch.Tensor] = None


@dataclass
class WeightPass:
    """What ``W`` runs: either the recorded starts, or (``whole``) a second walk from the outputs.

    Only a ``whole`` pass keeps the stage's outputs (``roots``): the starts hold their nodes, and
    through them everything below, which is all ``W`` walks. What lies above the highest start
    (the loss and its saved log-softmax on the last stage) dies with ``B``, as nothing refers to it.
    """

    roots: Roots
    weights: List[torch.Tensor]
    starts: List[_Start] = field(default_factory=list)
    whole: bool = False

    def run(self) -> None:
        """Accumulate the weights' gradients into ``.grad`` (their hooks fire), then let go."""
        if self.whole:
            tensors, grads = self.roots
            if tensors:
                torch.autograd.backward(tensors, grads, inputs=self.weights)
        for start in self.starts:
            if start.tensor is not None:
                torch.autograd.backward([start.tensor], [start.grad], inputs=start.weights)
                continue
            edges = [(GradientEdge(start.node, i), g) for i, g in enumerate(start.recorded[-1]) if g is not None]
            if edges:
                torch.autograd.backward([e for e, _ in edges], [g for _, g in edges], inputs=start.weights)
        self.starts, self.roots = [], ([], [])


def _children(node: Node) -> List[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def _graph(roots: Sequence[Node]) -> List[Node]:
    """Every node below ``roots``, each after all the nodes above it that reach it (reverse
    post-order), so a pass in reverse sees a node's children first."""
    order: List[Node] = []
    seen: Set[Node] = set()
    for root in roots:
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if node in seen:
                continue
            seen.add(node)
            stack.append((node, True))
            stack += [(child, False) for child in _children(node) if child not in seen]
    return order[::-1]


def _below(order: List[Node], marks: Dict[Node, frozenset]) -> Dict[Node, frozenset]:
    """For every node, the union of ``marks`` of itself and of every node below it."""
    below: Dict[Node, frozenset] = {}
    for node in reversed(order):
        found = set(marks.get(node, ()))
        for child in _children(node):
            found |= below[child]
        below[node] = frozenset(found)
    return below


def split(roots: Roots, inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> Tuple[
        List[Optional[torch.Tensor]], WeightPass]:
    """``B``: the gradients of ``inputs`` (``None`` where none flows), and the ``W`` still to run."""
    tensors, grads = roots
    if not tensors:
        return [None] * len(inputs), WeightPass(roots, list(weights))
    by_node = {get_gradient_edge(w).node: w for w in weights}
    root_nodes = [t.grad_fn for t in tensors]
    order = _graph([n for n in root_nodes if n is not None])
    input_nodes = {get_gradient_edge(t).node for t in inputs}
    leads_to_input = _below(order, {n: frozenset([0]) for n in input_nodes})
    weights_below = _below(order, {n: frozenset([id(n)]) for n in by_node})
    on_path = {n for n in order if leads_to_input[n]}
    starts, hooks, whole = [], [], any(n is None for n in root_nodes)
    for node in (n for n in order if n in on_path):
        side = [c for c in _children(node) if c not in on_path]
        own = frozenset().union(*(weights_below[c] for c in side)) if side else frozenset()
        if not own:
            continue
        data = frozenset().union(*(weights_below[c] for c in _children(node) if c in on_path))
        whole = whole or bool(own & data)
        start = _Start([by_node[n] for n in by_node if id(n) in own], node=node)
        hooks.append(node.register_prehook(_recorder(start.recorded)))
        starts.append(start)
    for tensor, grad, node in zip(tensors, grads, root_nodes):
        if node is not None and node not in on_path and weights_below[node]:
            starts.append(_Start([by_node[n] for n in by_node if id(n) in weights_below[node]], tensor=tensor, grad=grad))
    try:
        found = (torch.autograd.grad(tensors, list(inputs), grads, retain_graph=True, allow_unused=True)
                 if inputs and on_path else [None] * len(inputs))
    finally:
        for hook in hooks:
            hook.remove()
    if whole or any(s.node is not None and not s.recorded for s in starts):
        return list(found), WeightPass(roots, list(weights), whole=True)
    return list(found), WeightPass(([], []), list(weights), starts)


def _recorder(recorded: list):
    """A pre-hook that keeps the gradients reaching its node. It holds a plain list, not the node:
    a hook that referred to its own node would keep the graph, and every activation saved in it,
    alive after ``W``."""
    def record(grad_outputs):
        recorded.append(tuple(grad_outputs))
    return record
