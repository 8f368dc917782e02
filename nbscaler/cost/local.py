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
from torch.utils._pytree import tree_unflatten

from nbscaler.comm.arguments import local_arguments
from nbscaler.comm.program import (Call, Fetch, Instruction, Receive, Recompute, Reshard, Return, Section, Send, Unshard,
                                   Value)
from nbscaler.cost.fake_calls import CALLS, FakeCalls, FakeStorages, FakeValue, Stored, call_key
from nbscaler import blocks as strided
from nbscaler.blocks import Blocks
from nbscaler.ir.expert_rules import (exchanged_bytes, exchanged_counts_bytes, expert_hidden_parts, expert_parallel,
                                      routed_imbalance)
from nbscaler.ir.graph import CONTEXT_KIND, IRNode, IRTensor, requires_grad_of
from nbscaler.ir.layer_rules import context_group, context_parallel, counted_tokens_bytes, vocab_parallel
from nbscaler.attention import context_attention
from nbscaler.losses import split_cross_entropy
from nbscaler.experts import parallel as experts_parallel
from nbscaler.experts.grouped import FAKE_STAND_INS
from nbscaler.ir.registry import USER_OPS
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


def call_node(node: IRNode, args: Tuple, kwargs: Dict[str, Any], device: Optional[int] = None,
              imbalance: float = 1.0) -> Any:
    """Call ``node``'s target on concrete (here: fake) arguments, as the generated code of plan
    ``device`` would (the device matters to an expert-parallel op: which experts it holds;
    ``imbalance``: a dropless one's rows over a balanced routing's, ``Recipe.expert_imbalance``)."""
    target = node.target
    experts = expert_parallel(node)
    if experts is not None:         # the runtime's call, its exchanges sized for the routing priced
        place = node.placement
        index = place.devices.index(device) if device in place.devices else 0
        group = experts_parallel.PlannedGroup(place.parts, index, routed_imbalance(node, imbalance))
        return getattr(experts_parallel, experts)(*args, **kwargs, group=group, hidden_parts=expert_hidden_parts(node))
    kind = context_parallel(node)
    if kind is not None:            # the runtime's call, as a device alone would make it
        fn = context_attention if kind == "attention" else split_cross_entropy
        extra = {"kind": node.meta[CONTEXT_KIND], "blocks": node.placement.blocks} if kind == "attention" else {}
        if kind == "loss":          # a plain cross-entropy: of F.cross_entropy's keywords, the call takes ignore_index
            kwargs = {k: v for k, v in kwargs.items() if k == "ignore_index"}
            if vocab_parallel(node):        # its classes split too: the runtime's vocabulary-parallel sum
                kwargs["vocab_start"] = 0
        return fn(*args, **kwargs, **extra, group=None)
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
    fn = resolve(target)
    return FAKE_STAND_INS.get(fn, fn)(*args, **kwargs)


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
    backward: bool = True       # its input carries a gradient, so autograd runs its backward

    def seconds(self, comm: Any) -> Tuple[float, float]:
        """Forward and backward seconds under ``comm`` (a ``CommModel``): the backward's collective only
        where autograd runs it, and a recomputed collective's forward again in the backward."""
        f = comm.forward(self.fn, self.in_bytes, len(self.devices), ranks=self.devices)
        b = comm.backward(self.fn, self.in_bytes, len(self.devices), ranks=self.devices) if self.backward else 0.0
        return f, b + (f if self.recomputed else 0.0)


@dataclass(frozen=True)
class OpCall:
    """One node as a device runs it: its local input and output shapes and dtypes."""

    node: IRNode
    in_shapes: Tuple[Tuple[Tuple[int, ...], torch.dtype, bool], ...]   # (shape, dtype, requires_grad)
    out_shapes: Tuple[Tuple[Tuple[int, ...], torch.dtype], ...]
    saved_bytes: int            # bytes of storages this op saved that nothing before it had saved
    recomputed: bool = False    # in a recomputed region: its saved bytes live only while the backward rebuilds it
    saved_keys: Tuple[int, ...] = ()    # every storage it keeps saved (keys of LocalRun.saved), new or not
    scale: float = 1.0          # its work over a balanced routing's (dropless expert parallelism: ``routed_imbalance``)


