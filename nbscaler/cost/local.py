"""Run one device's share of a placed graph on fake tensors: local shapes, collectives, saved tensors.

A rank's program (``comm.lower``) is the graph's nodes that run on its plan device, at local
shapes, with a collective wherever a tensor changes layout; code generation prints it.
``run_local`` runs the same program, instruction by instruction, under ``FakeTensorMode``: every
tensor has the shape, strides, dtype and aliasing it would have at run time, but no memory. So it
can say, without a process group or any real arithmetic:

- the local shapes each node reads and makes (for the time model's per-op profile);
- each collective with the bytes it moves (for the communication model);
- which tensors autograd saves for the backward, each storage once, the way the measured
  ``saved_tensors_hooks`` count sees them (the activation memory). The ops of a recomputed region
  (``node.meta['recompute']``) are replayed as code generation writes them: their inputs fetched
  first and kept, what the ops save counted apart (``LocalRun.rebuilt``), since the forward drops it.

Fake tensors pretend to live on a real device type (the CPU here, CUDA where there is one), so
ops pick the kernels they would pick there: ``scaled_dot_product_attention`` saves what the CPU
flash kernel saves, not what the generic math path would.

>>> program = plan.programs[0]                                          # doctest: +SKIP
>>> run = run_local(program.sections[0])                               # doctest: +SKIP
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

from nbscaler.comm.layout import local_call, local_shape, output_layout
from nbscaler.comm.program import Call, Fetch, Instruction, Receive, Recompute, Section, Value
from nbscaler.ir.graph import IRNode, IRTensor, requires_grad_of
from nbscaler.ir.layer_rules import vocab_parallel
from nbscaler.ir.registry import USER_OPS, spec_of
from nbscaler.layouts import Collective


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
    saved_keys: Tuple[int, ...] = ()    # every storage it keeps saved (keys of LocalRun.saved), new or not


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


class _Env(dict):
    """The values of a replay (``Value`` -> fake tensor); a weight is made on its first read."""

    def __init__(self, make: Callable[[Value], torch.Tensor], weights: Sequence[Value]):
        super().__init__()
        self.make, self.weights = make, set(weights)

    def __missing__(self, v: Value) -> torch.Tensor:
        if v not in self.weights:
            raise KeyError(v)
        self[v] = w = self.make(v)
        return w


class _Replay:
    """Runs one lowered section on fake tensors, one instruction at a time (as ``torch.fx.Interpreter``
    runs a graph): an environment maps each value of the program to the fake tensor that holds it."""

    def __init__(self, section: Section):
        self.sec = section
        self.run = LocalRun(section.device, section.stage)
        self.env = _Env(self.weight, section.weights)
        self.weight_keys: set = set()
        self.seen: set = set()
        self.fake_device = fake_device()
        self.region: Optional[str] = None      # the recomputed region being replayed
        self.region_seen: set = set()
        self._grad: Optional[Dict[int, bool]] = None

    def weight(self, v: Value) -> torch.Tensor:
        """A stored weight, made when the program first reads it (a stage reads a few of the
        graph's weights; making them all cost more than the replay)."""
        t = v.tensor
        w = torch.empty(v.shape, dtype=t.dtype, device=self.fake_device,
                        requires_grad=t.kind == "param" and t.dtype.is_floating_point)
        self.weight_keys.add(_storage_key(w))
        return w

    def grad(self) -> Dict[int, bool]:
        """Which tensors of the graph carry a gradient (only asked when an op could not be replayed)."""
        if self._grad is None:
            self._grad = requires_grad_of(self.sec.graph)
        return self._grad

    def instruction(self, ins: Instruction) -> None:
        if isinstance(ins, Receive):            # as the pipeline executor makes it: requiring a gradient
            t = ins.value.tensor
            self.env[ins.value] = torch.empty(t.shape, dtype=t.dtype, device=self.fake_device,
                                              requires_grad=t.dtype.is_floating_point)
        elif isinstance(ins, Call):
            self.call(ins)
        elif isinstance(ins, Recompute):
            self.recompute(ins)
        else:                                   # Send, Return: the outputs gathered
            self.fetches(ins.fetches)

    def fetches(self, fetches: Sequence[Fetch]) -> None:
        for f in fetches:
            index = f.devices.index(self.sec.device) if self.sec.device in f.devices else 0
            for c in f.steps:
                value = self.env[c.src]
                out = _collective(c.step.fn, value, c.step.dim, c.step.dim2, len(f.devices), index)
                self.run.collectives.append(CollectiveCall(c.step.fn, f.tensor.name, f.devices, _nbytes(value),
                                                           _nbytes(out), f.consumer.name if f.consumer else None,
                                                           f.region is not None))
                self.env[c.dst] = out

    def call(self, call: Call) -> None:
        self.fetches(call.fetches)
        node, place = call.node, call.node.placement
        inputs = [self.env[v] for v in call.inputs]
        args, kwargs = call_args(node, inputs, self.fake_device)
        packed: List[torch.Tensor] = []
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda x: (packed.append(x), x)[1], lambda x: x):
                result = call_node(node, args, kwargs)
            produced = [r for r in _leaves(result, node.outputs)]
        except Exception as err:                          # data-dependent shapes and the like
            self.run.exact = False
            warnings.warn(f"the cost model could not replay {node.target} ({node.name}) on fake tensors "
                          f"({type(err).__name__}: {err}); it assumes the op saves its inputs.", stacklevel=4)
            produced = [torch.empty(local_shape(v.tensor.shape, v.layout, place.parts), dtype=v.tensor.dtype,
                                    device=self.fake_device) for v in call.outputs]
            grad = self.grad()
            packed = [x for x, v in zip(inputs, call.inputs) if x.is_floating_point() and grad.get(id(v.tensor), False)]
        if vocab_parallel(node) and node.op == "loss":
            # the runtime's vocab_cross_entropy saves its softmax and the targets: the bytes of
            # cross_entropy's log-softmax and targets, without nll_loss's 0-dim total weight
            packed = [x for x in packed if x.dim() > 0]
        new_bytes = self.save(packed)
        for v, value in zip(call.outputs, produced):
            self.env[v] = value
        self.run.ops.append(OpCall(node, tuple((tuple(x.shape), x.dtype, x.requires_grad) for x in inputs),
                                   tuple((tuple(v.shape), v.dtype) for v in produced), new_bytes,
                                   self.region is not None, self._kept_keys(packed)))

    def _kept_keys(self, tensors: Sequence[torch.Tensor]) -> Tuple[int, ...]:
        """The storages of ``tensors`` the forward keeps saved (none inside a recomputed region)."""
        if self.region is not None:
            return ()
        return tuple(dict.fromkeys(k for k in map(_storage_key, tensors) if k in self.run.saved))

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

    def recompute(self, region: Recompute) -> None:
        """A recomputed region: its inputs fetched before it (and kept for the backward, as
        ``torch.utils.checkpoint`` keeps them), then its ops."""
        self.fetches(region.fetches)
        inputs = [self.env[v] for v in region.inputs]
        kept = self.save(inputs)
        self.region, self.region_seen = region.region, {_storage_key(x) for x in inputs}    # held anyway
        try:
            for call in region.body:
                self.call(call)
        finally:
            self.region = None
        n = len(region.body)
        first = self.run.ops[-n]
        self.run.ops[-n] = dataclasses.replace(first, saved_bytes=first.saved_bytes + kept,
                                               saved_keys=self._kept_keys(inputs))


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
        args = (args[0], local_shape(node.output_tensors[0].shape, output_layout(node, 0), parts))
        kwargs = {k: v for k, v in kwargs.items() if k not in ("shape", "size")}
    return tree_map(lambda v: device if isinstance(v, torch.device) else v, (args, kwargs))


def fake_device() -> torch.device:
    """The device type fake tensors pretend to be on: where the runtime would run."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def run_local(section: Section, train: bool = True) -> LocalRun:
    """Replay one lowered ``section`` of a rank's program on fake tensors, at its local shapes.

    Inputs are replicated and need no gradient; tensors received from the previous stage are replicated and need one when floating,
    as the pipeline executor makes them. ``train=False`` runs without autograd (nothing is saved).
    """
    replay = _Replay(section)
    with FakeTensorMode(allow_non_fake_inputs=False), torch.set_grad_enabled(train):
        for v in section.inputs:
            replay.env[v] = torch.empty(v.tensor.shape, dtype=v.tensor.dtype, device=replay.fake_device)
        for ins in section.instructions:
            replay.instruction(ins)
    return replay.run


def local_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * (torch.finfo(dtype).bits // 8 if dtype.is_floating_point
                               else 1 if dtype == torch.bool else torch.iinfo(dtype).bits // 8)
