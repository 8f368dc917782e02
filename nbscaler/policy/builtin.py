"""The built-in PAS policies, accepted by name in ``parallelize``.

- ``dp``: the whole model on one device per unit (``plan_ngpus=1``); data parallelism comes from
  running ``runtime_ngpus`` units, whose gradients are summed.
- ``data``: split every op along the batch axis across the ``plan_ngpus`` devices of a unit.
- ``pp``: pipeline stages balanced by FLOPs, one per device (``pas_config={"pipeline_split":
  "layers"}``: the same number of repeated layers in each, as Megatron-LM splits a model).
- ``hybrid``: pipeline stages, each tensor-parallel (``tp``) over its share of the devices.
- ``autodist``: a search over every op's split, scored by the cost model (``nbscaler.policy.autodist``);
  ``sequence_parallel`` makes the ``tp`` plan it weighs its search against sequence parallel.
- ``tp``: tensor parallelism in the Megatron style: weighted ops split their weights (a linear
  after a replicated input splits its output features, one after a split input splits its
  reduction axis and leaves partial sums), and other ops keep whatever split their input has.
  Both ends of a language model split by vocabulary, as in Megatron-LM: a plain embedding of the
  token ids by its table's rows (its partial lookups all-reduced, so the residual stream starts
  replicated; a table the model indexes itself, such as learned positions, stays whole, so that
  one all-reduce follows the lookups, ``vocabulary_lookups``), and the
  cross-entropy by the classes the column-parallel output head leaves split
  (``nbscaler.runtime.vocab``), so the logits are never gathered.
  A fused projection whose output is cut into blocks (``q, k, v = qkv(x).split(C, dim=2)``,
  GPT-2's ``c_attn``, timm's ``(B, T, 3, nh, hs)`` view, or unequal blocks for grouped-query
  attention) is split strided, so each device holds its own heads of q, k and v and attention runs
  on local heads (``fused_blocks``).

  With ``pas_config={"sequence_parallel": True}`` (``tp`` and ``hybrid``; Korthikanti et al. 2022,
  "Reducing Activation Recomputation in Large Transformer Models") the ops between the
  tensor-parallel linears run on a slice of the sequence instead of on the whole of it: an op that
  reads a row-parallel linear's partial sums (the residual add) or an embedding's output takes its
  slice (``_sequence_choice``), and the ops after it follow, so norms, dropout and residual adds
  keep a sequence slice. The layouts then ask for a reduce-scatter after each row-parallel linear
  (partial -> sequence slice) and an all-gather before each column-parallel one (sequence slice ->
  whole, its backward a reduce-scatter of the partial gradients) instead of an all-reduce, and the
  activations those ops keep shrink by the tensor-parallel size.

Each policy walks the graph in order, tracking the layout every tensor is left in, and places each
node with the primitives of ``nbscaler.policy.primitives``.

A built-in policy reads the ``pas_config`` keys it declares in ``POLICY_KEYS`` (and those every
plan reads: the pipeline settings, ``recompute`` and ``recompute_modules``), and refuses any other key with a
``ValueError`` that names it, so a typo never passes silently; a user's own policy reads what it likes.
"""

from __future__ import annotations

import functools
from typing import Callable, Dict, Optional, Set, Tuple

from nbscaler.blocks import Blocks, divide, units
from nbscaler.comm.layout import Layout, output_layout
from nbscaler.columns import StrEnum
from nbscaler.config import PIPELINE_KEYS, RECOMPUTE, RECOMPUTE_MODULES, ComputeConfig
from nbscaler.ir.graph import IRGraph, IRNode
from nbscaler.ir.expert_rules import EXPERT_OPS, EXPERT_WEIGHTS, expert_tensor_parallel, expert_weight_views
from nbscaler.ir.layer_rules import vocabulary_lookups
from nbscaler.layouts import LayoutKind
from nbscaler.policy.autodist import autodist
from nbscaler.policy.autodist.options import KEYS as AUTODIST_KEYS, TARGET_KEYS
from nbscaler.policy.batch import split_batch
from nbscaler.policy.context import CONTEXT_KEYS, check_context, context_kind, place_context
from nbscaler.policy.experts import (AROUND_EXPERTS_KEY, EXPERT_PARALLEL_KEY, EXPERT_TENSOR_PARALLEL_KEY, AroundExperts,
                                     around_experts, check_experts, expert_tensor_parallel_size, place_experts,
                                     split_weight_views)
