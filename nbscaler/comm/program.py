"""A rank's program: what one plan device does with a placed graph, as plain data.

``comm.lower`` writes it once per plan device; code generation prints it, the cost model replays
it on fake tensors (one instruction at a time, as ``torch.fx.Interpreter`` runs a graph), and the
traffic table counts its conversions. A program is:

- its **sections**: one per generated method (a whole forward, or one pipeline stage, per mode),
  each an ordered list of instructions over **values**: a tensor of the graph in one layout;
- its **weight table**: every parameter and buffer the rank stores, at its local shape, with the
  slice of the original tensor it holds, its first reader's group, and its copies elsewhere.

The instructions, in the order the rank runs them::

    Receive(value)                      a tensor from the previous pipeline stage
    Call(node, fetches, inputs, outputs)  one node, after converting its inputs (each a Fetch)
    Recompute(region, fetches, body)    calls run again in the backward (activation checkpointing)
    Send(tensor, fetches, value)        a tensor to the next pipeline stage
    Return(fetches, values)             the module's outputs, gathered to replicated
    Unshard(unit, prefetch)             ZeRO-3: all-gather a unit's parameters (and start the next's)
    Reshard(unit, outputs)              ZeRO-3: free them after the unit's forward

A ``Fetch`` is one layout conversion: the collectives (``Convert``, one per step) that turn the
layout a tensor is held in into the one a reader asks for.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import torch

from nbscaler.blocks import Blocks
from nbscaler.columns import StrEnum
from nbscaler.comm.layout import Layout, Step
from nbscaler.ir.graph import IRGraph, IRNode, IRTensor
from nbscaler.layouts import LayoutKind

Devices = Tuple[int, ...]


class Origin(StrEnum):
    """Where a value comes from, which fixes its name in generated code."""

    INPUT = "input"             # an argument of the forward: its IR name
    WEIGHT = "weight"           # a stored parameter or buffer: ``self.<attr>``
    RECEIVED = "received"       # from the previous stage: its IR name
    MADE = "made"               # an output of a call: its IR name
    CONVERTED = "converted"     # the result of a collective: ``<name>_<layout label>``


@dataclass(frozen=True, eq=False)
class Value:
    """One tensor of the graph in one layout, on this rank (compared by identity)."""

    tensor: IRTensor
    layout: Layout
    origin: Origin
    shape: Tuple[int, ...]              # the local shape this rank holds


@dataclass(frozen=True, eq=False)
class Convert:
    """One collective: ``dst = comm.<step.fn>(src, ...)`` over the fetch's devices."""

    step: Step
    src: Value
    dst: Value


@dataclass(frozen=True, eq=False)
class Fetch:
    """The collectives that turn ``tensor`` from ``have`` into ``want`` for one reader."""

    tensor: IRTensor
    have: Layout
    want: Layout
    devices: Devices
    consumer: Optional[IRNode]          # None: a stage's or the module's output
    position: int                       # the input position of the consumer (of the output, for None)
    steps: Tuple[Convert, ...]
    region: Optional[str] = None        # inside a recomputed region: the backward runs it again


@dataclass(frozen=True, eq=False)
class Receive:
    value: Value


@dataclass(frozen=True, eq=False)
class Call:
    node: IRNode
    fetches: Tuple[Fetch, ...]          # its inputs' conversions, in input order
    inputs: Tuple[Value, ...]           # by position (one tensor may be passed twice, differently)
    outputs: Tuple[Value, ...]
    region: Optional[str] = None


@dataclass(frozen=True, eq=False)
class Recompute:
    """A recomputed region: its inputs fetched first (kept for the backward), then its calls,
    which the backward runs again; only ``returns`` stay visible after it."""

    region: str
    fetches: Tuple[Fetch, ...]
    inputs: Tuple[Value, ...]           # every read from outside the region, in order, repeats kept
    body: Tuple[Call, ...]
    returns: Tuple[IRTensor, ...]


@dataclass(frozen=True, eq=False)
class Send:
    tensor: IRTensor
    fetches: Tuple[Fetch, ...]
    value: Value


@dataclass(frozen=True, eq=False)
class Return:
    fetches: Tuple[Fetch, ...]
    values: Dict[int, Value]            # id of each output tensor -> its replicated value
    outputs: Any                        # the graph's output structure


@dataclass(frozen=True, eq=False)
class Unshard:
    """ZeRO stage 3: all-gather ``unit``'s parameters before its first reader, and start the
    all-gather of ``prefetch`` (the next unit to run) so that it overlaps this unit's compute."""

    unit: str
    prefetch: Optional[str] = None


@dataclass(frozen=True, eq=False)
class Reshard:
    """ZeRO stage 3: free ``unit``'s gathered parameters after its last reader in the forward.
    ``outputs``: the values the unit made that later instructions read; the backward reaches the
    unit through them, and gathers its parameters again first."""

    unit: str
    outputs: Tuple[Value, ...]


Instruction = Union[Receive, Call, Recompute, Send, Return, Unshard, Reshard]


