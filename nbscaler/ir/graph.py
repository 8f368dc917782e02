"""The IR: a flat, ordered list of torch-function calls over named tensors.

``IRGraph`` is what the tracer produces, what policies partition, what code generation reads and
what the widgets draw. It is deliberately small:

- ``IRTensor`` is one value: a graph input, a parameter or buffer of the module, a constant, or the
  output of a node. It knows its full (unpartitioned) shape.
- ``IRNode`` is one call, e.g. ``torch.nn.functional.linear(x, w)``. Its ``args``/``kwargs`` keep the
  call's Python structure with ``IRTensor`` leaves, so code generation can write the call back out.
  It also records where it came from (module path and source line), its dimension annotation, and
  where the policy placed it (``placement``).

A policy never rewrites the list of nodes: it sets each node's ``placement``. Communication and code
generation derive everything else from the placements, so the same graph object can be shown,
re-partitioned and compiled again.

>>> graph.nodes[3]                                           # doctest: +SKIP
IRNode(linear_3 = torch.nn.functional.linear(x, blocks.0.attn.q.weight) @ blocks.0.attn.q)
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple

import torch
from torch.utils._pytree import tree_flatten, tree_map

from nbscaler.blocks import Blocks, describe, is_strided
from nbscaler.columns import StrEnum
from nbscaler.ir.annotation import OpAnnotation

Shape = Tuple[int, ...]


@dataclass(eq=False)
class IRTensor:
    """One tensor value of the graph, at its full (unpartitioned) shape."""

    name: str
    shape: Shape
    dtype: torch.dtype
    kind: str = "activation"          # 'input' | 'param' | 'buffer' | 'constant' | 'activation'
    requires_grad: bool = False
    producer: Optional["IRNode"] = None
    path: Any = None                  # inputs: the pytree path in the forward args; params: qualified name

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * (torch.finfo(self.dtype).bits if self.dtype.is_floating_point else
                    torch.iinfo(self.dtype).bits if self.dtype != torch.bool else 8) // 8

    @property
    def is_weight(self) -> bool:
        return self.kind in ("param", "buffer", "constant")

    def __repr__(self) -> str:
        return f"{self.name}{list(self.shape)}"


class InnerSplit(NamedTuple):
    """The second cut of a placement over a grid of devices: groups of ``parts`` neighbours, each
    device of a group computing slice ``j`` of its group's part along ``name`` (in ``blocks``), or
    all of it where ``name`` is ``None`` (replicated inside the group)."""

    name: Optional[str]
    parts: int
    blocks: Blocks = 1


class Axis(StrEnum):
    """One axis of a grid placement: across the groups (``OUTER``), or inside each group of
    neighbours (``INNER``). Tensor parallelism inside context parallelism runs its collectives on
    the inner axis, the sequence's on the outer one."""

    OUTER = "outer"
    INNER = "inner"


