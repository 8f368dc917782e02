"""Run one device's share of a placed graph on fake tensors: local shapes, collectives, saved tensors.

The generated code of a rank is the graph's nodes that run on its plan device, at local shapes,
with a collective wherever a tensor changes layout. ``run_local`` replays exactly that (the same
conversion rules as code generation) under ``FakeTensorMode``: every tensor has the shape, strides,
dtype and aliasing it would have at run time, but no memory. So it can say, without a process
group or any real arithmetic:

- the local shapes each node reads and makes (for the time model's per-op profile);
- each collective with the bytes it moves (for the communication model);
- which tensors autograd saves for the backward, each storage once, the way the measured
  ``saved_tensors_hooks`` count sees them (the activation memory). The ops of a recomputed region
  (``node.meta['recompute']``) are replayed as code generation writes them: their inputs fetched
  first and kept, what the ops save counted apart (``LocalRun.rebuilt``), since the forward drops it.

Fake tensors pretend to live on a real device type (the CPU here, CUDA where there is one), so
ops pick the kernels they would pick there: ``scaled_dot_product_attention`` saves what the CPU
flash kernel saves, not what the generic math path would.

>>> run = run_local(graph, device=0, storage=storage_layouts([graph]))    # doctest: +SKIP
>>> run.saved_bytes, [c.fn for c in run.collectives][:2]
(1409024, ['sum_grad', 'all_reduce'])
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_map

from nbscaler.comm.layout import Layout, conversion, input_requirement, local_call, output_layout
from nbscaler.ir.graph import IRGraph, IRNode, IRTensor, recompute_runs
from nbscaler.ir.registry import USER_OPS, spec_of
from nbscaler.layouts import Collective, LayoutKind


def grad_flow(graph: IRGraph) -> Dict[int, bool]:
    """Which tensors can carry a gradient (by ``id``): trainable parameters, float inputs, and what
    they feed. Code generation decides with the same rule whether an ``R*`` input needs its
    backward all-reduce."""
    grad: Dict[int, bool] = {id(t): t.dtype.is_floating_point for t in graph.inputs}
    for t in graph.weights.values():
        grad[id(t)] = t.kind == "param" and t.requires_grad
    for node in graph.nodes:
        flows = any(grad.get(id(t), False) for t in node.inputs)
        for t in node.output_tensors:
            grad[id(t)] = flows and t.dtype.is_floating_point
    return grad


def resolve(target: str) -> Callable:
    """The callable behind an IR target name (``'torch.nn.functional.linear'``, a user op, ...)."""
    if target in USER_OPS:
        return USER_OPS[target]
    module, _, name = target.rpartition(".")
    parts = module.split(".")
    for i in range(len(parts), 0, -1):      # the longest importable prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:] + [name]:
            obj = getattr(obj, attr)
        return obj
    raise ValueError(f"cannot find the function {target!r}")


def call_node(node: IRNode, args: Tuple, kwargs: Dict[str, Any]) -> Any:
    """Call ``node``'s target on concrete (here: fake) arguments, as the generated code would."""
    target = node.target
    if target.startswith("Tensor."):
        name = target[len("Tensor."):]
        first, rest = args[0], args[1:]
        if name == "__setitem__":
            first[rest[0]] = rest[1]
            return first
        attr = getattr(first, name)
        if not callable(attr):            # a property such as Tensor.T
            return attr
        return attr(*rest, **kwargs)
    return resolve(target)(*args, **kwargs)


@dataclass(frozen=True)
class CollectiveCall:
    """One collective a device runs in the forward; its backward runs the matching one."""

    fn: str                     # a function of nbscaler.runtime.collectives
    tensor: str                 # the IR tensor it converts
    devices: Tuple[int, ...]    # the plan devices of its group
    in_bytes: int               # local bytes it reads
    out_bytes: int              # local bytes it makes
    node: Optional[str] = None  # the consumer that asked for it (None: a stage or module output)
    recomputed: bool = False    # inside a recomputed region: the backward runs its forward again


