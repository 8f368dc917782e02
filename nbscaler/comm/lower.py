"""Lower a placed plan into one program per rank: every layout rule applied once, here.

For each plan device, ``lower_device`` decides which methods it has (``rank_sections``), which
weights it stores (``weight_table``) and, walking each section's nodes in order, which value every
input is read from and which collectives make it (``SectionLowering``). The rules:

- an input is held replicated, a weight in its storage layout (``storage_layouts``), a tensor
  received from the previous stage replicated, and a node's outputs in ``output_layout``;
- a reader asks for ``input_requirement``; a sum-gradient request (``R*``) of a tensor that carries
  no gradient is a plain replicated one, since there is nothing to sum (``effective_requirement``);
- a conversion's collectives each read, at local shapes, what the one before made (``local_steps``);
- a layout once made is reused by every later reader (until a recomputed region ends: only what
  the region returns stays visible after it);
- a stage sends its carried tensors replicated; a forward returns its outputs replicated.

Code generation, the cost model and the traffic table read the result (``comm.program``) and
never walk the placement themselves. autodist prices placements not yet made, so it has no
program to read: it calls the same rules of ``comm.layout``.

>>> programs = lower(plan)                                         # doctest: +SKIP
>>> [type(i).__name__ for i in programs[0].sections[0].instructions][:3]
['Call', 'Call', 'Recompute']
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Dict, Iterator, List, Optional, Sequence, Set, Tuple

from nbscaler.comm.layout import (Layout, conversion, effective_requirement, grid_legs, input_requirement, local_shape,
                                  local_steps, on_grid, output_layout)
from nbscaler.comm.program import (Call, Devices, Fetch, LocalWeight, Origin, RankProgram, Receive, Recompute,
                                   Return, Section, Send, Value, Convert)
from nbscaler.comm.stages import stage_carries
from nbscaler.comm.unit_gathers import insert_unit_gathers, unit_table
from nbscaler.ir.graph import (SHARD_UNITS, InnerSplit, IRGraph, IRNode, IRTensor, Placement, recompute_runs,
                               requires_grad_of, tied_stages)
from nbscaler.ir.layer_rules import sync_batch_norm
from nbscaler.layouts import LayoutKind
from nbscaler.schedule.geometry import PipelineGeometry


class LoweringError(ValueError):
    """A placed graph that no rank can run as placed (a tensor read before any device makes it)."""


class LoweringFacts:
    """What every rank's lowering reads of the placed graphs, worked out once per plan (lazily):
    the tensors crossing each stage boundary, which tensors carry a gradient, the tied weights
    and the process groups."""

    def __init__(self, graphs: Dict[str, IRGraph], geometry: Optional[PipelineGeometry]):
        self.graphs, self.geometry = graphs, geometry
        self._carries: Dict[int, List[List[IRTensor]]] = {}
        self._grads: Dict[int, Dict[int, bool]] = {}

    def stage_io(self, graph: IRGraph, stage: Optional[int]) -> Tuple[List[IRTensor], Optional[List[IRTensor]]]:
        """What ``stage`` of ``graph`` receives and sends on (``((), None)`` without a pipeline or for
        the last stage's sends: it returns the module's outputs)."""
        if stage is None:
            return [], None
        nstages = self.geometry.schedule.nstages
        if id(graph) not in self._carries:
            self._carries[id(graph)] = stage_carries(graph, nstages)
        carries = self._carries[id(graph)]
        return (carries[stage - 1] if stage else []), (carries[stage] if stage < nstages - 1 else None)

    def grad(self, graph: IRGraph) -> Dict[int, bool]:
        if id(graph) not in self._grads:
            self._grads[id(graph)] = requires_grad_of(graph)
        return self._grads[id(graph)]

    @functools.cached_property
    def tied(self) -> Dict[str, Tuple[int, ...]]:
        return tied_stages(self.graphs)

    @functools.cached_property
    def device_groups(self) -> List[Devices]:
        return device_groups(self.graphs, self.geometry, self.tied)


def lower(plan: Any) -> "RankPrograms":
    """Runtime rank -> its program, for a ``Plan`` (or anything with ``graphs``, ``storage``,
    ``geometry`` and ``config``). Ranks that play the same plan device share one program, and each
    device is lowered when first asked for."""
    return RankPrograms(plan.graphs, plan.storage, plan.geometry, plan.config)


class RankPrograms(Mapping):
    """``{runtime rank: RankProgram}``, lowered per plan device on first use and kept."""

    def __init__(self, graphs: Dict[str, IRGraph], storage: Dict[str, Layout], geometry: Optional[PipelineGeometry],
                 config: Any):
        self.graphs, self.storage, self.geometry, self.config = graphs, storage, geometry, config
        self.facts = LoweringFacts(graphs, geometry)
        self._by_device: Dict[int, RankProgram] = {}
        self._weights: Dict[int, List[LocalWeight]] = {}

    def device(self, device: int) -> RankProgram:
        """The program of plan ``device``."""
        if device not in self._by_device:
            self._by_device[device] = lower_device(self.graphs, self.storage, device, self.geometry, self.facts,
                                                   self.weights(device))
        return self._by_device[device]

    def weights(self, device: int) -> List[LocalWeight]:
        """The weight table of plan ``device``, without lowering its sections (what the memory and
        time models ask of every device)."""
        if device not in self._weights:
            sections = rank_sections(self.graphs, device, self.geometry)
            self._weights[device] = weight_table(self.graphs, self.storage, sections, self.geometry, self.facts)
        return self._weights[device]

    def __getitem__(self, rank: int) -> RankProgram:
        if not 0 <= rank < self.config.runtime_ngpus:
            raise KeyError(rank)
        return self.device(self.config.device_of(rank))

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.config.runtime_ngpus))

    def __len__(self) -> int:
        return self.config.runtime_ngpus

    def distinct(self) -> List[RankProgram]:
        """One program per set of plan devices whose sections run the same nodes (the members of a
        tensor-parallel group): what differs between those is only each one's place in its groups.
        Over a grid the devices' groups differ too (each pair's collectives, each context-parallel
        group's ring), so each device of a section with a grid placement is its own."""
        seen: Dict[Tuple, int] = {}
        for d in range(self.config.plan_ngpus):
            sections = rank_sections(self.graphs, d, self.geometry)
            grid = any(n.placement.inner is not None for sec in sections for n in sec.nodes())
            key = tuple((sec.mode, sec.stage, tuple(id(n) for n in sec.nodes())) for sec in sections)
            seen.setdefault(key + ((d,) if grid else ()), d)
        return [self.device(d) for d in seen.values()]