@dataclass
class Placement:
    """Where a node runs: on ``devices`` (plan device ids), whole or split along one dimension.

    ``split=None`` means every device computes the whole op (replicated); ``split='n'`` means device
    ``devices[i]`` computes slice ``i`` of ``len(devices)`` along the annotated dimension ``n``.
    ``blocks=3`` makes that slice strided: ``n`` is three equal blocks (q, k, v of a fused projection)
    and device ``i`` computes slice ``i`` of each; ``blocks=(2, 1, 1)`` the same with unequal
    blocks (a grouped-query qkv: ``nbscaler.blocks``). ``inner=InnerSplit(h, p)`` cuts the devices
    into groups of ``p`` neighbours: group ``g`` computes slice ``g`` along ``split``, and device ``j``
    of it slice ``j`` of that along ``h`` (experts cut by expert and by hidden unit; tensor
    parallelism inside context parallelism, with ``h=None`` for an op the group runs whole).
    """

    devices: Tuple[int, ...]
    split: Optional[str] = None
    blocks: Blocks = 1
    inner: Optional[InnerSplit] = None      # each part of ``split`` cut again, over groups of neighbours

    @property
    def parts(self) -> int:
        return len(self.devices) if self.split is not None else 1

    @property
    def work_parts(self) -> int:
        """How many parts the op's work is cut into (each device computes one): ``parts``, and over a
        grid the groups' parts times the parts inside each (1 where a group runs it whole)."""
        if self.inner is None:
            return self.parts
        return self.axis_view(Axis.OUTER).parts * self.axis_view(Axis.INNER).parts

    def axis_view(self, axis: Axis) -> "Placement":
        """The one-axis placement of a grid placement along ``axis``, over the first group of that
        axis: what every layout rule of a plain placement reads (``comm.layout``)."""
        p = self.inner.parts
        if axis == Axis.OUTER:
            return Placement(self.devices[::p], self.split, self.blocks)
        return Placement(self.devices[:p], self.inner.name, self.inner.blocks if self.inner.name else 1)

    def views(self) -> List[Tuple[Optional[Axis], "Placement"]]:
        """``(axis, one-axis placement)`` for each axis: ``[(None, self)]`` unless over a grid."""
        return [(None, self)] if self.inner is None else [(a, self.axis_view(a)) for a in Axis]

    def group_of(self, axis: Optional[Axis], device: int) -> Tuple[int, ...]:
        """The devices ``device`` runs the collectives of ``axis`` with (all of them for ``None``)."""
        return self.devices if axis is None else self.axis_group(axis, device)

    def axis_group(self, axis: Axis, device: int) -> Tuple[int, ...]:
        """The devices ``device`` runs ``axis``'s collectives with: its own group of neighbours
        (``INNER``), or the devices at its place in every group (``OUTER``)."""
        p, i = self.inner.parts, self.devices.index(device)
        return self.devices[i % p::p] if axis == Axis.OUTER else self.devices[i - i % p:i - i % p + p]

    def __str__(self) -> str:
        devs = ",".join(map(str, self.devices))
        strided = f" in {describe(self.blocks)}" if is_strided(self.blocks) else ""
        if self.inner and self.inner.name is None:
            inner = f" in groups of {self.inner.parts}, each running it whole"
        else:
            inner = f" in groups of {self.inner.parts}, each split {self.inner.name!r}" if self.inner else ""
        return f"split {self.split!r}{strided}{inner} over [{devs}]" if self.split else f"replicated on [{devs}]"


#: ``node.meta`` key of the recomputed region an op belongs to (written by ``policy.recompute``, read
#: by code generation and the cost model): the ops of one region run again in the backward.
RECOMPUTE_REGION = "recompute"
#: ``graph.meta`` key of ZeRO stage 3's units (written by ``policy.shard_units``, read by lowering):
#: each trained parameter's name -> the unit whose parameters are gathered with it.
SHARD_UNITS = "shard_units"
#: ``graph.meta`` key: whether ZeRO stage 3 frees a unit's gathered parameters after its forward.
SHARD_RESHARD = "shard_reshard_after_forward"
#: The unit of the parameters outside every named module (embeddings, final norm, head).
REST_UNIT = "(rest)"
#: ``node.meta`` key of how a context-parallel attention reads the other devices' keys (``'all_gather'``
#: or ``'ring'``; written by ``policy.context``, read by lowering, code generation and the cost model).
CONTEXT_KIND = "context_kind"
#: ``node.meta`` key of an expert op run expert-parallel (written by ``policy.experts``, read by
#: lowering, code generation and the cost model): its tokens split over the devices as the batch is,
#: its experts (dim 0 of its weights) over the same devices, the pairs sent between them.
EXPERT_PARALLEL = "expert_parallel"
#: ``node.meta`` key of how many parts each expert's hidden units are cut into inside an
#: expert-parallel op (written by ``policy.experts``): its devices are then groups of that many,
#: each group holding its experts, each device of it its share of their hidden units.
EXPERT_HIDDEN_PARTS = "expert_hidden_parts"
#: The suffix of the region of an attention core (``recompute='selective'``): ``'blocks.0.attn:core'``.
RECOMPUTE_CORE = ":core"


