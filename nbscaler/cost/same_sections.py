"""Sections that replay alike: one fake replay for every section of the same shape.

The pipeline stages of a model made of repeated layers (a 70B Llama on 8 stages: stages 1 to 6
run 10 or 11 identical decoder layers each) lower to sections that differ only in names: the nodes they
run, the tensors they convert, the devices of their groups. ``run_local`` reads nothing else that
differs between them, so their replays are equal up to those names. ``section_key`` writes down
everything the replay reads, with every name replaced by its place in the section; two sections
with one key replay alike, and ``Replays`` replays the first and hands the others its run with
their own names (``renamed``).

What the key holds, instruction by instruction (``cost.local._Replay`` reads exactly this):

- each value at its first use: how it is made (origin, local and full shape, dtype, kind);
- each call's node without its name: target, op, constant arguments, output shapes and dtypes,
  placement (split, blocks, parts, not the devices), annotation; its inputs and outputs by value;
- each collective: its step, its group's size and the section device's place in the group;
- each recomputed region by its order;
- each ZeRO-3 gather and free, its units by the order the section first names them.

A constant argument that is a tensor makes its key unique (values are not compared), so such a
section is always replayed; so is a run the replay could not make exactly (``LocalRun.exact``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import torch

from nbscaler.comm.program import Call, Fetch, Receive, Recompute, Reshard, Return, Section, Send, Unshard, Value
from nbscaler.cost.local import LocalRun, run_local
from nbscaler.ir.annotation import OpAnnotation
from nbscaler.ir.graph import IRNode, IRTensor


@dataclasses.dataclass
class SectionNames:
    """The names a section's replay writes into its run, in the order it writes them."""

    device: int
    stage: Optional[int]
    nodes: List[IRNode] = dataclasses.field(default_factory=list)        # one per OpCall
    converts: List[Tuple[str, Tuple[int, ...], Optional[str]]] = dataclasses.field(default_factory=list)
    regions: List[str] = dataclasses.field(default_factory=list)         # recomputed regions, in order
    units: List[Tuple[str, Optional[str]]] = dataclasses.field(default_factory=list)    # ZeRO-3 events' units


class _Keyer:
    """Walks one section as the replay does, writing its key and its names."""

    def __init__(self, section: Section):
        self.sec = section
        self.ids: Dict[int, int] = {}          # id(Value) -> its place in the section
        self.key: List[Any] = []
        self.names = SectionNames(section.device, section.stage)
        self.unit_ids: Dict[str, int] = {}

    def value(self, v: Value) -> Any:
        if id(v) in self.ids:
            return self.ids[id(v)]
        self.ids[id(v)] = len(self.ids)
        t = v.tensor
        return (self.ids[id(v)], str(v.origin), v.layout, tuple(v.shape), tuple(t.shape), t.dtype, t.kind)

    def fetches(self, fetches: Tuple[Fetch, ...]) -> None:
        for f in fetches:
            index = f.devices.index(self.sec.device) if self.sec.device in f.devices else 0
            for c in f.steps:
                self.key.append(("convert", c.step, len(f.devices), index, self.value(c.src), self.value(c.dst),
                                 f.region is not None))
                self.names.converts.append((f.tensor.name, f.devices, f.consumer.name if f.consumer else None))

    def call(self, call: Call) -> None:
        self.fetches(call.fetches)
        self.key.append(("call", node_key(call.node), tuple(self.value(v) for v in call.inputs),
                         tuple(self.value(v) for v in call.outputs)))
        self.names.nodes.append(call.node)

    def walk(self) -> Tuple[Tuple, SectionNames]:
        for ins in self.sec.instructions:
            if isinstance(ins, Receive):
                self.key.append(("receive", self.value(ins.value)))
            elif isinstance(ins, Call):
                self.call(ins)
            elif isinstance(ins, Recompute):
                self.fetches(ins.fetches)
                self.key.append(("recompute", len(self.names.regions), tuple(self.value(v) for v in ins.inputs),
                                 len(ins.body)))
                self.names.regions.append(ins.region)
                for call in ins.body:
                    self.call(call)
            elif isinstance(ins, (Unshard, Reshard)):
                prefetch = ins.prefetch if isinstance(ins, Unshard) else None
                self.key.append(("unit", isinstance(ins, Unshard), self.unit(ins.unit), self.unit(prefetch)))
                self.names.units.append((ins.unit, prefetch))
            elif isinstance(ins, (Send, Return)):
                self.fetches(ins.fetches)
            # ZeRO-3's Unshard and Reshard: the replay skips them, so they leave the key alone
        return tuple(self.key), self.names

    def unit(self, name: Optional[str]) -> Optional[int]:
        """A ZeRO-3 unit by the order the section first names it."""
        if name is None:
            return None
        return self.unit_ids.setdefault(name, len(self.unit_ids))


