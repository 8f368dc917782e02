"""The batch split: every op along the batch axis of the forward's inputs (dim 0), followed
through the graph; the ``data`` policy, and expert parallelism's layers around the experts."""

from __future__ import annotations

from typing import Callable, Dict, Tuple

from nbscaler.ir.graph import IRGraph, IRNode, Placement
from nbscaler.ir.layer_rules import splits_mean_loss
from nbscaler.policy.primitives import PolicyError, partition, replicate


def split_batch(graph: IRGraph, devices_of: Callable[[IRNode], Tuple[int, ...]], why: str) -> IRGraph:
    """Split each op of ``graph`` over ``devices_of(node)`` along the axis its batch-carrying input
    has it on (replicate an op that has none). A batch that does not divide over the devices is
    refused; ``why`` names what asked for the split, for that message."""
    n = len(devices_of(graph.nodes[0])) if graph.nodes else 1
    batch_inputs = {id(t) for t in graph.inputs if t.ndim and t.shape[0] % n == 0}
    sizes = sorted({t.shape[0] for t in graph.inputs if t.ndim})
    if n > 1 and sizes and not batch_inputs:
        raise PolicyError(f"{why} splits the batch over the {n} devices of a unit, but no input's first "
                          f"dimension divides by {n} (batch size{'s' if len(sizes) > 1 else ''} "
                          f"{', '.join(map(str, sizes))}), so every op would run whole on every device: trace "
                          f"with a batch that is a multiple of {n} (e.g. {-(-sizes[0] // n) * n}), or set "
                          f"plan_ngpus to a divisor of {sizes[0]} (and runtime_ngpus to a multiple of it).")
    batch_dim: Dict[int, int] = {i: 0 for i in batch_inputs}
    for node in graph.nodes:
        devices = devices_of(node)
        choice = None
        if node.annotation is not None and len(devices) > 1:
            for i, t in enumerate(node.inputs):
                d = batch_dim.get(id(t))
                if d is not None:
                    name = node.annotation.inputs[i][d]
                    if node.annotation.can_split(name, len(devices)) is None:
                        choice = name
                        break
        if choice is None and _split_mean_loss(node, batch_dim, len(devices)):
            node.placement = Placement(tuple(devices), "n")     # each device's part of the mean, summed after
            continue
        if choice is None:
            replicate(node, devices)
            continue
        partition(node, choice, devices)
        _, out_dims = node.annotation.split_dims(choice)
        for t, d in zip(node.output_tensors, out_dims):
            if d is not None:
                batch_dim[id(t)] = d
    return graph


def _split_mean_loss(node: IRNode, batch_dim: Dict[int, int], n: int) -> bool:
    """Whether ``node`` is a plain mean cross-entropy whose ``(N, C)`` logits arrive split along
    their rows: each device then computes its rows' part of the mean over the group's token count
    (``nbscaler.runtime.losses.split_cross_entropy``), where gathering the logits would bring every
    device the whole batch's ``(N, C)``, a vocabulary wide."""
    if n == 1 or node.op != "loss" or not node.inputs:
        return False
    return splits_mean_loss(node, batch_dim.get(id(node.inputs[0]))) and node.inputs[0].shape[0] % n == 0