def in_module(path: str, name: str) -> bool:
    """Whether an op at module ``path`` runs inside a module called ``name``: its qualified name or
    any run of its parts (``"lm_head"``, ``"layers"``, ``"model.layers.3"``).

    >>> in_module("model.layers.3.mlp.up_proj", "layers"), in_module("model.layers_norm", "layers")
    (True, False)
    """
    return f".{name}." in f".{path}."


def recompute_runs(nodes: Sequence["IRNode"]) -> List[Tuple[Optional[str], List["IRNode"]]]:
    """``nodes`` cut into consecutive runs of one recomputed region, or of no region (``None``)."""
    out: List[Tuple[Optional[str], List[IRNode]]] = []
    for node in nodes:
        region = node.meta.get(RECOMPUTE_REGION)
        if out and out[-1][0] == region:
            out[-1][1].append(node)
        else:
            out.append((region, [node]))
    return out


@dataclass(eq=False)
class IRNode:
    """One recorded torch-function call."""

    name: str
    target: str                       # 'torch.nn.functional.linear', 'Tensor.view', 'Tensor.T', ...
    op: str                           # the registry's op name, 'opaque' when unknown
    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    outputs: Any                      # the call's result structure with IRTensor leaves
    module_path: str = ""
    source: Optional[Tuple[str, int]] = None    # (file, line) of the user's code
    annotation: Optional[OpAnnotation] = None
    inplace: bool = False             # the call mutates and returns its first argument
    placement: Optional[Placement] = None
    stage: Optional[int] = None       # pipeline stage, set by staging
    meta: Dict[str, Any] = field(default_factory=dict)   # facts written by analysis passes (cost/, ...)

    @functools.cached_property
    def flat_args(self) -> Tuple[List[Any], Any]:
        """``tree_flatten((args, kwargs))``: the leaves in flattened argument order and the structure."""
        return tree_flatten((self.args, self.kwargs))

    @functools.cached_property
    def inputs(self) -> List[IRTensor]:
        """Tensor arguments in flattened argument order (the annotation's input order)."""
        return [x for x in self.flat_args[0] if isinstance(x, IRTensor)]

    @functools.cached_property
    def output_tensors(self) -> List[IRTensor]:
        leaves, _ = tree_flatten(self.outputs)
        return [x for x in leaves if isinstance(x, IRTensor)]

    def map_args(self, fn) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """``args`` and ``kwargs`` with every ``IRTensor`` replaced by ``fn(tensor)``."""
        conv = lambda x: fn(x) if isinstance(x, IRTensor) else x
        return tree_map(conv, self.args), tree_map(conv, self.kwargs)

    def __repr__(self) -> str:
        where = f" @ {self.module_path}" if self.module_path else ""
        ins = ", ".join(t.name for t in self.inputs)
        outs = ", ".join(t.name for t in self.output_tensors)
        return f"IRNode({outs} = {self.target}({ins}){where})"