_PLAIN = (bool, int, str, torch.dtype)          # hashable, and equal only when the replay sees the same


def _constant(x: Any) -> Any:
    """A hashable stand-in for one argument of a call: a graph tensor by shape and dtype (its
    value comes through the call's inputs), containers by their items, any other constant by its
    type and value (a float by its repr, so that ``-0.0`` and ``0.0`` differ)."""
    kind = type(x)
    if x is None or kind in _PLAIN:             # the common cases first, by exact type (isinstance is slow here)
        return kind.__name__, x
    if isinstance(x, IRTensor):
        return "T", tuple(x.shape), x.dtype
    if isinstance(x, (tuple, list)):
        return kind.__name__, tuple(_constant(y) for y in x)
    if isinstance(x, dict):
        return "dict", tuple((_constant(k), _constant(v)) for k, v in x.items())
    if isinstance(x, (set, frozenset)):
        return "set", frozenset(_constant(y) for y in x)
    if isinstance(x, torch.Tensor):
        return "constant tensor", id(x)         # values are not compared: never shared
    return kind.__name__, repr(x)


def node_key(node: IRNode) -> Tuple:
    """Everything the replay reads of ``node`` but its name and its devices."""
    place, a = node.placement, node.annotation
    return (node.op, node.target, node.inplace, _constant(node.args), _constant(node.kwargs), _constant(node.outputs),
            None if place is None else (place.split, place.blocks, place.parts, place.inner),
            annotation_key(a))


ANNOTATION_FIELDS = ("inputs", "outputs", "reduce", "frozen", "sizes", "grouped")
"""The fields of ``OpAnnotation`` that ``annotation_key`` reads (a test checks it reads them all)."""


def annotation_key(a: Optional[OpAnnotation]) -> Optional[Tuple]:
    """``a`` as a hashable tuple: dimension names, reduced and frozen names, sizes, grouped blocks."""
    if a is None:
        return None
    return (tuple(a.inputs), tuple(a.outputs), a.reduce, a.frozen, tuple(a.sizes.items()), tuple(a.grouped.items()))


def section_key(section: Section) -> Tuple[Tuple, SectionNames]:
    """``(key, names)``: sections of equal keys replay alike, each run carrying its own names."""
    return _Keyer(section).walk()


def renamed(run: LocalRun, template: SectionNames, names: SectionNames) -> LocalRun:
    """``run``, the replay of the section of ``template``, as the section of ``names`` (same key)
    replays it."""
    regions = dict(zip(template.regions, names.regions))
    ops = [dataclasses.replace(op, node=node) for op, node in zip(run.ops, names.nodes)]
    collectives = [dataclasses.replace(c, tensor=tensor, devices=devices, node=consumer)
                   for c, (tensor, devices, consumer) in zip(run.collectives, names.converts)]
    units = [dataclasses.replace(e, unit=unit, prefetch=prefetch)
             for e, (unit, prefetch) in zip(run.units, names.units)]
    return LocalRun(names.device, names.stage, ops, collectives, dict(run.saved), run.exact,
                    {regions[r]: b for r, b in run.rebuilt.items()}, units)


class Replays:
    """``run_local`` of sections, replaying one section of each key (``section_key``), for a
    routing whose busiest expert-parallel device gets ``imbalance`` times the mean pairs."""

    def __init__(self, imbalance: float = 1.0) -> None:
        self.done: Dict[Tuple, Tuple[LocalRun, SectionNames]] = {}
        self.imbalance = imbalance

    def run(self, section: Section) -> LocalRun:
        key, names = section_key(section)
        if key in self.done:
            return renamed(*self.done[key], names)
        run = run_local(section, imbalance=self.imbalance)
        if run.exact:
            self.done[key] = (run, names)
        return run