from nbscaler.policy.primitives import PolicyError, partition, replicate, splittable
from nbscaler.policy.staging import PipelineSplit, stage_by
from nbscaler.schedule import PipelineGeometry
from nbscaler.schedule.schedulers import scheduler_spec

Policy = Callable[[IRGraph, ComputeConfig], IRGraph]

SEQUENCE_PARALLEL = "sequence_parallel"
"""The ``pas_config`` key of sequence parallelism (``tp``, ``hybrid`` and ``autodist``)."""
PIPELINE_SPLIT = "pipeline_split"
"""The ``pas_config`` key of how ``pp`` and ``hybrid`` cut the model into stages (``PipelineSplit``)."""


def _split_layouts(graph: IRGraph):
    """Yield nodes with a lookup of the layout each earlier output was left in (``None``: replicated)."""
    layout: Dict[int, Layout] = {}
    for node in graph.nodes:
        yield node, lambda t: layout.get(id(t))
        for i, t in enumerate(node.output_tensors):
            lay = output_layout(node, i)
            if lay.kind in ("S", "P"):
                layout[id(t)] = lay


def fused_blocks(graph: IRGraph) -> Dict[int, Tuple[int, Blocks]]:
    """``id(tensor) -> (dim, k)`` for tensors that are later cut into ``k`` blocks along
    ``dim`` (a fused qkv output split into q, k and v), followed back through reshapes to the op
    that makes them. A column-parallel linear that makes such a tensor splits it strided, so that
    each device ends up with its own heads of q, k and v, and attention runs on local heads."""
    want: Dict[int, Tuple[int, Blocks]] = {}
    for node in reversed(graph.nodes):
        ann = node.annotation
        if ann is None:
            continue
        for (i, name), k in ann.grouped.items():
            want[id(node.inputs[i])] = (ann.inputs[i].index(name), k)
        outs = node.output_tensors
        if node.op == "reshape" and len(outs) == 1 and id(outs[0]) in want:
            dim, k = want[id(outs[0])]
            name = ann.outputs[0][dim]
            if name in ann.inputs[0]:
                want[id(node.inputs[0])] = (ann.inputs[0].index(name), k)
    return want


#: The key of ``graph.meta`` where a policy says what it did that its name does not (``plan.explain()``).
POLICY_NOTE = "policy_note"


def dp(graph: IRGraph, cfg: ComputeConfig) -> IRGraph:
    """Pure data parallelism: one whole copy of the model per rank."""
    if cfg.plan_ngpus != 1:
        raise PolicyError(f"policy 'dp' keeps the whole model on one device, so it needs plan_ngpus=1 "
                          f"(got {cfg.plan_ngpus}); set runtime_ngpus for the number of data-parallel "
                          "ranks, or use 'data' to split the batch inside a unit.")
    for node in graph.nodes:
        replicate(node, [0])
    return graph


def data(graph: IRGraph, cfg: ComputeConfig) -> IRGraph:
    """Split each op along the batch axis (dim 0 of the inputs), following it through the graph; a
    batch that does not divide over the unit's devices is refused (it would replicate every op)."""
    devices = tuple(range(cfg.plan_ngpus))
    return split_batch(graph, lambda node: devices, "policy 'data'")


