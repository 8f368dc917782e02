"""Expert parallelism: a stage's experts split over its devices, the rest of it split by batch.

``pas_config={"expert_parallel": n}`` under ``tp`` or ``hybrid`` gives each of a stage's ``n``
devices ``E/n`` of every routed-experts op's ``E`` experts (``nbscaler.experts``: dim 0 of their
weights, whose gradients then need no sum inside the unit) and its share of the batch for every
other op, whose weights stay whole with their gradients summed over the devices, as the ``data``
policy places them. Inside the experts op each device sends every (token, expert) pair to the
device that holds its expert and gets the result back (two all-to-alls forward, two backward:
``nbscaler.experts.parallel``).

With ``pas_config={"expert_parallel": n, "expert_tensor_parallel": p}`` the stage's ``n * p``
devices are ``n`` expert groups of ``p``: each group holds ``E/n`` experts, each of its devices
``1/p`` of their hidden units (``w1``, ``w3`` by column, ``w2`` by row), as Megatron-LM's expert
tensor parallelism cuts them. A pair goes to every device of its expert's group, and the ``p``
partial sums that come back are added (``nbscaler.experts.parallel``).

With ``pas_config={"expert_parallel": n, "around_experts": "tp"}`` the layers around the experts are
tensor-parallel instead, Megatron-style, over the same devices: every device holds the whole batch
there, so each takes its ``1/n`` of the tokens into the experts op (a slice, no traffic) and the
op's output is all-gathered back, as Megatron-LM runs its expert layers beside tensor parallelism.
Context and sequence parallelism are not combined with it yet.
"""

from __future__ import annotations

import enum
from typing import Callable, Sequence, Tuple

from nbscaler.config import ComputeConfig
from nbscaler.ir.graph import EXPERT_HIDDEN_PARTS, EXPERT_PARALLEL, IRGraph, IRNode
from nbscaler.ir.expert_rules import EXPERT_OPS, EXPERT_WEIGHTS, expert_weight_views
from nbscaler.policy.batch import split_batch
from nbscaler.policy.primitives import PolicyError, partition, partition_grid, replicate

EXPERT_PARALLEL_KEY = "expert_parallel"
"""The ``pas_config`` key of expert parallelism: the devices a stage's experts are split over."""
EXPERT_TENSOR_PARALLEL_KEY = "expert_tensor_parallel"
"""The ``pas_config`` key of tensor parallelism inside expert-parallel experts: the devices of each
expert group, which cut its experts' hidden units."""
AROUND_EXPERTS_KEY = "around_experts"
"""The ``pas_config`` key of how expert parallelism splits the layers around the experts (``AroundExperts``)."""


class AroundExperts(str, enum.Enum):
    """How the layers around an expert-parallel op are split over its devices."""

    DATA = "data"               # by batch: each device routes its own share of the tokens
    TP = "tp"                   # Megatron-style tensor parallelism: each device takes 1/n of the tokens in


def around_experts(cfg: ComputeConfig) -> AroundExperts:
    """``pas_config['around_experts']``, checked (default ``'data'``)."""
    value = cfg.pas_config.get(AROUND_EXPERTS_KEY, AroundExperts.DATA.value)
    if value not in {a.value for a in AroundExperts}:
        raise ValueError(f"pas_config['{AROUND_EXPERTS_KEY}']={value!r} is invalid: give "
                         f"{' or '.join(repr(a.value) for a in AroundExperts)} (how the layers around the experts "
                         "are split over their devices).")
    return AroundExperts(value)


def expert_parallel(cfg: ComputeConfig) -> int:
    """The expert-parallel size ``cfg`` asks for (``pas_config['expert_parallel']``; 1: none)."""
    return _size(cfg, EXPERT_PARALLEL_KEY, "each stage's experts are split over")


def expert_tensor_parallel_size(cfg: ComputeConfig) -> int:
    """The devices of each expert group ``cfg`` asks for (``pas_config['expert_tensor_parallel']``; 1: none)."""
    return _size(cfg, EXPERT_TENSOR_PARALLEL_KEY, "that cut each expert-parallel expert's hidden units")


def _size(cfg: ComputeConfig, key: str, what: str) -> int:
    """``pas_config[key]``, a count of devices, checked (1 unless given)."""
    value = cfg.pas_config.get(key, 1)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"pas_config['{key}']={value!r} is invalid: give the number of devices {what} (an int >= 1; "
                         "1 turns it off).")
    return value


