"""What routed-experts ops are, and how a plan splits them: by expert over expert groups
(expert parallelism), by hidden unit (tensor parallelism inside the experts), or both; which
experts and hidden units a device holds; what their all-to-alls carry. The experts ops themselves
live in ``nbscaler.experts``; their annotations with the other ops' (``nbscaler.ir.registry``).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from nbscaler.ir.graph import EXPERT_HIDDEN_PARTS, EXPERT_PARALLEL, IRGraph, IRNode, IRTensor
from nbscaler.ir.shape_rules import VIEW_OPS
from nbscaler.layouts import EXPERT_SPLIT


EXPERT_OPS = {"nbscaler.experts.routing.dropless_experts": "expert_parallel_dropless",
              "nbscaler.experts.routing.capacity_experts": "expert_parallel_capacity"}
"""Each op of routed experts, and the function of ``nbscaler.runtime.experts`` that runs it expert-parallel."""
EXPERT_WEIGHTS = (3, 4, 5)
"""The inputs of an expert op that are its experts' weights (``w1``, ``w3``, ``w2``; dim 0 the experts)."""


def expert_weight_views(graph: IRGraph, node: IRNode) -> List[Tuple[IRTensor, List[IRNode]]]:
    """For each weight of expert op ``node`` (``EXPERT_WEIGHTS``), the tensor it is stored as (a
    parameter, or whatever the views start from) and the view ops between, nearest the op first
    (none for nbscaler's own experts, whose weights are parameters)."""
    producers = {id(t): p for p in graph.nodes for t in p.output_tensors}
    chains = []
    for i in EXPERT_WEIGHTS:
        t, views = node.inputs[i], []
        while (p := producers.get(id(t))) is not None and p.op in VIEW_OPS and len(p.inputs) == 1:
            views.append(p)
            t = p.inputs[0]
        chains.append((t, views))
    return chains


def expert_weight_sources(graph: IRGraph, node: IRNode) -> List[IRTensor]:
    """The stored tensors behind expert op ``node``'s weights, each once, in order: ``w1``, ``w3``,
    ``w2`` themselves, or Hugging Face's ``gate_up_proj`` and ``down_proj``."""
    seen: Dict[str, IRTensor] = {}
    for t, _ in expert_weight_views(graph, node):
        seen.setdefault(t.name, t)
    return list(seen.values())


def expert_parallel(node: IRNode) -> Optional[str]:
    """The function of ``nbscaler.runtime.experts`` that runs ``node`` with its experts split over its
    devices (``None`` when it does not)."""
    place = node.placement
    if not node.meta.get(EXPERT_PARALLEL) or place is None or place.split is None:
        return None
    return EXPERT_OPS[node.target]


def expert_tensor_parallel(node: IRNode) -> bool:
    """Whether routed-experts ``node`` is split along its experts' hidden width (tensor parallelism
    inside each expert: ``w1``, ``w3`` column-wise, ``w2`` row-wise). Its output is then a partial
    sum, but unlike a linear's bias its other inputs (the tokens, the router's weights and choices)
    are factors of every part, so each device reads them whole and their gradients are summed."""
    place = node.placement
    if node.target not in EXPERT_OPS or place is None or place.split is None or node.meta.get(EXPERT_PARALLEL):
        return False
    return place.split == node.annotation.inputs[EXPERT_WEIGHTS[0]][-1]


def expert_hidden_parts(node: IRNode) -> int:
    """How many parts each expert's hidden units are cut into on ``node``'s devices: those of
    tensor parallelism inside an expert-parallel op (``EXPERT_HIDDEN_PARTS``), all of them for
    tensor-parallel experts, 1 otherwise."""
    if expert_parallel(node):
        return node.meta.get(EXPERT_HIDDEN_PARTS, 1)
    return node.placement.parts if expert_tensor_parallel(node) else 1


def expert_groups(node: IRNode) -> int:
    """How many groups ``node``'s experts are split into by expert parallelism (1 without it)."""
    return len(node.placement.devices) // expert_hidden_parts(node) if expert_parallel(node) else 1