@dataclass(frozen=True)
class OpCall:
    """One node as a device runs it: its local input and output shapes and dtypes."""

    node: IRNode
    in_shapes: Tuple[Tuple[Tuple[int, ...], torch.dtype, bool], ...]   # (shape, dtype, requires_grad)
    out_shapes: Tuple[Tuple[Tuple[int, ...], torch.dtype], ...]
    saved_bytes: int            # bytes of storages this op saved that nothing before it had saved
    recomputed: bool = False    # in a recomputed region: its saved bytes live only while the backward rebuilds it


@dataclass
class LocalRun:
    """What one plan device does in one forward (or one pipeline stage) of a graph."""

    device: int
    stage: Optional[int]
    ops: List[OpCall] = field(default_factory=list)
    collectives: List[CollectiveCall] = field(default_factory=list)
    saved: Dict[int, int] = field(default_factory=dict)    # storage key -> bytes, weights excluded
    exact: bool = True                                       # False when some op had to be guessed
    rebuilt: Dict[str, int] = field(default_factory=dict)   # recomputed region -> bytes its rebuild saves

    @property
    def saved_bytes(self) -> int:
        """Bytes autograd keeps for the backward of this forward (each storage once)."""
        return sum(self.saved.values())


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _local_shape(shape: Sequence[int], layout: Layout, parts: int) -> Tuple[int, ...]:
    shape = list(shape)
    if layout.kind == LayoutKind.SPLIT:
        shape[layout.dim] //= parts
    return tuple(shape)


class _Apply(torch.autograd.Function):
    """Stands in for a differentiable collective: its forward, and nothing saved (like the real ones)."""

    @staticmethod
    def forward(ctx, x, fn):
        return fn(x)

    @staticmethod
    def backward(ctx, grad):          # never run: fake runs stop at the forward
        return grad, None


def _collective(fn: str, x: torch.Tensor, dim: Optional[int], dim2: Optional[int], n: int, index: int) -> torch.Tensor:
    """The local result of collective ``fn`` over ``n`` devices on the one at ``index``, with the
    same allocation and aliasing as ``nbscaler.runtime.collectives`` (values do not matter)."""
    if n == 1:
        return x                                       # a group of one: the collectives return x
    gather = lambda t, d: torch.cat([torch.empty_like(t) for _ in range(n)], dim=d)
    piece = lambda t, d: t.chunk(n, dim=d)[index].contiguous()
    impl = {
        Collective.ALL_GATHER: lambda t: gather(t, dim),
        Collective.ALL_GATHER_SUM_GRAD: lambda t: gather(t, dim),
        Collective.CHUNK: lambda t: piece(t, dim),
        Collective.ALL_REDUCE: lambda t: t.contiguous().clone(),
        Collective.REDUCE_SCATTER: lambda t: piece(t.contiguous().clone(), dim),
        Collective.ALL_TO_ALL: lambda t: piece(gather(t, dim2), dim),
        Collective.SUM_GRAD: lambda t: t.view_as(t),
        Collective.FIRST_ONLY: lambda t: t.view_as(t) if index == 0 else torch.zeros_like(t),
    }[fn]
    if fn == Collective.SUM_GRAD and not x.requires_grad:
        return x
    return _Apply.apply(x, impl) if x.requires_grad else impl(x)