def tp(graph: IRGraph, cfg: ComputeConfig) -> IRGraph:
    """Megatron-style tensor parallelism over all ``plan_ngpus`` devices of a unit (with
    ``pas_config={"sequence_parallel": True}``, sequence parallelism between its linears)."""
    unit = cfg.grid.stage_group(None)
    if check_experts(cfg, len(unit), _beside_experts(cfg)) > 1:
        return place_experts(graph, lambda node: unit, _around(cfg, lambda node: unit),
                             expert_tensor_parallel_size(cfg))
    cp = check_context(cfg, len(unit), sequence_parallel(cfg))
    if cp > 1:
        return place_context(graph, lambda node: unit, context_kind(cfg), len(unit) // cp,
                             functools.partial(_tensor_parallel, sequence=sequence_parallel(cfg)))
    return _tensor_parallel(graph, lambda node: unit, sequence_parallel(cfg))


def _beside_experts(cfg: ComputeConfig) -> Tuple[str, ...]:
    """The ``pas_config`` keys of the other dimensions ``cfg`` turns on, which expert parallelism
    does not combine with yet."""
    return tuple(key for key, on in ((SEQUENCE_PARALLEL, sequence_parallel(cfg)),
                                     (CONTEXT_KEYS[0], cfg.context_parallel > 1)) if on)


def _around(cfg: ComputeConfig, devices_of: Callable[[IRNode], Tuple[int, ...]]) -> Optional[Policy]:
    """The placement of the layers around expert-parallel experts: ``None`` for the batch split,
    or Megatron-style tensor parallelism over the same devices (``around_experts='tp'``)."""
    if around_experts(cfg) == AroundExperts.TP:
        return lambda graph: _tensor_parallel(graph, devices_of)
    return None


def sequence_parallel(cfg: ComputeConfig) -> bool:
    """Whether ``cfg`` asks for sequence parallelism (``pas_config['sequence_parallel']``, a bool)."""
    value = cfg.pas_config.get(SEQUENCE_PARALLEL, False)
    if not isinstance(value, bool):
        raise ValueError(f"pas_config['{SEQUENCE_PARALLEL}']={value!r} is invalid: give True or False.")
    return value


def _tensor_parallel(graph: IRGraph, devices_of: Callable[[IRNode], Tuple[int, ...]],
                     sequence: bool = False) -> IRGraph:
    """Place each node on ``devices_of(node)``, split Megatron-style where that pays; with
    ``sequence``, the ops between the linears on a slice of the sequence."""
    fused, vocabulary, expert_views = fused_blocks(graph), vocabulary_lookups(graph), _expert_weight_views(graph)
    for node, layout_of in _split_layouts(graph):
        devices = devices_of(node)
        choice = None
        if len(devices) > 1 and node.name not in expert_views:
            choice = _tp_choice(node, layout_of, fused, vocabulary, len(devices))
            if choice is None and sequence:
                choice = _sequence_choice(node, layout_of, len(devices))
        if choice is None:
            replicate(node, devices)
        else:
            partition(node, choice[0], devices, blocks=choice[1])
    for node in graph.nodes:            # views of tensor-parallel experts' weights split by hidden unit too
        if expert_tensor_parallel(node):
            split = node.placement.split
            split_weight_views(graph, node, [node.annotation.inputs[i].index(split) for i in EXPERT_WEIGHTS])
    return graph


def _expert_weight_views(graph: IRGraph) -> Set[str]:
    """The views between routed-experts ops' weights and their parameters (Hugging Face's chunk and
    transposes): split as the op's split wants them (``split_weight_views``), not by the rule for a
    layer's weights, which would split them by expert and gather them back."""
    return {view.name for node in graph.nodes if node.target in EXPERT_OPS
            for _, views in expert_weight_views(graph, node) for view in views}


def pipeline_split(cfg: ComputeConfig) -> PipelineSplit:
    """How ``cfg`` asks the pipeline to be cut (``pas_config['pipeline_split']``, ``flops`` unless given)."""
    value = cfg.pas_config.get(PIPELINE_SPLIT, PipelineSplit.FLOPS)
    if value not in set(PipelineSplit):
        raise ValueError(f"pas_config['{PIPELINE_SPLIT}']={value!r} is invalid: give one of "
                         f"{', '.join(s.value for s in PipelineSplit)}.")
    return PipelineSplit(value)