@dataclass(frozen=True)
class UnitEvent:
    """A ZeRO-3 ``Unshard`` or ``Reshard`` as the forward reaches it: ``saved`` bytes kept for the
    backward so far (what the forward holds just before, with what the units gathered then)."""

    unshard: bool                 # False: a Reshard
    unit: str
    prefetch: Optional[str]
    saved: int


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
    units: List[UnitEvent] = field(default_factory=list)    # ZeRO-3's gathers and frees, in order

    @property
    def saved_bytes(self) -> int:
        """Bytes autograd keeps for the backward of this forward (each storage once)."""
        return sum(self.saved.values())


class _Apply(torch.autograd.Function):
    """Stands in for a differentiable collective: its forward, and nothing saved (like the real ones)."""

    @staticmethod
    def forward(ctx, x, fn):
        return fn(x)

    @staticmethod
    def backward(ctx, grad):          # never run: fake runs stop at the forward
        return grad, None


def _collective(fn: str, x: torch.Tensor, dim: Optional[int], dim2: Optional[int], n: int, index: int,
                blocks: Blocks = 1) -> torch.Tensor:
    """The local result of collective ``fn`` over ``n`` devices on the one at ``index``, with the
    same allocation and aliasing as ``nbscaler.runtime.collectives`` (values do not matter)."""
    if n == 1:
        return x                                       # a group of one: the collectives return x
    gather = lambda t, d: torch.cat([torch.empty_like(t) for _ in range(n)], dim=d)
    # this device's slice as the runtime takes it (``nbscaler.blocks.take``): a view where it is one
    # contiguous slice, a new tensor where it joins several (a mirrored sequence: chunks i and 2n-1-i)
    piece = lambda t, d: strided.take(t, d, blocks, n, index).contiguous()
    impl = {
        Collective.ALL_GATHER: lambda t: gather(t, dim),
        Collective.ALL_GATHER_SUM_GRAD: lambda t: gather(t, dim),
        Collective.CHUNK: lambda t: piece(t, dim),
        Collective.ALL_REDUCE: lambda t: t.contiguous().clone(),
        Collective.REDUCE_SCATTER: lambda t: t.chunk(n, dim=dim)[index].clone(memory_format=torch.contiguous_format),
        Collective.ALL_TO_ALL: lambda t: torch.cat([t.chunk(n, dim=dim)[index]] * n, dim=dim2),
        Collective.SUM_GRAD: lambda t: t.view_as(t),
        Collective.FIRST_ONLY: lambda t: t.view_as(t) if index == 0 else torch.zeros_like(t),
    }[fn]
    if fn == Collective.SUM_GRAD and not x.requires_grad:
        return x
    return _Apply.apply(x, impl) if x.requires_grad else impl(x)


class _Env(dict):
    """The values of a replay (``Value`` -> ``FakeValue``); a weight is made on its first read."""

    def __init__(self, make: Callable[[Value], FakeValue], weights: Sequence[Value]):
        super().__init__()
        self.make, self.weights = make, set(weights)

    def __missing__(self, v: Value) -> FakeValue:
        if v not in self.weights:
            raise KeyError(v)
        self[v] = w = self.make(v)
        return w