def lower_device(graphs: Dict[str, IRGraph], storage: Dict[str, Layout], device: int,
                 geometry: Optional[PipelineGeometry], facts: Optional[LoweringFacts] = None,
                 weights: Optional[List[LocalWeight]] = None) -> RankProgram:
    """The program of plan ``device``: its sections lowered to instructions, and its weight table.
    ``facts`` and ``weights`` (its weight table): the plan's, when the caller has them already."""
    facts = facts or LoweringFacts(graphs, geometry)
    sections = rank_sections(graphs, device, geometry)
    weights = weights if weights is not None else weight_table(graphs, storage, sections, geometry, facts)
    shapes = {w.name: w.shape for w in weights}
    for sec in sections:
        sec.carry_in, sec.carry_out = facts.stage_io(sec.graph, sec.stage)
        SectionLowering(sec, storage, facts.grad(sec.graph), shapes).run()
        insert_unit_gathers(sec)
    return RankProgram(device, sections, weights, facts.device_groups, unit_table(weights))


def train_graph(graphs: Dict[str, IRGraph]) -> IRGraph:
    """The graph a training step runs."""
    return graphs["train"] if "train" in graphs else graphs["any"]


# -- which methods ------------------------------------------------------------------------------
def rank_sections(graphs: Dict[str, IRGraph], device: int, geometry: Optional[PipelineGeometry]) -> List[Section]:
    """The methods plan ``device`` has, not yet lowered: ``_forward[_mode]``, or ``_stage{s}[_mode]``
    per stage it holds (``lower_device`` adds what each stage receives and sends on).

    Under ``chimera_direct`` a device also holds a stage of the pipeline running the other way; it
    runs that stage's code as the device that holds it in the graph.
    """
    suffix = lambda mode: "" if mode == "any" else f"_{mode}"
    if geometry is None:
        return [Section(f"_forward{suffix(mode)}", mode, g, device) for mode, g in graphs.items()]
    out = []
    for s in geometry.stages_of(device):
        view = geometry.view_of(s, device)
        out += [Section(f"_stage{s}{suffix(mode)}", mode, g, view, s) for mode, g in graphs.items()]
    return out