class _Replay:
    """Walks a section of the graph for one device, binding fake tensors the way the emitter binds names."""

    def __init__(self, graph: IRGraph, device: int, storage: Dict[str, Layout], stage: Optional[int]):
        self.graph, self.device, self.storage = graph, device, storage
        self.run = LocalRun(device, stage)
        self.values: Dict[int, Dict[Layout, torch.Tensor]] = {}
        self.have: Dict[int, Layout] = {}
        self.grad = grad_flow(graph)
        self.weight_keys: set = set()
        self.seen: set = set()
        self.fake_device = fake_device()
        self.region: Optional[str] = None      # the recomputed region being replayed
        self.region_seen: set = set()

    def bind(self, t: IRTensor, layout: Layout, value: torch.Tensor) -> None:
        self.have[id(t)] = layout
        self.values.setdefault(id(t), {})[layout] = value

    def fetch(self, t: IRTensor, want: Layout, devices: Tuple[int, ...], consumer: Optional[str]) -> torch.Tensor:
        if want.kind == LayoutKind.SUM_GRAD and not self.grad.get(id(t), False):
            want = Layout.replicated()
        known = self.values[id(t)]
        if want in known:
            return known[want]
        have = self.have[id(t)]
        value = known[have]
        index = devices.index(self.device) if self.device in devices else 0
        for step in conversion(have, want):
            out = _collective(step.fn, value, step.dim, step.dim2, len(devices), index)
            self.run.collectives.append(CollectiveCall(step.fn, t.name, devices, _nbytes(value), _nbytes(out), consumer,
                                                       self.region is not None))
            value = out
        known[want] = value
        return value

    def node(self, node: IRNode) -> None:
        place = node.placement
        inputs = [self.fetch(t, input_requirement(node, i), place.devices, node.name) for i, t in enumerate(node.inputs)]
        args, kwargs = call_args(node, inputs, self.fake_device)
        outs = node.output_tensors
        layouts = [output_layout(node, i) for i in range(len(outs))]
        packed: List[torch.Tensor] = []
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda x: (packed.append(x), x)[1], lambda x: x):
                result = call_node(node, args, kwargs)
            produced = [r for r in _leaves(result, node.outputs)]
        except Exception as err:                          # data-dependent shapes and the like
            self.run.exact = False
            warnings.warn(f"the cost model could not replay {node.target} ({node.name}) on fake tensors "
                          f"({type(err).__name__}: {err}); it assumes the op saves its inputs.", stacklevel=4)
            produced = [torch.empty(_local_shape(t.shape, lay, place.parts), dtype=t.dtype,
                                    device=self.fake_device) for t, lay in zip(outs, layouts)]
            packed = [x for x, t in zip(inputs, node.inputs) if x.is_floating_point() and self.grad.get(id(t), False)]
        new_bytes = self.save(packed)
        for t, lay, value in zip(outs, layouts, produced):
            self.bind(t, lay, value)
        self.run.ops.append(OpCall(node, tuple((tuple(x.shape), x.dtype, x.requires_grad) for x in inputs),
                                   tuple((tuple(v.shape), v.dtype) for v in produced), new_bytes,
                                   self.region is not None))

    def save(self, tensors: Sequence[torch.Tensor]) -> int:
        """Count what autograd saves (each storage once, weights left out); returns the new bytes.

        Inside a recomputed region the forward keeps none of it: the bytes go to the region's
        rebuild (``LocalRun.rebuilt``) and the op reports none."""
        new_bytes = 0
        seen = self.region_seen if self.region is not None else self.seen
        for x in tensors:
            key = _storage_key(x)
            if key in self.weight_keys or key in seen:
                continue
            seen.add(key)
            nbytes = x.untyped_storage().nbytes()
            new_bytes += nbytes
            if self.region is None:
                self.run.saved[key] = nbytes
        if self.region is not None:
            self.run.rebuilt[self.region] = self.run.rebuilt.get(self.region, 0) + new_bytes
            return 0
        return new_bytes

    def region_nodes(self, region: str, nodes: Sequence[IRNode]) -> None:
        """A recomputed region as code generation writes it: its inputs fetched before it (and kept
        for the backward, as ``torch.utils.checkpoint`` keeps them), then its ops."""
        made = {id(t) for n in nodes for t in n.output_tensors}
        inputs = [self.fetch(t, input_requirement(n, i), n.placement.devices, n.name)
                  for n in nodes for i, t in enumerate(n.inputs) if id(t) not in made]
        kept = self.save(inputs)
        self.region, self.region_seen = region, {_storage_key(x) for x in inputs}    # held anyway
        try:
            for n in nodes:
                self.node(n)
        finally:
            self.region = None
        first = self.run.ops[-len(nodes)]
        self.run.ops[-len(nodes)] = dataclasses.replace(first, saved_bytes=first.saved_bytes + kept)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _leaves(result: Any, outputs: Any) -> List[torch.Tensor]:
    """The tensors of ``result`` at the positions of the IR's output tensors."""
    if isinstance(outputs, IRTensor):
        return [result]
    if isinstance(outputs, (tuple, list)):
        out = []
        for r, o in zip(result, outputs):
            out += _leaves(r, o)
        return out
    if isinstance(outputs, dict):
        return [x for k in outputs for x in _leaves(result[k], outputs[k])]
    return []


