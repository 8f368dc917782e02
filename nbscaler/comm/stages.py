"""What crosses each pipeline stage boundary.

Boundary ``s`` sits between stage ``s`` and ``s + 1``. A tensor crosses it when it is made in a stage
at or before ``s`` and read in a stage after it (or returned by the module, which the last stage
does). A tensor that skips stages is thereby *carried* through every stage in between, so each
stage only ever talks to its neighbours. Graph inputs never cross: every rank has the sample.
Tensors cross replicated: whatever layout a stage leaves them in, it gathers them first.

>>> [[t.name for t in c] for c in stage_carries(graph, 3)]          # doctest: +SKIP
[['add_2'], ['add_5', 'embedding_0']]
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

from nbscaler.ir.graph import IRGraph, IRNode, IRTensor


def stage_carries(graph: IRGraph, nstages: int,
                  stage_of: Optional[Callable[[IRNode], int]] = None) -> List[List[IRTensor]]:
    """For each boundary ``0 .. nstages - 2``, the activations that cross it, in a fixed order.
    ``stage_of``: each node's stage, where it is not ``node.stage`` (a cut the graph is not placed
    with, as the plan space prices one)."""
    stage_of = stage_of or (lambda node: node.stage)
    made: Dict[int, int] = {}
    last_use: Dict[int, int] = {}
    tensors: Dict[int, IRTensor] = {}
    for node in graph.nodes:
        for t in node.output_tensors:
            made.setdefault(id(t), stage_of(node))
            tensors[id(t)] = t
        for t in node.inputs:
            if id(t) in made:
                last_use[id(t)] = max(last_use.get(id(t), -1), stage_of(node))
    for t in graph.output_tensors():
        if id(t) in made:
            last_use[id(t)] = nstages - 1
    return [[tensors[i] for i in made if made[i] <= s < last_use.get(i, -1)] for s in range(nstages - 1)]