@dataclass(eq=False)
class Section:
    """One generated method: a whole forward, or one pipeline stage, as plan ``device`` runs it."""

    name: str                           # '_forward', '_stage1_train', ...
    mode: str                           # 'any', 'train' or 'eval'
    graph: IRGraph
    device: int                         # the device whose share it runs (chimera: the stage's holder)
    stage: Optional[int] = None
    carry_in: Sequence[IRTensor] = ()
    carry_out: Optional[Sequence[IRTensor]] = None
    inputs: List[Value] = field(default_factory=list)       # the forward's arguments
    weights: List[Value] = field(default_factory=list)      # every weight of the graph, as stored
    instructions: List[Instruction] = field(default_factory=list)
    groups: Tuple[Devices, ...] = ()    # the device sets its collectives run over, sorted
    stage_of: Optional[Callable[[IRNode], int]] = None     # a node's stage, where not ``node.stage``

    def stage_nodes(self) -> List[IRNode]:
        """The nodes of its stage (every node without a pipeline), on any device, in graph order."""
        if self.stage is None:
            return list(self.graph.nodes)
        if self.stage_of is None:
            return [n for n in self.graph.nodes if n.stage == self.stage]
        return [n for n in self.graph.nodes if self.stage_of(n) == self.stage]

    def nodes(self) -> List[IRNode]:
        """The nodes this section runs, in graph order."""
        return [n for n in self.stage_nodes() if self.device in n.placement.devices]

    def calls(self) -> Iterator[Call]:
        for ins in self.instructions:
            if isinstance(ins, Call):
                yield ins
            elif isinstance(ins, Recompute):
                yield from ins.body

    def fetches(self) -> Iterator[Fetch]:
        """Every layout conversion, in the order the section runs them."""
        for ins in self.instructions:
            if isinstance(ins, Recompute):
                yield from ins.fetches
                for call in ins.body:
                    yield from call.fetches
            elif isinstance(ins, (Call, Send, Return)):
                yield from ins.fetches


@dataclass(frozen=True)
class LocalWeight:
    """A parameter or buffer as a rank stores it: one row of the weight table."""

    name: str
    kind: str                     # 'param' | 'buffer' | 'constant'
    shape: Tuple[int, ...]        # local shape
    dtype: torch.dtype
    trained: bool                 # read by the training graph on this rank (gets a gradient in backward)
    layout: Layout = Layout.replicated()
    full_shape: Tuple[int, ...] = ()
    devices: Devices = ()         # the group of its first reader on this rank
    index: int = 0                # this rank's place in that group (the slice it holds when split)
    stages: Tuple[int, ...] = ()  # the pipeline stages whose training backward gives it a gradient
    replicas: Devices = ()        # devices whose copies' gradients are summed with this one (pipelines)
    persistent: bool = True
    unit: Optional[str] = None    # ZeRO-3: the unit its parameter is gathered with (``policy.shard_units``)

    @property
    def partial_devices(self) -> Devices:
        """The devices whose partial gradients the reducer sums with this one's (storage ``R*``):
        all of ``devices``, or over a grid this device's counterparts in every group; else none."""
        if self.layout.kind != LayoutKind.SUM_GRAD:
            return ()
        inner = self.layout.inner
        step = inner.parts if inner is not None and inner.kind != LayoutKind.SUM_GRAD else 1
        return self.devices[self.index % step::step]

    @property
    def partial_stride(self) -> int:
        """How far apart the devices ``partial_devices`` names are: 1 (neighbours), or over a grid
        the size of the groups whose counterparts they are."""
        inner = self.layout.inner
        return inner.parts if self.partial_devices and inner is not None and inner.kind != LayoutKind.SUM_GRAD else 1

    @property
    def partial_over(self) -> int:
        """Devices whose partial gradients the reducer sums (``partial_devices``), else 1."""
        return len(self.partial_devices) or 1

    @property
    def blocks(self) -> Blocks:
        return self.layout.blocks

    @functools.cached_property            # asked per bucket and per backward of every micro-batch
    def numel(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(eq=False)
class RankProgram:
    """Everything plan ``device`` runs and stores; shared by the runtime ranks that play it."""

    device: int
    sections: List[Section]
    weights: List[LocalWeight]
    device_groups: List[Devices]        # every process group, identical on all ranks (created collectively)
    units: Dict[str, Tuple[str, ...]] = field(default_factory=dict)    # ZeRO-3: unit -> its weights' names

    def section(self, mode: str, stage: Optional[int] = None) -> Section:
        return next(s for s in self.sections if s.mode == mode and s.stage == stage)


def output_shapes(programs: Iterable[RankProgram], graph: IRGraph) -> Dict[int, List[Tuple[int, ...]]]:
    """``id(node)`` -> the local shapes of its outputs, for every node of ``graph`` that a section
    of ``programs`` calls (all of them, or ``RankPrograms.distinct()``, call every node)."""
    shapes: Dict[int, List[Tuple[int, ...]]] = {}
    for program in programs:
        for sec in program.sections:
            if sec.graph is graph:
                for call in sec.calls():
                    shapes.setdefault(id(call.node), [v.shape for v in call.outputs])
    return shapes