def call_args(node: IRNode, inputs: Sequence[torch.Tensor], device: torch.device) -> Tuple[Tuple, Dict[str, Any]]:
    """``node``'s arguments with its tensor inputs (by position) replaced by local ``inputs``, shape
    arguments (view, reshape, expand) by the local output shape, and devices by ``device``: the call
    as the generated code makes it."""
    it = iter(inputs)
    args, kwargs = node.map_args(lambda t: next(it))
    args, kwargs = local_call(node, args, kwargs)
    spec = spec_of(node.target)
    if spec is not None and spec.shape_args:
        parts = node.placement.parts if node.placement else 1
        args = (args[0], _local_shape(node.output_tensors[0].shape, output_layout(node, 0), parts))
        kwargs = {k: v for k, v in kwargs.items() if k not in ("shape", "size")}
    return tree_map(lambda v: device if isinstance(v, torch.device) else v, (args, kwargs))


def fake_device() -> torch.device:
    """The device type fake tensors pretend to be on: where the runtime would run."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def run_local(graph: IRGraph, device: int, storage: Dict[str, Layout], stage: Optional[int] = None,
              carry_in: Sequence[IRTensor] = (), carry_out: Optional[Sequence[IRTensor]] = None,
              train: bool = True) -> LocalRun:
    """Replay plan ``device``'s share of ``graph`` (of pipeline ``stage``, when given) on fake tensors.

    ``carry_in`` are the tensors a stage receives (replicated, requiring a gradient when floating,
    as the pipeline executor makes them); ``carry_out`` those it sends on, gathered to replicated
    (``None``: the module's outputs). ``train=False`` runs without autograd (nothing is saved).
    """
    replay = _Replay(graph, device, storage, stage)
    parts = weight_parts(graph)
    with FakeTensorMode(allow_non_fake_inputs=False), torch.set_grad_enabled(train):
        empty = lambda t, grad: torch.empty(t.shape, dtype=t.dtype, device=replay.fake_device,
                                            requires_grad=grad and t.dtype.is_floating_point)
        for t in graph.inputs:
            replay.bind(t, Layout.replicated(), empty(t, False))
        for t in graph.weights.values():
            lay = storage.get(t.name, Layout.replicated())
            w = torch.empty(_local_shape(t.shape, lay, parts.get(t.name, 1)), dtype=t.dtype, device=replay.fake_device,
                            requires_grad=t.kind == "param" and t.dtype.is_floating_point)
            replay.weight_keys.add(_storage_key(w))
            replay.bind(t, lay, w)
        for t in carry_in:
            replay.bind(t, Layout.replicated(), empty(t, True))
        nodes = [n for n in graph.nodes if stage is None or n.stage == stage]
        for region, run in recompute_runs([n for n in nodes if device in n.placement.devices]):
            if region is None:
                for node in run:
                    replay.node(node)
            else:
                replay.region_nodes(region, run)
        group = tuple(sorted({d for n in nodes for d in n.placement.devices}))
        finals = carry_out if carry_out is not None else graph.output_tensors()
        for t in finals:
            if id(t) in replay.have:
                replay.fetch(t, Layout.replicated(), group, None)
    return replay.run


def weight_parts(graph: IRGraph) -> Dict[str, int]:
    """Over how many devices each weight is stored when split: the devices of its first reader."""
    parts: Dict[str, int] = {}
    for node in graph.nodes:
        for t in node.inputs:
            if t.is_weight:
                parts.setdefault(t.name, len(node.placement.devices))
    return parts


def local_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * (torch.finfo(dtype).bits // 8 if dtype.is_floating_point
                               else 1 if dtype == torch.bool else torch.iinfo(dtype).bits // 8)
