"""Staging: cut the graph into pipeline stages.

A stage is a contiguous run of nodes (in graph order, so data only flows to the same or later
stages). ``stage_by_cost`` balances the stages by the estimated FLOPs of their ops, not by their
number, and prefers to cut where the top-level module changes (between ``blocks.3`` and
``blocks.4``) so that a layer is not torn in half. Tensors that skip stages are carried through the
stages in between by code generation; policies need not care.

``stage_by_layers`` instead gives every stage the same number of the model's repeated layers, the
ops before them to the first stage and those after them to the last, as Megatron-LM splits a
model (``pas_config={"pipeline_split": "layers"}`` for ``pp`` and ``hybrid``; ``PipelineSplit``).

>>> stage_by_cost(graph, 4)                             # doctest: +SKIP
[0, 0, ..., 3]
>>> set_stage(graph.select(module='head'), 3)           # doctest: +SKIP
"""

from __future__ import annotations

import itertools
from typing import Iterable, List, Sequence

from nbscaler.columns import StrEnum
from nbscaler.cost.flops import node_flops
from nbscaler.ir.graph import IRGraph, IRNode
from nbscaler.policy.primitives import PolicyError


def set_stage(nodes: Iterable[IRNode], stage: int) -> None:
    """Put ``nodes`` in pipeline stage ``stage``."""
    for node in nodes:
        node.stage = stage


def layer_of(path: str) -> str:
    """'gpt.blocks.3.attn.q' -> 'gpt.blocks.3': the unit a cut should not split (the path up to the
    first list index, or the first name when there is none)."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 1])
    return parts[0]


class PipelineSplit(StrEnum):
    """How a pipeline policy cuts the model into stages (``pas_config["pipeline_split"]``)."""

    FLOPS = "flops"        # each stage about 1 / nstages of the FLOPs, cut between layers (the default)
    LAYERS = "layers"      # each stage the same number of repeated layers (Megatron-LM's split)


def stage_by(split: str, graph: IRGraph, nstages: int) -> List[int]:
    """``stage_by_cost`` or ``stage_by_layers``, as ``split`` (a ``PipelineSplit``) says."""
    return stage_by_layers(graph, nstages) if PipelineSplit(split) == PipelineSplit.LAYERS else stage_by_cost(graph, nstages)


def stage_by_layers(graph: IRGraph, nstages: int) -> List[int]:
    """Assign every node a stage so that each stage holds ``L / nstages`` of the model's ``L``
    repeated layers (paths with a list index, ``layer_of``); the ops before the first layer go to
    the first stage, those after the last to the last. Raises ``PolicyError`` when ``nstages`` does
    not divide ``L``."""
    layers = [layer_of(n.module_path) for n in graph.nodes]
    order = list(dict.fromkeys(x for x in layers if x.rsplit(".", 1)[-1].isdigit()))
    if not order or len(order) % nstages:
        raise PolicyError(f"pipeline_split='layers' gives each of the {nstages} stages the same number of repeated "
                          f"layers, but the model has {len(order)}; use a number of stages that divides it, or "
                          f"pipeline_split='flops'.")
    per_stage, index = len(order) // nstages, {layer: i for i, layer in enumerate(order)}
    stages, current = [], 0
    for node, layer in zip(graph.nodes, layers):
        if layer in index:                           # between layers, and after the last, an op stays
            current = index[layer] // per_stage      # with the layer before it
        node.stage = current
        stages.append(current)
    return stages


def stage_by_cost(graph: IRGraph, nstages: int) -> List[int]:
    """Assign every node a stage so that each stage has about ``1 / nstages`` of the FLOPs.

    Returns the stage of each node, in graph order.
    """
    nodes = graph.nodes
    if nstages > len(nodes):
        raise PolicyError(f"cannot cut {len(nodes)} ops into {nstages} pipeline stages; use fewer stages.")
    cuts = stage_cuts([node_flops(n) for n in nodes], [layer_of(n.module_path) for n in nodes], nstages)
    stages = []
    for i, node in enumerate(nodes):
        node.stage = sum(1 for c in cuts if i >= c)
        stages.append(node.stage)
    return stages


def stage_cuts(flops: Sequence[float], layers: Sequence[str], nstages: int) -> List[int]:
    """Where ``stage_by_cost`` cuts a run of ops of ``flops`` in ``layers`` (``layer_of`` their
    modules): the index of the first op of each stage after the first. A sweep asks it for a model
    it never builds whole, from one layer's ops repeated."""
    cum = list(itertools.accumulate(max(f, 1.0) for f in flops))
    total = cum[-1]
    # cut before op i; prefer places where the layer changes
    layer_cuts = [i for i in range(1, len(layers)) if layers[i] != layers[i - 1]]
    cuts: List[int] = []
    for k in range(1, nstages):
        target = total * k / nstages
        low = cuts[-1] + 1 if cuts else 1
        high = len(layers) - (nstages - k)         # leave at least one op per later stage
        options = [i for i in layer_cuts if low <= i <= high] or list(range(low, high + 1))
        cuts.append(min(options, key=lambda i: abs(cum[i - 1] - target)))
    return cuts