# -- what each section does ------------------------------------------------------------------------
class SectionLowering:
    """Walks one section's nodes for its device and fills its instructions."""

    def __init__(self, section: Section, storage: Dict[str, Layout], grad: Dict[int, bool],
                 weight_shapes: Optional[Dict[str, Tuple[int, ...]]] = None):
        self.sec, self.storage, self.grad = section, storage, grad
        self.weight_shapes = weight_shapes or {}       # local shapes of the weights the rank stores
        self.have: Dict[int, Layout] = {}                  # id(tensor) -> the layout it was made in
        self.known: Dict[int, Dict[Layout, Value]] = {}    # id(tensor) -> every layout made so far
        self.groups: Set[Devices] = set()

    def bind(self, value: Value) -> Value:
        t = value.tensor
        self.have[id(t)] = value.layout
        self.known.setdefault(id(t), {})[value.layout] = value
        return value

    def fetch(self, t: IRTensor, want: Layout, devices: Devices, consumer: Optional[IRNode], position: int,
              region: Optional[str] = None) -> Tuple[Value, Tuple[Fetch, ...]]:
        """The value holding ``t`` in layout ``want``, and the conversions that make it (none when
        held): one, or over a grid one per axis that changes, each over its own sub-group."""
        if id(t) not in self.have:
            raise LoweringError(f"{t.name} is used before it is computed on device {self.sec.device}")
        want = effective_requirement(want, self.grad.get(id(t), False))
        known = self.known[id(t)]
        if want in known:
            return known[want], ()
        have = self.have[id(t)]
        if have.inner is not None or want.inner is not None:
            return self._fetch_grid(t, have, want, devices, consumer, position, region)
        self.groups.add(devices)
        steps: List[Convert] = []
        start = self._start(t, have, want)
        if start not in known:                  # the whole tensor, made on the way and kept
            self._convert(t, have, start, len(devices), steps)
        src = self._convert(t, start, want, len(devices), steps)
        frm = have if steps and steps[0].src is known[have] else start
        return src, (Fetch(t, frm, want, devices, consumer, position, tuple(steps), region),) if steps else ()

    def _fetch_grid(self, t: IRTensor, have: Layout, want: Layout, devices: Devices, consumer: Optional[IRNode],
                    position: int, region: Optional[str]) -> Tuple[Value, Tuple[Fetch, ...]]:
        """``fetch`` over a grid: one conversion per axis whose layout changes (``grid_legs``), each a
        fetch over this device's group of that axis, every layout made on the way kept."""
        parts = (have.inner or want.inner).parts
        known, grid = self.known[id(t)], Placement(devices, inner=InnerSplit(None, parts))
        if have.inner is None:                  # whole on every device: the same value on both axes
            known.setdefault(on_grid(have, parts), known[have])
        fetches = []
        for axis, a, b in grid_legs(have, want):
            if b in known:
                continue
            group, steps = grid.axis_group(axis, self.sec.device), []
            self.groups.add(group)
            self._convert(t, a, b, len(group), steps)
            fetches.append(Fetch(t, a, b, group, consumer, position, tuple(steps), region))
        value = known[on_grid(want, parts)]
        known.setdefault(want, value)
        return value, tuple(fetches)

    def _start(self, t: IRTensor, have: Layout, want: Layout) -> Layout:
        """The layout ``t``'s conversion to ``want`` goes through: the whole tensor where it is made
        already (any layout is a step without communication from it: a chunk, ``sum_grad`` or
        ``first_only``), and for ``R*`` and ``V`` (the whole and one step more) where the way
        from ``have`` passes through it (partial sums all-reduced). So one collective serves every
        consumer of an embedding's partial sums, whichever of ``R``, ``R*``, ``V`` or a slice each wants."""
        whole = Layout.replicated()
        if whole in self.known[id(t)]:
            return whole
        if want.kind not in (LayoutKind.SUM_GRAD, LayoutKind.FIRST_ONLY):
            return have
        to_whole = conversion(have, whole)
        return whole if conversion(have, want)[:len(to_whole)] == to_whole else have   # not a fused all_gather_sum_grad

    def _convert(self, t: IRTensor, have: Layout, want: Layout, n: int, steps: List[Convert]) -> Value:
        """``t`` in layout ``want``, converted from its value in ``have`` over ``n`` devices (the
        steps appended to ``steps``), and kept for later consumers."""
        src = self.known[id(t)][have]
        for step in local_steps(have, want, src.shape, n):
            dst = Value(t, want, Origin.CONVERTED, step.dst_shape)
            steps.append(Convert(step.step, src, dst))
            src = dst
        self.known[id(t)][want] = src
        return src

    def run(self) -> None:
        sec, R = self.sec, Layout.replicated()
        sec.inputs = [self.bind(Value(t, R, Origin.INPUT, tuple(t.shape))) for t in sec.graph.inputs]
        sec.weights = [self.bind(Value(t, self.storage.get(t.name, R), Origin.WEIGHT,
                                       self.weight_shapes.get(t.name, tuple(t.shape))))
                       for t in sec.graph.weights.values()]
        out = sec.instructions
        out += [Receive(self.bind(Value(t, R, Origin.RECEIVED, tuple(t.shape)))) for t in sec.carry_in]
        nodes = sec.stage_nodes()
        ran = [n for n in nodes if sec.device in n.placement.devices]
        finals = sec.carry_out if sec.carry_out is not None else sec.graph.output_tensors()
        done = 0
        for region, run in recompute_runs(ran):
            done += len(run)
            if region is None:
                out += [self.call(n) for n in run]
            else:
                out.append(self.recompute(region, run, ran[done:], finals))
        group = tuple(sorted({d for n in nodes for d in n.placement.devices}))
        gathered = [self.fetch(t, R, group, None, k) for k, t in enumerate(finals)]
        if sec.carry_out is not None:
            out += [Send(t, fs, v) for t, (v, fs) in zip(finals, gathered)]
        else:
            out.append(Return(tuple(f for _, fs in gathered for f in fs),
                              {id(t): v for t, (v, _) in zip(finals, gathered)}, sec.graph.outputs))
        sec.groups = tuple(sorted(self.groups))

    def call(self, node: IRNode, region: Optional[str] = None) -> Call:
        place = node.placement
        fetched = [self.fetch(t, input_requirement(node, i), place.devices, node, i, region)
                   for i, t in enumerate(node.inputs)]
        if sync_batch_norm(node):        # statistics over the whole batch: a collective inside the op
            self.groups.add(place.devices)
        for axis, _ in place.views() if place.inner is not None else ():     # the calls' own groups over a grid
            self.groups.add(place.axis_group(axis, self.sec.device))
        outputs = []
        for i, t in enumerate(node.output_tensors):
            lay = output_layout(node, i)
            outputs.append(self.bind(Value(t, lay, Origin.MADE, local_shape(t.shape, lay, place.parts))))
        return Call(node, tuple(f for _, fs in fetched for f in fs), tuple(v for v, _ in fetched), tuple(outputs), region)

    def recompute(self, region: str, nodes: Sequence[IRNode], later: Sequence[IRNode],
                  finals: Sequence[IRTensor]) -> Recompute:
        """A recomputed region. Its inputs are fetched before it, so the collectives inside it are
        those between its own ops: the backward runs them again, in the same order on every rank of
        their group. What it makes is out of sight after it, except what later code reads."""
        made = {id(t) for n in nodes for t in n.output_tensors}
        fetched = [self.fetch(t, input_requirement(n, i), n.placement.devices, n, i)
                   for n in nodes for i, t in enumerate(n.inputs) if id(t) not in made]
        body = tuple(self.call(n, region) for n in nodes)
        needed = {id(t) for n in later for t in n.inputs} | {id(t) for t in finals}
        returns = tuple(t for n in nodes for t in n.output_tensors if id(t) in needed)
        for n in nodes:
            for t in n.output_tensors:
                if id(t) in needed:
                    home = self.have[id(t)]
                    self.known[id(t)] = {home: self.known[id(t)][home]}
                else:
                    self.known.pop(id(t), None)
                    self.have.pop(id(t), None)
        return Recompute(region, tuple(f for _, fs in fetched for f in fs), tuple(v for v, _ in fetched), body, returns)


