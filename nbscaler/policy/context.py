"""Context parallelism: every op on a slice of the sequence, attention over all of it.

``pas_config={"context_parallel": n}`` under ``tp`` or ``hybrid`` splits the sequence of each
stage over its ``n`` devices. The sequence is axis 1 of the forward's inputs (``(batch, sequence,
...)`` token ids and targets), cut into ``2n`` chunks of which device ``i`` holds ``i`` and
``2n-1-i`` (``nbscaler.blocks.MIRRORED``): under a causal mask every device then does the same
work. The split follows the graph as ``data`` follows the batch:

- an op that reads a split input is split along the same axis (norms, linears, residual adds, the
  MLP): it runs on this device's tokens, and its weights' gradients are summed over the devices;
- what is computed whole (positions, rotary tables, a causal mask) is sliced where a split op
  reads it, so every chunk sees its own positions; a learned position embedding reads its
  positions (an integer tensor whose last axis is the sequence) sliced, so it looks up only this
  device's rows and its weight's gradient is summed with the others', where run whole its
  gradient would be all-gathered in the backward;
- attention splits its queries: ``scaled_dot_product_attention`` becomes
  ``nbscaler.runtime.context.context_attention`` (keys and values all-gathered, or passed round a
  ring: ``"context_parallel_kind"``), and an attention written out (``q @ k.transpose(-2, -1)``,
  a mask, a softmax, ``@ v``) all-gathers its keys and values where its products read them;
- a mean cross-entropy splits its tokens (``split_cross_entropy``): each device's part of the mean.

An op that cannot take the split (a reshape that merges the batch into the sequence) runs on the
whole sequence, gathered; ``plan.explain()`` names each such op.

A stage of more devices than ``n`` (a multiple of it) is ``n`` groups of neighbours with tensor
parallelism inside each (``place_context``'s ``tensor_parallel``): each op is placed on the grid,
its first cut along the sequence across the groups, its second as ``tp`` splits it inside them
(``Placement.inner``).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

from nbscaler.blocks import MIRRORED
from nbscaler.config import CONTEXT_PARALLEL, ComputeConfig
from nbscaler.ir.graph import CONTEXT_KIND, InnerSplit, IRGraph, IRNode, Placement
from nbscaler.ir.layer_rules import context_parallel as context_parallel_call, splits_mean_loss, window_of
from nbscaler.layouts import ContextKind
from nbscaler.policy.primitives import PolicyError, partition, replicate, splittable

CONTEXT_PARALLEL_KIND = "context_parallel_kind"
"""The ``pas_config`` key of how attention reads other devices' keys: ``all_gather`` or ``ring``."""
CONTEXT_KEYS = (CONTEXT_PARALLEL, CONTEXT_PARALLEL_KIND)
#: The split of a cross-entropy by its classes (``vocab_parallel``): a loss of a split sequence keeps it.
VOCAB_CLASSES = "c"
#: The key of ``graph.meta`` where the policy lists the ops that run on the whole sequence.
CONTEXT_GATHERED = "context_gathered"


def context_kind(cfg: ComputeConfig) -> str:
    """How attention reads other devices' keys (``pas_config['context_parallel_kind']``, ``all_gather``
    unless given)."""
    value = cfg.pas_config.get(CONTEXT_PARALLEL_KIND, ContextKind.ALL_GATHER)
    if value not in set(ContextKind):
        raise ValueError(f"pas_config['{CONTEXT_PARALLEL_KIND}']={value!r} is invalid: give "
                         f"{' or '.join(repr(k.value) for k in ContextKind)}.")
    return ContextKind(value)


def sequence_length(graph: IRGraph) -> Optional[int]:
    """The sequence context parallelism splits: axis 1 of the forward's first input with two axes
    (``None`` when there is none)."""
    return next((t.shape[1] for t in graph.inputs if t.ndim >= 2), None)