class _Replay:
    """Runs one lowered section on fake values, one instruction at a time (as ``torch.fx.Interpreter``
    runs a graph): an environment maps each value of the program to the ``FakeValue`` that holds it,
    and each call is made again from a remembered one or dispatched on fake tensors (``cost.fake_calls``)."""

    def __init__(self, section: Section, calls: Optional[FakeCalls], imbalance: float = 1.0):
        self.sec = section
        self.calls = calls
        self.imbalance = imbalance             # the busiest expert-parallel device's pairs over the mean
        self.run = LocalRun(section.device, section.stage)
        self.env = _Env(self.weight, section.weights)
        self.weight_keys: set = set()
        self.seen: set = set()
        self.fake_device = fake_device()
        self.tensors = FakeStorages(self.fake_device)
        self.region: Optional[str] = None      # the recomputed region being replayed
        self.region_seen: set = set()
        self._grad: Optional[Dict[int, bool]] = None

    def leaf(self, shape: Sequence[int], dtype: torch.dtype, requires_grad: bool = False) -> FakeValue:
        return self.tensors.leaf(FakeValue.made(shape, dtype, requires_grad))

    def weight(self, v: Value) -> FakeValue:
        """A stored weight, made when the program first reads it."""
        t = v.tensor
        w = self.leaf(v.shape, t.dtype, t.kind == "param" and t.dtype.is_floating_point)
        self.weight_keys.add(w.storage)
        return w

    def grad(self) -> Dict[int, bool]:
        """Which tensors of the graph carry a gradient (only asked when an op could not be replayed)."""
        if self._grad is None:
            self._grad = requires_grad_of(self.sec.graph)
        return self._grad

    def instruction(self, ins: Instruction) -> None:
        if isinstance(ins, Receive):            # as the pipeline executor makes it: requiring a gradient
            t = ins.value.tensor
            self.env[ins.value] = self.leaf(t.shape, t.dtype, t.dtype.is_floating_point)
        elif isinstance(ins, Call):
            self.call(ins)
        elif isinstance(ins, Recompute):
            self.recompute(ins)
        elif isinstance(ins, (Unshard, Reshard)):      # ZeRO-3: no value changes; the memory model reads them
            prefetch = ins.prefetch if isinstance(ins, Unshard) else None
            self.run.units.append(UnitEvent(isinstance(ins, Unshard), ins.unit, prefetch, self.run.saved_bytes))
        elif isinstance(ins, (Send, Return)):   # the outputs gathered
            self.fetches(ins.fetches)

    def fetches(self, fetches: Sequence[Fetch]) -> None:
        for f in fetches:
            index = f.devices.index(self.sec.device) if self.sec.device in f.devices else 0
            for c in f.steps:
                value = self.env[c.src]
                step, n = c.step, len(f.devices)
                args = (step.fn, step.dim, step.dim2, n, index, step.blocks)
                out = self.remembered(("collective", *args), (value,), {}, [value],
                                      lambda x: ([_collective(args[0], x[0], *args[1:])], [], True))[0][0]
                self.run.collectives.append(CollectiveCall(step.fn, f.tensor.name, f.devices, value.bytes, out.bytes,
                                                           f.consumer.name if f.consumer else None,
                                                           f.region is not None, value.requires_grad))
                self.env[c.dst] = out

    def call(self, call: Call) -> None:
        self.fetches(call.fetches)
        node = call.node
        inputs = [self.env[v] for v in call.inputs]
        args, kwargs = call_args(node, inputs, self.fake_device, _out_shape(call))
        # a user op by its function too: registered again under its name, it is another call
        target = (node.target, USER_OPS.get(node.target), _structure(node.outputs), context_parallel(node),
                  node.meta.get(CONTEXT_KIND), expert_parallel(node),
                  (node.placement.parts, expert_hidden_parts(node), routed_imbalance(node, self.imbalance))
                  if expert_parallel(node) else None)
        produced, packed = self.remembered(target, args, kwargs, inputs, lambda xs: self.dispatch(call, xs))
        for v in call.inputs:                   # an op that changed an input in place
            self.env[v] = self.changed.get(id(self.env[v]), self.env[v])
        if vocab_parallel(node) and node.op == "loss" and not context_parallel(node):
            # the runtime's vocab_cross_entropy saves its softmax and the targets: the bytes of
            # cross_entropy's log-softmax and targets, without nll_loss's 0-dim total weight
            packed = [x for x in packed if x[2] > 0]
        new_bytes = self.save(packed)
        for v, value in zip(call.outputs, produced):
            self.env[v] = value
        self.run.ops.append(OpCall(node, tuple((x.shape, x.dtype, x.requires_grad) for x in inputs),
                                   tuple((v.shape, v.dtype) for v in produced), new_bytes,
                                   self.region is not None, self._kept_keys(packed),
                                   routed_imbalance(node, self.imbalance)))
        if expert_parallel(node):       # its rows out to their experts' devices and back, inside the call
            # the busiest device's rows: the exchange lasts until it has what it gets
            rows = round(exchanged_bytes(node) * routed_imbalance(node, self.imbalance))
            counts, devices = exchanged_counts_bytes(node), node.placement.devices
            calls = [(Collective.EXPERT_COUNTS, counts)] if counts else []
            self.run.collectives += [CollectiveCall(fn, node.inputs[0].name, devices, nbytes, nbytes, node.name,
                                                    self.region is not None)
                                     for fn, nbytes in calls + [(Collective.EXPERT_EXCHANGE, rows)] * 2]
        if counted_tokens_bytes(node):  # the group's token count, all-reduced inside a split loss
            nbytes = counted_tokens_bytes(node)
            self.run.collectives.append(CollectiveCall(Collective.TOKEN_COUNT, node.inputs[1].name, context_group(node),
                                                       nbytes, nbytes, node.name, self.region is not None))

    def remembered(self, target, args: Tuple, kwargs: Dict[str, Any], inputs: List[FakeValue],
                   run: Callable[[List[torch.Tensor]], Tuple[List[torch.Tensor], List[torch.Tensor], bool]]
                   ) -> Tuple[List[FakeValue], List[Stored]]:
        """The values a call makes and what it saves: from the record of the same call made
        before, else by ``run`` on the inputs' fake tensors (its outputs, the tensors autograd
        saved, whether it ran as it would: only then is it remembered). ``changed``: the inputs
        the call changed in place, each with its new value."""
        self.changed: Dict[int, FakeValue] = {}
        key = call_key(target, args, kwargs, inputs) if self.calls is not None else None
        record = self.calls.get(key) if key is not None else None
        if record is not None:
            return record.rebuild(inputs)
        tensors = [self.tensors.tensor(x) for x in inputs]
        versions = [x._version for x in tensors]
        produced, packed, exact = run(tensors)
        if self.calls is not None and exact:
            self.calls.put(key, tensors, produced, packed, versions)
        self.changed = {id(v): self.tensors.value(t) for t, v, n in zip(tensors, inputs, versions) if t._version != n}
        known = [(t, self.changed.get(id(v), v)) for t, v in zip(tensors, inputs)]
        return [self.tensors.value(p, known) for p in produced], [self.tensors.stored(x) for x in packed]

    def dispatch(self, call: Call, inputs: List[torch.Tensor]) -> Tuple[List[torch.Tensor], List[torch.Tensor], bool]:
        """Call the op on fake tensors: what it makes and what autograd saves; a call that cannot
        run is guessed (it saves its inputs) and the run marked not exact."""
        node = call.node
        args, kwargs = call_args(node, inputs, self.fake_device, _out_shape(call))
        packed: List[torch.Tensor] = []
        try:
            with torch.autograd.graph.saved_tensors_hooks(lambda x: (packed.append(x), x)[1], lambda x: x):
                result = call_node(node, args, kwargs, self.sec.device, self.imbalance)
            return _leaves(result, node.outputs), packed, True
        except Exception as err:                          # data-dependent shapes and the like
            self.run.exact = False
            warnings.warn(f"the cost model could not replay {node.target} ({node.name}) on fake tensors "
                          f"({type(err).__name__}: {err}); it assumes the op saves its inputs.", stacklevel=7)
            produced = [torch.empty(v.shape, dtype=v.tensor.dtype, device=self.fake_device) for v in call.outputs]
            grad = self.grad()
            packed = [x for x, v in zip(inputs, call.inputs) if x.is_floating_point() and grad.get(id(v.tensor), False)]
            return produced, packed, False

    def _kept_keys(self, saved: Sequence[Stored]) -> Tuple[int, ...]:
        """The storages of ``saved`` the forward keeps saved (none inside a recomputed region)."""
        if self.region is not None:
            return ()
        return tuple(dict.fromkeys(k for k, _, _ in saved if k in self.run.saved))

    def save(self, saved: Sequence[Stored]) -> int:
        """Count what autograd saves (each storage once, weights left out); returns the new bytes.

        Inside a recomputed region the forward keeps none of it: the bytes go to the region's
        rebuild (``LocalRun.rebuilt``) and the op reports none."""
        new_bytes = 0
        seen = self.region_seen if self.region is not None else self.seen
        for key, nbytes, _ in saved:
            if key in self.weight_keys or key in seen:
                continue
            seen.add(key)
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
        inputs = [self.env[v].stored() for v in region.inputs]
        kept = self.save(inputs)
        self.region, self.region_seen = region.region, {k for k, _, _ in inputs}    # held anyway
        try:
            for call in region.body:
                self.call(call)
        finally:
            self.region = None
        n = len(region.body)
        first = self.run.ops[-n]
        self.run.ops[-n] = dataclasses.replace(first, saved_bytes=first.saved_bytes + kept,
                                               saved_keys=self._kept_keys(inputs))