# -- what each rank stores -----------------------------------------------------------------------------
def weight_table(graphs: Dict[str, IRGraph], storage: Dict[str, Layout], sections: List[Section],
                 geometry: Optional[PipelineGeometry], facts: Optional[LoweringFacts] = None) -> List[LocalWeight]:
    """The weights the sections read, in the order of the graph's weights (the order of
    ``module.parameters()`` at run time), each at its local shape: the slice of its first reader."""
    readers: Dict[str, Tuple[IRNode, int, Optional[int]]] = {}     # name -> (first reader, view, stage)
    trained: Dict[str, set] = {}          # name -> pipeline stages (None without one) that train it
    train = train_graph(graphs)
    for sec in sections:
        for n in sec.nodes():
            for t in n.inputs:
                if t.is_weight:
                    readers.setdefault(t.name, (n, sec.device, sec.stage))
                    if sec.graph is train:
                        trained.setdefault(t.name, set()).add(sec.stage)
    facts = facts or LoweringFacts(graphs, geometry)
    any_graph = next(iter(graphs.values()))
    non_persistent = set(any_graph.meta.get("non_persistent", ()))
    units = any_graph.meta.get(SHARD_UNITS) or {}
    out = []
    for name, t in any_graph.weights.items():
        if name not in readers:
            continue
        node, view, stage = readers[name]
        devices = node.placement.devices
        lay = storage.get(name, Layout.replicated())
        shape = local_shape(t.shape, lay, len(devices))
        replicas = ()
        if geometry is not None and stage is not None:
            replicas = copies_of(name, facts.tied, geometry, stage, devices.index(view))
        out.append(LocalWeight(name, t.kind, tuple(shape), t.dtype, name in trained, lay, tuple(t.shape), devices,
                               devices.index(view), tuple(sorted(s for s in trained.get(name, ()) if s is not None)),
                               replicas, name not in non_persistent, units.get(name)))
    return out