def routed_imbalance(node: IRNode, imbalance: float) -> float:
    """The work of expert op ``node`` on the busiest device over a balanced routing's, for a routing
    whose busiest expert-parallel device gets ``imbalance`` times the mean of the (token, expert)
    pairs: that for a dropless expert-parallel op, 1 otherwise (capacity buffers have fixed sizes,
    and a device holding every expert multiplies all of its own pairs however they fall)."""
    dropless = node.target.endswith("dropless_experts")
    return imbalance if dropless and expert_parallel(node) else 1.0


def expert_count(node: IRNode) -> int:
    """How many routed experts expert op ``node`` has (dim 0 of its weights)."""
    return node.inputs[EXPERT_WEIGHTS[0]].shape[0]


def expert_top_k(node: IRNode) -> int:
    """How many experts expert op ``node`` routes each token to (the last dim of its chosen experts)."""
    return node.inputs[2].shape[-1]


def expert_routing(node: IRNode) -> str:
    """``'dropless'`` or ``'capacity'``: how expert op ``node`` routes (``nbscaler.experts.routing``)."""
    return "capacity" if node.target.endswith("capacity_experts") else "dropless"


def held_experts(node: IRNode, device: Optional[int] = None) -> range:
    """The experts of expert op ``node`` that plan ``device`` holds: ``r*E/N .. (r+1)*E/N - 1`` for the
    ``r``-th of the ``N`` devices of an expert-parallel op (``nbscaler.experts.parallel``), every
    expert otherwise (or for ``device=None``, the whole op)."""
    experts = expert_count(node)
    if device is None or not expert_parallel(node):
        return range(experts)
    index = node.placement.devices.index(device) // expert_hidden_parts(node)
    return expert_range(experts, expert_groups(node), index)


def held_hidden_units(node: IRNode, device: Optional[int] = None) -> range:
    """The hidden units of each held expert of expert op ``node`` that plan ``device`` holds: its
    share where the experts are cut by hidden unit (``expert_hidden_parts``), all of them otherwise
    (or for ``device=None``)."""
    hidden, parts = node.inputs[EXPERT_WEIGHTS[0]].shape[-1], expert_hidden_parts(node)
    if device is None or parts == 1:
        return range(hidden)
    return expert_range(hidden, parts, node.placement.devices.index(device) % parts)


def expert_range(experts: int, parts: int, index: int) -> range:
    """The experts the ``index``-th of ``parts`` devices holds of ``experts`` split by expert
    parallelism: ``index*E/parts .. (index+1)*E/parts - 1``."""
    mine = experts // parts
    return range(index * mine, (index + 1) * mine)


def expert_splits(graph: IRGraph) -> Dict[str, str]:
    """Op name -> ``EXPERT_SPLIT`` for every expert-parallel op of ``graph`` (``expert_parallel``):
    the views name its split by what it cuts (``nbscaler.glossary.split_name``). Empty without
    expert parallelism."""
    return {node.name: EXPERT_SPLIT for node in graph.nodes if expert_parallel(node)}


def exchanged_bytes(node: IRNode) -> int:
    """The bytes of rows each all-to-all of expert-parallel ``node`` sends from one device and gets
    back, for routing that loads every expert alike: each of its pairs (dropless), or each slot of
    its capacity buffers (``nbscaler.experts.parallel``), once to every device of its expert's group
    where the experts' hidden units are cut too."""
    x, experts = node.inputs[0], node.inputs[2]
    parts, copies = node.placement.parts, expert_hidden_parts(node)
    if node.target.endswith("capacity_experts"):
        slots_per_token = node.inputs[EXPERT_WEIGHTS[0]].shape[0] * node.args[6] / x.shape[1]    # E * capacity / t
        return round(x.nbytes / parts * slots_per_token) * copies
    return x.nbytes // parts * experts.shape[-1] * copies


def exchanged_counts_bytes(node: IRNode) -> int:
    """The bytes of the per-expert counts an expert-parallel dropless ``node`` exchanges before its
    rows (0 for capacity routing, whose buffers have fixed sizes)."""
    if node.target.endswith("capacity_experts"):
        return 0
    return node.inputs[EXPERT_WEIGHTS[0]].shape[0] * 8 * expert_hidden_parts(node)   # one int64 per expert and copy