def _out_shape(call: Call) -> Tuple[int, ...]:
    """The local shape of ``call``'s first output, as the program holds it."""
    return call.outputs[0].shape if call.outputs else ()


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


def _structure(outputs: Any) -> Any:
    """The shape of the IR's output structure, which picks what ``_leaves`` keeps of a result."""
    if isinstance(outputs, IRTensor):
        return "T"
    if isinstance(outputs, (tuple, list)):
        return tuple(_structure(o) for o in outputs)
    if isinstance(outputs, dict):
        return tuple((k, _structure(o)) for k, o in outputs.items())
    return None


def call_args(node: IRNode, inputs: Sequence[torch.Tensor], device: torch.device,
              out_shape: Sequence[int]) -> Tuple[Tuple, Dict[str, Any]]:
    """``node``'s arguments with its tensor inputs (by position) replaced by local ``inputs``, the
    numbers a split changes as ``comm.arguments`` gives them (``out_shape``: the local shape of its
    first output), and devices by ``device``: the call as the generated code makes it."""
    it = iter(inputs)
    leaves, structure = node.flat_args
    args, kwargs = tree_unflatten([next(it) if isinstance(x, IRTensor) else device if isinstance(x, torch.device) else x
                                   for x in leaves], structure)
    return local_arguments(node, args, kwargs, out_shape)