def pipeline_geometry(cfg: ComputeConfig, policy: str) -> PipelineGeometry:
    """The schedule and device layout a pipeline policy stages the graph for."""
    if not cfg.use_pipeline:
        raise PolicyError(f"policy {policy!r} builds a pipeline: set ComputeConfig(use_end2end=True, "
                          "use_pipeline=True, pipeline_nmicros=...) (and pipeline_nstages).")
    return cfg.grid.pipeline


def pp(graph: IRGraph, cfg: ComputeConfig) -> IRGraph:
    """Pipeline parallelism: each device runs its stages alone (one, or the scheduler's several per
    device), stages balanced by the FLOPs of their ops."""
    geometry = pipeline_geometry(cfg, "pp")
    if geometry.tp != 1:
        per_device = geometry.schedule.nstages // geometry.schedule.ndevices
        raise PolicyError(f"policy 'pp' gives each device its own stages, so pipeline_nstages must equal "
                          f"{per_device} x plan_ngpus={per_device * cfg.plan_ngpus} for "
                          f"{cfg.scheduler} (got {cfg.pipeline_nstages}: {geometry.schedule.ndevices} pipeline "
                          "devices"
                          + (f" of pipeline_virtual_stages={cfg.virtual_stages}" if cfg.virtual_stages else "")
                          + "); use 'hybrid' for tensor parallelism inside the stages.")
    stage_by(pipeline_split(cfg), graph, geometry.schedule.nstages)
    for node in graph.nodes:
        replicate(node, geometry.stage_group(node.stage))
    return graph