def device_groups(graphs: Dict[str, IRGraph], geometry: Optional[PipelineGeometry],
                  tied: Dict[str, Tuple[int, ...]]) -> List[Devices]:
    """Every device set a collective or a gradient sum runs over: the same list on every rank, in
    the order process groups are created (collectively). ``tied``: ``tied_stages(graphs)``."""
    groups = {n.placement.devices for g in graphs.values() for n in g.nodes if len(n.placement.devices) > 1}
    groups |= {n.placement.axis_group(axis, d) for g in graphs.values() for n in g.nodes if n.placement.inner
               for axis, _ in n.placement.views() for d in n.placement.devices}
    groups = {d for d in groups if len(d) > 1}
    groups |= set(geometry.copy_groups() if geometry is not None else []) | set(tied_groups(tied, geometry))
    return sorted(groups, key=lambda d: (len(d), d))


def copies_of(name: str, tied: Dict[str, Tuple[int, ...]], geometry: PipelineGeometry, stage: int,
              position: int) -> Devices:
    """The plan devices whose copies of weight ``name`` (at ``position`` in their stage group) hold
    gradients to sum with this one: copies of the stage (chimera) and of the other stages that
    read a tied weight. Empty when there is no other copy."""
    devices = set()
    for s in tied.get(name, (stage,)):
        devices |= set(geometry.stage_copies(s).get(position, (geometry.stage_group(s)[position],)))
    return tuple(sorted(devices)) if len(devices) > 1 else ()


def tied_groups(tied: Dict[str, Tuple[int, ...]], geometry: Optional[PipelineGeometry]) -> List[Devices]:
    """Every device set whose tied-weight copies sum their gradients (process groups to create)."""
    if geometry is None:
        return []
    found = set()
    for name, stages in tied.items():
        for position in range(len(geometry.stage_group(stages[0]))):
            copies = copies_of(name, tied, geometry, stages[0], position)
            if copies:
                found.add(copies)
    return sorted(found)