def sequence_inputs(graph: IRGraph, n: int) -> Tuple[int, Dict[int, int]]:
    """The sequence length, and ``id(tensor) -> 1`` for each input that carries the sequence on axis 1.
    Raises ``PolicyError`` when there is none or it does not cut into ``2n`` chunks."""
    shaped = [t for t in graph.inputs if t.ndim >= 2]
    if not shaped:
        raise PolicyError(f"{CONTEXT_PARALLEL} splits the sequence, axis 1 of the forward's inputs, but no input "
                          "has two axes: pass (batch, sequence) token ids.")
    length = sequence_length(graph)
    if length % (2 * n):
        fit = -(-length // (2 * n)) * 2 * n
        raise PolicyError(f"{CONTEXT_PARALLEL}={n} cuts the sequence into 2 x {n} = {2 * n} equal chunks (device i "
                          f"holds chunks i and {2 * n - 1}-i, which balances a causal mask), but the sequence has "
                          f"{length} tokens: trace with a sequence that is a multiple of {2 * n} (e.g. {fit}), or "
                          f"choose a {CONTEXT_PARALLEL} that divides {length // 2}.")
    return length, {id(t): 1 for t in shaped if t.shape[1] == length}


TensorParallel = Callable[[IRGraph, Callable[[IRNode], Tuple[int, ...]]], IRGraph]
"""A tensor-parallel placement of a graph over the devices each node is given (``policy.builtin``'s)."""


def place_context(graph: IRGraph, devices_of: Callable[[IRNode], Tuple[int, ...]], kind: str,
                  tensor_parallel: int = 1, place_tensor: Optional[TensorParallel] = None) -> IRGraph:
    """Split every op of ``graph`` along the sequence over ``devices_of(node)`` (see the module
    docstring); with ``tensor_parallel=t > 1`` the devices are groups of ``t`` neighbours, the
    sequence split across the groups and each op split inside its group as ``place_tensor`` splits
    it (Megatron's way: tensor parallelism inside, context parallelism across). Under sequence
    parallelism (``place_tensor`` given it) the ops between the linears cut their group's chunks
    again along the sequence, one contiguous part a device."""
    if tensor_parallel == 1:
        return _place_sequence(graph, devices_of, kind)
    t = tensor_parallel
    place_tensor(graph, lambda node: devices_of(node)[:t])
    inner = {id(node): (node.placement.split, node.placement.blocks) for node in graph.nodes}
    _place_sequence(graph, lambda node: devices_of(node)[::t], kind)
    for node in graph.nodes:
        outer, devices = node.placement, devices_of(node)
        if outer.split is None:                 # whole on every device (positions, a gathered op)
            replicate(node, devices)
            continue
        name, blocks = inner[id(node)]
        if context_parallel_call(node) == "loss" and name != VOCAB_CLASSES:
            name, blocks = None, 1              # the loss of a split sequence reads its logits whole
        elif name == outer.split and (name not in splittable(node, 2 * len(outer.devices) * t) or blocks != 1):
            name, blocks = None, 1              # the group's chunks do not cut again along the sequence
        node.placement = Placement(tuple(devices), outer.split, outer.blocks, InnerSplit(name, t, blocks))
    return graph


def _place_sequence(graph: IRGraph, devices_of: Callable[[IRNode], Tuple[int, ...]], kind: str) -> IRGraph:
    """Split every op of ``graph`` along the sequence over ``devices_of(node)`` (one axis)."""
    n = len(devices_of(graph.nodes[0])) if graph.nodes else 1
    length, seq_dim = sequence_inputs(graph, n)
    gathered: List[str] = []
    for node in graph.nodes:
        devices = devices_of(node)
        split = [(i, seq_dim[id(t)]) for i, t in enumerate(node.inputs) if id(t) in seq_dim] or _positions(node, length)
        name = _context_name(node, split, length, kind, len(devices)) if split and node.annotation is not None else None
        if name is None:
            if split and any(t.dtype.is_floating_point for t in node.inputs):
                gathered.append(node.name)
            replicate(node, devices)
            continue
        if name in node.annotation.frozen:          # attention's queries, a mean loss's tokens: own calls
            node.placement = Placement(tuple(devices), name, MIRRORED)
            node.meta[CONTEXT_KIND] = kind
        else:
            partition(node, name, devices, blocks=MIRRORED)
        _, out_dims = node.annotation.split_dims(name)
        for t, d in zip(node.output_tensors, out_dims):
            if d is not None:
                seq_dim[id(t)] = d
    if gathered:
        graph.meta[CONTEXT_GATHERED] = gathered
    return graph


def _positions(node: IRNode, length: int) -> List[Tuple[int, int]]:
    """``[(0, last axis)]`` for an embedding that looks up whole positions (integer indices whose
    last axis is the sequence, such as ``arange(T)``), to split it there; else ``[]``."""
    if node.op != "embedding" or not node.inputs:
        return []
    index = node.inputs[0]
    if index.dtype.is_floating_point or index.ndim == 0 or index.shape[-1] != length:
        return []
    return [(0, index.ndim - 1)]


def _context_name(node: IRNode, split: List[Tuple[int, int]], length: int, kind: str, n: int) -> Optional[str]:
    """The annotated axis to split ``node`` along, given its inputs that arrive split (``(input, dim)``);
    ``None`` to run it whole."""
    ann = node.annotation
    if node.op == "attention":
        if window_of(node) is not None:
            raise PolicyError(f"{node.name}: sliding_window_attention (a window of {window_of(node)} keys) cannot be "
                              "split along the sequence: context parallelism passes or gathers every earlier key, "
                              "not a window of them. Leave 'context_parallel' out of pas_config for this model, or "
                              "split its batch or heads instead.")
        dims = dict(split)
        if 0 not in dims:
            raise PolicyError(f"{node.name}: its keys or values are split along the sequence but its queries are "
                              "not, which context parallelism cannot attend over; split the queries too.")
        if len(node.inputs) == 4 and node.inputs[3].ndim >= 2 and node.inputs[3].shape[-1] not in (1, length):
            raise PolicyError(f"{node.name}: its attention mask has {node.inputs[3].shape[-1]} key columns, neither "
                              f"the sequence's {length} nor 1 (broadcast), so it cannot be cut by position; pass a "
                              "mask of shape (..., T, T) or (..., 1, T).")
        return "t"
    if node.op == "loss" and "n" in ann.frozen:     # a mean: each device's part of it, if it is a plain one
        return "n" if splits_mean_loss(node, dict(split).get(0)) else None
    i, d = split[0]
    name = ann.inputs[i][d] if ann.inputs[i] is not None else None
    if kind == ContextKind.RING and node.op == "matmul" and len(split) > 1:
        raise PolicyError(f"{node.name}: an attention written out as products ({node.target} of two split "
                          "sequences) cannot pass its keys round a ring: call F.scaled_dot_product_attention, or "
                          f"set pas_config['{CONTEXT_PARALLEL_KIND}']='all_gather', which gathers them.")
    if name is None or ann.can_split(name, 2 * n) is not None:
        return None
    return name


def check_context(cfg: ComputeConfig, stage_devices: int, sequence_parallel: bool) -> int:
    """The context-parallel size of ``cfg``, checked against the devices of each stage (1: none);
    the rest of each stage's devices, ``stage_devices // n``, are tensor-parallel inside each
    context-parallel device."""
    n = cfg.context_parallel
    context_kind(cfg)
    if n == 1:
        return 1
    if sequence_parallel and stage_devices == n:
        raise PolicyError(f"pas_config has both '{CONTEXT_PARALLEL}' and 'sequence_parallel', but no tensor "
                          "parallelism inside it: context parallelism already runs every op on a slice of the "
                          "sequence; drop 'sequence_parallel', or give each stage more devices than "
                          f"{CONTEXT_PARALLEL} (the rest are tensor parallel, and sequence parallel between them).")
    if stage_devices % n:
        raise PolicyError(f"{CONTEXT_PARALLEL}={n}, but each stage has {stage_devices} devices, which do not "
                          f"divide into {n} groups: a stage's devices are {CONTEXT_PARALLEL} x tensor parallel. "
                          f"Set {CONTEXT_PARALLEL} to a divisor of {stage_devices}, or plan_ngpus to a multiple of "
                          f"{n} x the pipeline stages.")
    return n