def hybrid(graph: IRGraph, cfg: ComputeConfig) -> IRGraph:
    """Pipeline stages, each tensor-parallel over its pipeline device's ``plan_ngpus // devices``
    plan devices (with ``pas_config={"sequence_parallel": True}``, sequence parallel inside each
    stage), under every scheduler. The pipeline devices are ``pipeline_nstages`` over the stages each
    holds: the scheduler's own number (1 for ``1f1b``, 2 for ``zbv``), or for a scheduler that takes
    any (``1f1b_interleaved``) ``pipeline_virtual_stages``, as Megatron-LM runs its interleaved
    schedule with tensor-parallel virtual stages. Without ``pipeline_virtual_stages`` such a
    scheduler spreads its stages over every plan device, so each stage has one device: the graph's
    ``meta[POLICY_NOTE]`` says so and how to ask for tensor parallelism (``plan.explain()`` prints
    it), and sequence parallelism, which needs tensor-parallel stages, is refused."""
    geometry = pipeline_geometry(cfg, "hybrid")
    spec = scheduler_spec(cfg.scheduler)
    if spec.per_device(cfg.virtual_stages) is None and cfg.plan_ngpus > 1:
        # the scheduler's stages take every plan device: one device a stage, no tensor parallelism
        why = (f"{cfg.scheduler} spreads its stages over every one of the {cfg.plan_ngpus} plan devices, so 'hybrid' "
               "runs each stage on one device, without tensor parallelism (as 'pp' would); for tensor-parallel "
               "stages set pipeline_virtual_stages, the stages on each pipeline device")
        if cfg.plan_ngpus % 2 == 0:       # nstages is a multiple of plan_ngpus, so this one always fits
            virtual = 2 * geometry.schedule.nstages // cfg.plan_ngpus
            why += (f" (here pipeline_virtual_stages={virtual}: {cfg.plan_ngpus // 2} pipeline devices, each "
                    "tensor-parallel over 2 plan devices)")
        why += "."
        if sequence_parallel(cfg):
            raise PolicyError(f"pas_config['{SEQUENCE_PARALLEL}'] asks for tensor-parallel stages, but {why}")
        graph.meta[POLICY_NOTE] = why
    stage_by(pipeline_split(cfg), graph, geometry.schedule.nstages)
    if check_experts(cfg, geometry.tp, _beside_experts(cfg)) > 1:
        group = lambda node: geometry.stage_group(node.stage)
        return place_experts(graph, group, _around(cfg, group), expert_tensor_parallel_size(cfg))
    cp = check_context(cfg, geometry.tp, sequence_parallel(cfg))
    if cp > 1:
        return place_context(graph, lambda node: geometry.stage_group(node.stage), context_kind(cfg),
                             geometry.tp // cp, functools.partial(_tensor_parallel, sequence=sequence_parallel(cfg)))
    return _tensor_parallel(graph, lambda node: geometry.stage_group(node.stage), sequence_parallel(cfg))


def _tp_choice(node: IRNode, layout_of, fused, vocabulary: Set[str], n: int) -> Optional[Tuple[str, Blocks]]:
    """The (dimension, blocks) to split ``node`` along, or ``None`` to replicate it;
    ``vocabulary``: the embeddings that look up token ids (``vocabulary_lookups``)."""
    ann = node.annotation
    options = splittable(node, n)
    if not options:
        return None
    if node.op == "embedding":          # vocabulary-parallel (masked lookups, summed), or whole
        return ("v", 1) if "v" in options and node.name in vocabulary else None
    inherited = []            # (name, blocks) along which an input already arrives split
    for i, t in enumerate(node.inputs):
        lay = layout_of(t)
        if lay is not None and lay.kind == LayoutKind.SPLIT and ann.inputs[i] is not None:
            name = ann.inputs[i][lay.dim]
            left = divide(lay.blocks, ann.grouped.get((i, name), 1))
            if left is not None and ann.can_split(name, n * units(left)) is None:
                inherited.append((name, left))
    weights = EXPERT_WEIGHTS if node.target in EXPERT_OPS else ()     # views of parameters, for Hugging Face's
    weight_names = [name for i, t in enumerate(node.inputs) if (t.kind == "param" or i in weights) and t.ndim >= 2
                    for name in ann.inputs[i] or () if name in options]
    if weight_names:
        for name, blocks in inherited:
            if name in weight_names:
                return name, blocks       # row-parallel: the input is already split along k
        column = [w for w in weight_names if w not in ann.reduce]
        name = (column or weight_names)[0]
        return name, _column_blocks(node, name, fused, n)
    for name, blocks in inherited:
        if name in options:
            return name, blocks
    return None


def _sequence_choice(node: IRNode, layout_of, n: int) -> Optional[Tuple[str, Blocks]]:
    """Under sequence parallelism, the split of an op ``_tp_choice`` leaves whole: along the
    sequence when it reads partial sums (the residual add after a row-parallel linear, which then
    reduce-scatters) or an embedding's output (the stream starts sliced: a vocabulary lookup's
    partial sums reduce-scatter, a whole table's output is sliced). The
    sequence is the axis before the last (hidden) one of the op's first output, ``(B, T, C)``; ops
    without such a splittable axis stay whole, and their consumers then all-gather."""
    ann = node.annotation
    outs = ann.outputs if ann is not None else None
    if not outs or outs[0] is None or len(outs[0]) < 2 or not node.output_tensors:
        return None
    starts = any((layout_of(t) is not None and layout_of(t).kind == LayoutKind.PARTIAL)
                 or (t.producer is not None and t.producer.op == "embedding") for t in node.inputs)
    name = outs[0][-2]
    return (name, 1) if starts and name in splittable(node, n) else None


def _column_blocks(node: IRNode, name: str, fused, n: int) -> Blocks:
    """Blocks of a column-parallel split: ``k`` when the output is later cut into ``k`` blocks
    along the split axis (``fused_blocks``; unequal ones for a grouped-query qkv), else 1
    (contiguous)."""
    out = node.annotation.outputs[0] if node.annotation.outputs else None
    if not node.output_tensors or out is None or name not in out:
        return 1
    dim, k = fused.get(id(node.output_tensors[0]), (None, 1))
    if dim == out.index(name) and node.annotation.can_split(name, n * units(k)) is None:
        return k
    return 1


class BuiltinPolicy(StrEnum):
    """The policies the planner accepts by name, in the order a user is offered them."""

    DP = "dp"
    TP = "tp"
    DATA = "data"
    PP = "pp"
    HYBRID = "hybrid"
    AUTODIST = "autodist"


COMMON_KEYS = PIPELINE_KEYS + (RECOMPUTE_MODULES, RECOMPUTE)
"""``pas_config`` keys every plan reads, whatever its policy."""

POLICY_KEYS: Dict[str, Tuple[str, ...]] = {
    BuiltinPolicy.DP: (),
    BuiltinPolicy.TP: (SEQUENCE_PARALLEL, EXPERT_PARALLEL_KEY, EXPERT_TENSOR_PARALLEL_KEY,
                       AROUND_EXPERTS_KEY) + CONTEXT_KEYS,
    BuiltinPolicy.DATA: (),
    BuiltinPolicy.PP: (PIPELINE_SPLIT,),
    BuiltinPolicy.HYBRID: (SEQUENCE_PARALLEL, PIPELINE_SPLIT, EXPERT_PARALLEL_KEY, EXPERT_TENSOR_PARALLEL_KEY,
                           AROUND_EXPERTS_KEY) + CONTEXT_KEYS,
    BuiltinPolicy.AUTODIST: AUTODIST_KEYS + TARGET_KEYS + (SEQUENCE_PARALLEL,),
}
"""The ``pas_config`` keys each built-in policy reads, beyond ``COMMON_KEYS``."""

SEQUENCE_PARALLEL_POLICIES = tuple(p for p, keys in POLICY_KEYS.items() if SEQUENCE_PARALLEL in keys)
"""Policies that read ``sequence_parallel``."""

PIPELINE_POLICIES = (BuiltinPolicy.PP, BuiltinPolicy.HYBRID)
"""Policies that always build a pipeline (they refuse a config without one)."""

POLICIES: Dict[str, Policy] = {
    BuiltinPolicy.DP: dp,
    BuiltinPolicy.TP: tp,
    BuiltinPolicy.DATA: data,
    BuiltinPolicy.PP: pp,
    BuiltinPolicy.HYBRID: hybrid,
    BuiltinPolicy.AUTODIST: autodist,
}


def check_pas_config(policy: str, cfg: ComputeConfig) -> None:
    """Refuse ``pas_config`` keys built-in ``policy`` does not read, naming them and the ones it reads."""
    reads = POLICY_KEYS[policy]
    unknown = sorted(k for k in cfg.pas_config if k not in reads and k not in COMMON_KEYS)
    if unknown:
        known = ", ".join(repr(k) for k in reads + COMMON_KEYS)
        raise ValueError(f"pas_config has {', '.join(map(repr, unknown))}, which policy {policy!r} does not read "
                         f"(a typo?): it reads {known}. Remove the key, or use a policy that reads it.")


def _checked(name: str, fn: Policy) -> Policy:
    """Built-in ``fn`` that first checks the config's ``pas_config`` keys (``check_pas_config``)."""
    @functools.wraps(fn)
    def policy(graph: IRGraph, cfg: ComputeConfig) -> IRGraph:
        check_pas_config(name, cfg)
        return fn(graph, cfg)
    return policy


def get_policy(policy) -> Policy:
    """A policy function from a built-in name or a callable. A built-in, by name or as its function,
    refuses ``pas_config`` keys it does not read; any other callable is the user's and reads what it likes."""
    name = next((n for n, fn in POLICIES.items() if fn is policy), None) if callable(policy) else policy
    if isinstance(name, str) and name in POLICIES:
        return _checked(name, POLICIES[name])
    if callable(policy):
        return policy
    raise ValueError(f"unknown PAS policy {policy!r}: use one of {', '.join(POLICIES)}, or a function "
                     "(graph, compute_config) -> graph.")