def check_experts(cfg: ComputeConfig, stage_devices: int, others: Tuple[str, ...]) -> int:
    """The expert-parallel size of ``cfg``, checked against the devices of each stage and the other
    dimensions it asks for (``others``: their ``pas_config`` keys), 1 for none."""
    n, p = expert_parallel(cfg), expert_tensor_parallel_size(cfg)
    if n == 1 and p > 1:
        raise PolicyError(f"pas_config['{EXPERT_TENSOR_PARALLEL_KEY}']={p} cuts expert-parallel experts by hidden "
                          f"unit, but '{EXPERT_PARALLEL_KEY}' is not set: give both (their product the devices of a "
                          f"stage), or drop '{EXPERT_TENSOR_PARALLEL_KEY}': without expert parallelism the tp policy "
                          "already cuts every expert by hidden unit over all of a stage's devices.")
    if n == 1:
        return 1
    if others:
        raise PolicyError(f"pas_config has both '{EXPERT_PARALLEL_KEY}' and {', '.join(map(repr, others))}: expert "
                          "parallelism runs the layers around the experts split by batch, which does not combine "
                          f"with them yet; drop {' and '.join(map(repr, others))}, or '{EXPERT_PARALLEL_KEY}'.")
    if n * p != stage_devices:
        inner = f" x {EXPERT_TENSOR_PARALLEL_KEY}={p} = {n * p}" if p > 1 else ""
        fixes = [f"{EXPERT_PARALLEL_KEY}={stage_devices // p}"] if stage_devices % p == 0 and stage_devices > p else []
        fixes += ([f"{EXPERT_TENSOR_PARALLEL_KEY}={stage_devices // n} (each expert group cutting its experts by hidden "
                   "unit)"] if stage_devices % n == 0 and stage_devices // n != p else [])
        fix = "set " + ", or ".join(fixes) if fixes else f"give sizes whose product is {stage_devices}"
        raise PolicyError(f"{EXPERT_PARALLEL_KEY}={n}{inner}, but each stage has {stage_devices} devices: nbscaler "
                          "splits a stage's experts over all of its devices, in groups of "
                          f"'{EXPERT_TENSOR_PARALLEL_KEY}' (1 unless given); {fix}, or plan_ngpus to {n * p} x the "
                          "pipeline devices.")
    return n


def place_experts(graph: IRGraph, devices_of: Callable[[IRNode], Tuple[int, ...]],
                  around: Callable[[IRGraph], IRGraph] = None, hidden_parts: int = 1) -> IRGraph:
    """Split every op of ``graph`` by batch over ``devices_of(node)`` (or place it by ``around``,
    a tensor-parallel placement of the whole graph), and every routed-experts op's experts over the
    same devices, its tokens split (see the module docstring): over groups of ``hidden_parts``
    devices, each cutting its group's experts by hidden unit."""
    if around is None:
        split_batch(graph, devices_of, f"pas_config['{EXPERT_PARALLEL_KEY}']")
    else:
        around(graph)
    found = [node for node in graph.nodes if node.target in EXPERT_OPS]
    if not found:
        raise PolicyError(f"pas_config['{EXPERT_PARALLEL_KEY}'] splits routed experts over the devices, but the "
                          "model calls none: route its tokens with nbscaler.experts.dropless_experts or "
                          "capacity_experts (as nbscaler.models.moe does), or use a Hugging Face experts module "
                          "nbscaler records as one (SiLU-gated, no biases: nbscaler.experts.huggingface), or drop "
                          "the key.")
    for node in found:
        if around is not None:          # its tokens split over the devices, whatever placed the rest
            _split_tokens(node, devices_of(node))
        n, experts = len(node.placement.devices), node.inputs[EXPERT_WEIGHTS[0]].shape[0]
        if node.placement.split is None:
            raise PolicyError(f"{node.name}: expert parallelism needs its tokens split by batch over the {n} devices, "
                              "but they arrive whole; trace with a batch that divides by the devices.")
        if experts % (n // hidden_parts):
            raise PolicyError(f"{node.name} has {experts} experts, which do not split over {n // hidden_parts} "
                              f"expert groups: set {EXPERT_PARALLEL_KEY} to a divisor of {experts}.")
        node.meta[EXPERT_PARALLEL] = True
        if hidden_parts > 1:
            _cut_hidden_units(graph, node, hidden_parts)
        else:
            split_weight_views(graph, node, (0,) * len(EXPERT_WEIGHTS))
    return graph


def _cut_hidden_units(graph: IRGraph, node: IRNode, parts: int) -> None:
    """Mark expert-parallel ``node``'s experts cut by hidden unit into ``parts`` inside each expert
    group; refused by name where the hidden units do not divide, or where the weights reach the op
    through views (Hugging Face's experts), which a cut two ways cannot pass through yet."""
    hidden = node.inputs[EXPERT_WEIGHTS[0]].shape[-1]
    if hidden % parts:
        raise PolicyError(f"{node.name}: its experts have {hidden} hidden units, which do not cut into "
                          f"{EXPERT_TENSOR_PARALLEL_KEY}={parts} parts: give a divisor of {hidden}.")
    _cut_views_two_ways(graph, node, parts)
    node.meta[EXPERT_HIDDEN_PARTS] = parts


def _cut_views_two_ways(graph: IRGraph, node: IRNode, parts: int) -> None:
    """Cut the views between expert-parallel ``node``'s weights and their parameters (Hugging Face's
    chunk and transposes) by expert over the expert groups and by hidden unit inside each, so each
    device stores only its quarter, or whatever share, of the parameters (the chunk cuts
    ``gate_up_proj``'s hidden units strided: each device its units of the gate and of the up rows).
    Refused by name where a view does not pass both cuts through."""
    devices, hidden = node.placement.devices, node.annotation.inputs[EXPERT_WEIGHTS[0]][-1]
    for i, (_, views) in zip(EXPERT_WEIGHTS, expert_weight_views(graph, node)):
        t, expert_dim, hidden_dim = node.inputs[i], 0, node.annotation.inputs[i].index(hidden)
        for view in views:
            k = next(j for j, o in enumerate(view.output_tensors) if o is t)
            outer, inner = view.annotation.outputs[k][expert_dim], view.annotation.outputs[k][hidden_dim]
            names = view.annotation.inputs[0]
            if outer not in names or inner not in names:
                raise PolicyError(f"{view.name} ({view.target}) between {node.name} and its weights does not keep "
                                  f"their experts and hidden units apart, so '{EXPERT_TENSOR_PARALLEL_KEY}' cannot "
                                  f"cut the parameters behind it: drop '{EXPERT_TENSOR_PARALLEL_KEY}'.")
            partition_grid(view, outer, inner, devices, parts)
            t, expert_dim, hidden_dim = view.inputs[0], names.index(outer), names.index(inner)


def split_weight_views(graph: IRGraph, node: IRNode, dims: Sequence[int]) -> None:
    """Split the views between routed-experts ``node``'s weights and the parameters they read
    (Hugging Face's chunk and transposes) over ``node``'s devices, so that weight ``j`` arrives
    split on its dim ``dims[j]`` as the op wants it and each device stores only its share of the
    parameters: by expert (dim 0) under expert parallelism, by hidden unit under tensor-parallel
    experts (the chunk then cuts ``gate_up_proj`` strided, each device its units of the gate and of
    the up rows). A view the axis does not pass through stays as placed, and the op slices its share
    from what it reads."""
    devices = node.placement.devices
    for dim, i, (_, views) in zip(dims, EXPERT_WEIGHTS, expert_weight_views(graph, node)):
        t = node.inputs[i]
        for view in views:
            index = next(k for k, o in enumerate(view.output_tensors) if o is t)
            name = view.annotation.outputs[index][dim]
            if name not in view.annotation.inputs[0] or view.annotation.can_split(name, len(devices)):
                break
            partition(view, name, devices)
            t, dim = view.inputs[0], view.annotation.inputs[0].index(name)


def _split_tokens(node: IRNode, devices: Tuple[int, ...]) -> None:
    """Place routed-experts ``node`` split along its tokens (its first input's first axis) over
    ``devices``, left whole where they do not divide (``place_experts`` then refuses it by name)."""
    name = node.annotation.inputs[0][0]
    if node.annotation.can_split(name, len(devices)) is None:
        partition(node, name, devices)
    else:
        replicate(node, devices)