@dataclass
class IRGraph:
    """A traced forward pass: ordered nodes, the tensors they connect, inputs and outputs.

    ``mode`` is ``'train'`` or ``'eval'``: a module whose forward depends on ``self.training`` is
    traced once per mode, and each graph is planned on its own.
    """

    nodes: List[IRNode]
    inputs: List[IRTensor]                       # forward-argument tensors, in flattened order
    input_spec: Any                              # the forward args' structure with IRTensor leaves
    outputs: Any                                 # the forward's result with IRTensor leaves
    weights: Dict[str, IRTensor]                 # qualified name -> param/buffer/constant tensor
    mode: str = "train"
    meta: Dict[str, Any] = field(default_factory=dict)

    def __iter__(self) -> Iterator[IRNode]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def select(self, op: Optional[str] = None, module: Optional[str] = None) -> List[IRNode]:
        """Nodes filtered by op name and/or module path prefix, e.g. ``select(module='blocks.0')``."""
        return [n for n in self.nodes
                if (op is None or n.op == op)
                and (module is None or n.module_path == module or n.module_path.startswith(module + "."))]

    def consumers(self) -> Dict[int, List[IRNode]]:
        """``id(tensor) -> nodes reading it``, in graph order."""
        out: Dict[int, List[IRNode]] = {}
        for node in self.nodes:
            for t in node.inputs:
                out.setdefault(id(t), []).append(node)
        return out

    def output_tensors(self) -> List[IRTensor]:
        leaves, _ = tree_flatten(self.outputs)
        return [x for x in leaves if isinstance(x, IRTensor)]

    def signature(self) -> List[Tuple]:
        """A structural fingerprint: equal for two traces that compute the same thing."""
        sig = []
        for n in self.nodes:
            args, kwargs = n.map_args(lambda t: ("T", t.name))
            sig.append((n.target, repr(args), repr(sorted(kwargs.items())),
                        tuple(t.name for t in n.output_tensors)))
        return sig

    def copy(self) -> "IRGraph":
        """A structural copy without placements, stages or ``node.meta``: new nodes and tensors, so a
        policy can place it anew while this graph keeps its own placement. Annotations, source
        locations, constant arguments and ``graph.meta`` values are shared (nothing mutates them)."""
        new: Dict[int, IRTensor] = {}

        def tensor(t: IRTensor) -> IRTensor:
            if id(t) not in new:
                new[id(t)] = dataclasses.replace(t, producer=None)
            return new[id(t)]

        remap = lambda x: tensor(x) if isinstance(x, IRTensor) else x
        nodes = []
        for n in self.nodes:
            args, kwargs = n.map_args(tensor)
            node = IRNode(n.name, n.target, n.op, args, kwargs, tree_map(remap, n.outputs), n.module_path, n.source,
                          n.annotation, n.inplace)
            for t in node.output_tensors:
                if t.producer is None:
                    t.producer = node
            nodes.append(node)
        return IRGraph(nodes, [tensor(t) for t in self.inputs], tree_map(remap, self.input_spec),
                       tree_map(remap, self.outputs), {k: tensor(t) for k, t in self.weights.items()}, self.mode,
                       dict(self.meta))

    def describe(self, limit: Optional[int] = None) -> str:
        """A readable listing, one node a line: output = op(inputs)  placement  module."""
        lines = []
        for n in self.nodes[:limit]:
            place = f"  [{n.placement}]" if n.placement else ""
            lines.append(f"{repr(n)[7:-1]}{place}")
        return "\n".join(lines)


def fed_by_inputs(graph: IRGraph) -> Set[int]:
    """``id`` of every tensor computed from the forward's arguments (the data), as opposed to one
    the model makes itself from constants, ``torch.arange`` or its buffers (positions, masks)."""
    fed = {id(t) for t in graph.inputs}
    for node in graph.nodes:
        if any(id(t) in fed for t in node.inputs):
            fed.update(id(t) for t in node.output_tensors)
    return fed


def requires_grad_of(graph: IRGraph, inputs_as_traced: bool = False) -> Dict[int, bool]:
    """Which tensors can carry a gradient: parameters, float inputs, and whatever they feed.

    ``inputs_as_traced``: a float input carries one only where the traced input required one, as
    for the batches the plan is priced for (the lowering asks without it, so that the generated code
    is right for an input that needs a gradient too)."""
    grad: Dict[int, bool] = {}
    for t in graph.inputs:
        grad[id(t)] = t.dtype.is_floating_point and (t.requires_grad or not inputs_as_traced)
    for t in graph.weights.values():
        grad[id(t)] = t.kind == "param" and t.requires_grad
    for node in graph.nodes:
        flows = any(grad.get(id(t), False) for t in node.inputs)
        for t in node.output_tensors:
            grad[id(t)] = flows and t.dtype.is_floating_point
    return grad


def tied_stages(graphs: Dict[str, IRGraph]) -> Dict[str, Tuple[int, ...]]:
    """Parameters read in more than one pipeline stage (tied embeddings): name -> those stages.

    Each such stage keeps a copy; the copies' gradients are summed between the stages (as
    Megatron does for a tied input embedding and output head), so they stay equal, and a merged
    checkpoint holds the tensor once."""
    stages: Dict[str, set] = {}
    for g in graphs.values():
        for n in g.nodes:
            for t in n.inputs:
                if t.kind == "param" and n.stage is not None:
                    stages.setdefault(t.name, set()).add(n.stage)
    return {name: tuple(sorted(s)) for name, s in stages.items() if len(s) > 1}