def fake_device() -> torch.device:
    """The device type fake tensors pretend to be on: where the runtime would run."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def run_local(section: Section, train: bool = True, calls: Optional[FakeCalls] = CALLS,
              imbalance: float = 1.0) -> LocalRun:
    """Replay one lowered ``section`` of a rank's program on fake tensors, at its local shapes.

    Inputs are replicated and need a gradient where the traced ones did (a batch needs none); tensors received from the previous stage are replicated and need one when floating,
    as the pipeline executor makes them. ``train=False`` runs without autograd (nothing is saved).
    ``calls``: the calls made before, made again from what they did (``cost.fake_calls``); ``None``
    dispatches every call. ``imbalance``: the routing priced, its busiest expert-parallel device's
    (token, expert) pairs over the mean (``Recipe.expert_imbalance``): every device is replayed as
    that one, whom the others wait for at each exchange.
    """
    replay = _Replay(section, calls, imbalance)
    with FakeTensorMode(allow_non_fake_inputs=False), torch.set_grad_enabled(train):
        for v in section.inputs:
            t = v.tensor
            replay.env[v] = replay.leaf(t.shape, t.dtype, t.kind == "input" and t.requires_grad and t.dtype.is_floating_point)
        for ins in section.instructions:
            replay.instruction(ins)
    return replay.run


def local_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * (torch.finfo(dtype).bits // 8 if dtype.is_floating_point
                               else 1 if dtype == torch.bool else torch.iinfo(dtype).bits // 8)
