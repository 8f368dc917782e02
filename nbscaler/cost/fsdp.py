"""ZeRO stage 3 in time: each unit's all-gathers and reduce-scatter, and what of them a step waits for.

Under ``ComputeConfig(use_zero=True, zero_stage=3)`` a rank stores ``1/N`` of each unit
(``policy.shard_units``), gathers the whole unit before the unit runs and reduce-scatters its
gradients once the backward has made them (``runtime.fsdp``). A unit is one flat bucket per
parameter dtype, each padded to a multiple of ``N`` (the ZeRO group size): ``P`` bytes in the
parameters' (module) dtype, ``G`` bytes of gradients in the recipe's reduction dtype
(``Recipe.reduce_dtype``: fp32 for a bf16 model with fp32 masters). Per unit and rank:

=====================  ======================================  ========================================
collective             sent by each rank (ring)                priced as (``cost.nccl``, ``comm_model``)
=====================  ======================================  ========================================
all-gather             ``(N-1)/N * P``                         ``all_gather`` of the ``P/N`` shard
reduce-scatter         ``(N-1)/N * G``                         ``reduce_scatter`` of ``G``
its slice summed       ``2(R-1)/R * G/N`` (``zero_ngroups=R``)  ``all_reduce`` of ``G/N`` over ``R``
=====================  ======================================  ========================================

each over the group's ranks, so on the link they span (``Hardware.link``: NVLink inside a node,
the network for a group across nodes); where a backend runs the reduce-scatter as an all-reduce
(gloo: ``layouts.EMULATED``) it is priced, and counted, as that. A forward gathers every unit it
reads; a backward gathers again the units *released* after their forward (every unit but the
rest of the model, ``REST_UNIT``, unless ``zero_reshard_after_forward=False``, which releases none)
and reduce-scatters every unit. A unit the forward keeps stays gathered until its gradients are
reduced, so a forward gathers it only when no earlier forward of its stage still holds it
(``cold_forwards``): every micro-batch without a pipeline or on a pipeline's last stage, once a
step on the other stages of 1F1B.

How they overlap, played per block (one micro-batch's forward or backward of one stage,
``play_forward`` and ``play_backward``) as FSDP prefetches:

- the rank computes on one stream; the ZeRO group's collectives run one after another on the
  group's link, in the order they are issued;
- forward: where a unit is gathered (``comm.unit_gathers``) the rank waits for its all-gather
  (issuing it there when no one has: the block's first) and issues the next unit's, which runs
  under this unit's compute. A gather longer than the compute before the next gather point is
  exposed by the difference;
- backward: where autograd reaches a released unit's outputs the rank waits for its all-gather
  (the block's first is issued there) and issues the previous unit's; a unit's reduce-scatter is
  issued once the backward has made its last gradient and runs under the compute after it; what
  runs past the block's compute (at least the last reduce-scatter) is exposed. A split backward
  (zero-bubble schedules) gathers in ``B`` and reduce-scatters in ``W``, each half of the backward's
  compute, as ``schedule.simulate`` splits it;
- where nothing overlaps (this machine, whose CPU ranks compute and communicate on the same cores;
  a target whose software reduces after the backward: ``step_figures.overlaps_communication``)
  every collective is waited for where it is issued.

A block lasts its compute plus what it waits (``Played.exposed_s``); ``block_extras`` gives those
exposed seconds per block to the pipeline simulator, ``StepModel`` draws each collective in the
timeline and counts them in ``DeviceStep.fsdp_s``. Compute includes the tensor-parallel
collectives, which run on the compute stream; they and the ZeRO group's collectives are taken not
to slow each other down on a link they share. ZeRO-3 has no all-gather after the optimizer step
(stages 1 and 2 price one: ``cost.timing.bucket_seconds``): the next forward gathers the updated shards.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Set, Tuple, Union

import torch

from nbscaler.comm.program import Call, LocalWeight, Recompute, Reshard, Return, Section, Send, Unshard
from nbscaler.comm.unit_gathers import units_read, with_gathers
from nbscaler.cost.context_calls import ring_exposed
from nbscaler.cost.local import LocalRun
from nbscaler.ir.graph import SHARD_UNITS
from nbscaler.layouts import WIRE_SHARE, Collective, runs
from nbscaler.recipe import Recipe
from nbscaler.schedule import Block, PipelineSchedule

ALL_GATHER, REDUCE_SCATTER = Collective.ALL_GATHER, Collective.REDUCE_SCATTER

#: The share of a backward's compute a split backward's ``W`` block takes: ``schedule.simulate``'s
#: when it is given no weight costs, as ``cost.timing.StepModel`` gives it none.
WEIGHT_SHARE = 0.5


# -- what each unit moves ------------------------------------------------------------------------
@dataclass(frozen=True)
class UnitBytes:
    """One unit's flat buckets on a rank (one per parameter dtype, in the order the rank's weights
    first have it, as ``runtime.fsdp.ShardedUnits`` makes them), each padded to a multiple of the
    ZeRO group size: ``(P, G)`` per bucket, ``P`` its parameters' bytes (what an all-gather makes
    on each rank) and ``G`` its gradients' in the reduction dtype (what a reduce-scatter reads)."""

    unit: str
    buckets: Tuple[Tuple[int, int], ...]

    @property
    def gather_bytes(self) -> int:
        return sum(p for p, _ in self.buckets)

    @property
    def reduce_bytes(self) -> int:
        return sum(g for _, g in self.buckets)


def unit_bytes(params: Iterable[LocalWeight], unit_of: Callable[[str], Optional[str]], group: int,
               recipe: Recipe) -> Dict[str, UnitBytes]:
    """``UnitBytes`` of each unit among a rank's ``params`` (its weight table, in order; only
    parameters count), ``unit_of(name)`` naming a parameter's unit (``None``: none), for a ZeRO
    group of ``group`` ranks whose gradients are reduced as ``recipe`` says."""
    numels: Dict[str, Dict[torch.dtype, int]] = {}
    for p in params:
        unit = unit_of(p.name) if p.kind == "param" else None
        if unit is not None:
            by_dtype = numels.setdefault(unit, {})
            by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel
    out = {}
    for unit, by_dtype in numels.items():
        padded = {dtype: -(-n // group) * group for dtype, n in by_dtype.items()}
        out[unit] = UnitBytes(unit, tuple((n * dtype.itemsize, n * recipe.reduce_dtype(dtype).itemsize)
                                          for dtype, n in padded.items()))
    return out


def sent_bytes(units: Mapping[str, UnitBytes], gathers: Mapping[str, int], reduces: Mapping[str, int], group: int,
               replicas: int, backend: Optional[str]) -> float:
    """Bytes a rank sends in ``gathers[unit]`` all-gathers and ``reduces[unit]`` reduce-scatters
    (each with its slice's all-reduce over ``replicas`` ZeRO groups) of each unit, with ring
    algorithms, as ``backend`` runs them (``None``: the ideal collectives)."""
    gather_share = WIRE_SHARE[ALL_GATHER](group) / group if group > 1 else 0.0      # of the whole P
    reduce_share = WIRE_SHARE[runs(backend, REDUCE_SCATTER)](group) if group > 1 else 0.0
    slice_share = WIRE_SHARE[Collective.ALL_REDUCE](replicas) / group if replicas > 1 else 0.0
    return sum(gathers.get(name, 0) * gather_share * u.gather_bytes
               + reduces.get(name, 0) * (reduce_share + slice_share) * u.reduce_bytes
               for name, u in units.items())


@dataclass(frozen=True)
class UnitSeconds:
    """One unit's all-gather (``gather_s``) and reduce-scatter with its slice's all-reduce across
    the ZeRO groups (``reduce_s``), each alone on the group's link."""

    gather_s: float
    reduce_s: float


def unit_seconds(units: Mapping[str, UnitBytes], comm, group: Sequence[int],
                 replicas: Sequence[int]) -> Dict[str, UnitSeconds]:
    """Each unit's collectives on ``comm`` (a ``CommModel`` or ``NcclModel``) over the ZeRO
    ``group``'s ranks and the ``replicas`` holding the same shard (module docstring's table)."""
    n, r = len(group), len(replicas)
    out = {}
    for name, u in units.items():
        gather = sum(comm.forward(ALL_GATHER, p // n, n, ranks=group) for p, _ in u.buckets)
        reduce = sum(comm.forward(REDUCE_SCATTER, g, n, ranks=group)
                     + comm.forward(Collective.ALL_REDUCE, g // n, r, ranks=replicas) for _, g in u.buckets)
        out[name] = UnitSeconds(gather, reduce)
    return out


# -- a section as the collectives see it ---------------------------------------------------------
@dataclass(frozen=True)
class Gather:
    """Where ``unit`` is gathered before its first reader; ``prefetch``: the unit gathered next."""

    unit: str
    prefetch: Optional[str] = None


@dataclass(frozen=True)
class Release:
    """Where ``unit``, released after its forward, is freed: the backward gathers it again here."""

    unit: str


@dataclass(frozen=True)
class Work:
    """Compute between gather points: forward and backward seconds (ops and tensor-parallel
    collectives, a recomputed forward in the backward), and the units whose parameters it reads."""

    forward_s: float
    backward_s: float
    reads: FrozenSet[str] = frozenset()


Step = Union[Gather, Release, Work]
Script = Tuple[Step, ...]


def section_script(section: Section, run: LocalRun, profiler, comm) -> Script:
    """A lowered ``section``'s instructions as ``Step``\\ s: its ``Unshard`` and ``Reshard`` as
    ``Gather`` and ``Release``, every other instruction as the ``Work`` of its ops and of the
    collectives before them in ``run`` (its replay, ``cost.local``), timed by ``profiler`` and
    ``comm`` as ``cost.timing.section_time`` times them; then the autograd engine's start-up,
    the first thing the backward does."""
    ops: Dict[int, Tuple[float, float]] = {}
    for op in run.ops:
        f, b = profiler.time(op)
        ring = ring_exposed(op, comm, profiler.time)            # a context-parallel ring's passes
        ops[id(op.node)] = _plus(ops.get(id(op.node)), (f + ring[0], b + ring[1] + (f if op.recomputed else 0.0)))
    before: Dict[Optional[str], Tuple[float, float]] = {}          # consumer's name (None: an output) -> seconds
    for c in run.collectives:
        before[c.node] = _plus(before.get(c.node), c.seconds(comm))
    units_of = section.graph.meta.get(SHARD_UNITS) or {}
    out: List[Step] = []
    outputs = True
    for ins in section.instructions:
        if isinstance(ins, Unshard):
            out.append(Gather(ins.unit, ins.prefetch))
        elif isinstance(ins, Reshard):
            out.append(Release(ins.unit))
        elif isinstance(ins, (Call, Recompute)):
            nodes = [ins.node] if isinstance(ins, Call) else [c.node for c in ins.body]
            f = b = 0.0
            for n in nodes:
                for part in (ops.get(id(n)), before.get(n.name)):
                    f, b = _plus((f, b), part)
            out.append(Work(f, b, frozenset(units_read(ins, units_of))))
        elif isinstance(ins, (Send, Return)) and outputs:       # the outputs' collectives, counted once
            outputs = False
            out.append(Work(*before.get(None, (0.0, 0.0)), frozenset(units_read(ins, units_of))))
    out.append(Work(0.0, profiler.overhead_s))
    return compact(tuple(out))


def compact(script: Script) -> Script:
    """``script`` with each run of ``Work`` between two gather or release points made one, which
    plays the same: a play reads only the compute between those points and each unit's first
    reader, which always comes right after its gather point (a run's first ``Work``)."""
    out: List[Step] = []
    for step in script:
        if isinstance(step, Work) and out and isinstance(out[-1], Work):
            last = out[-1]
            out[-1] = Work(last.forward_s + step.forward_s, last.backward_s + step.backward_s, last.reads | step.reads)
        else:
            out.append(step)
    return tuple(out)


def _plus(a: Optional[Tuple[float, float]], b: Optional[Tuple[float, float]]) -> Tuple[float, float]:
    if a is None:
        return b if b is not None else (0.0, 0.0)
    return a if b is None else (a[0] + b[0], a[1] + b[1])


def script_of(entries: Sequence[Work], reshard_after_forward: bool) -> Script:
    """The ``Script`` of ``entries`` (instructions, in order, as ``Work``), each unit gathered and
    released where the lowering puts its ``Unshard`` and ``Reshard`` (``comm.unit_gathers``)."""
    return compact(tuple(with_gathers(list(entries), [w.reads for w in entries], reshard_after_forward,
                                      lambda unit, prefetch: Gather(unit, prefetch),
                                      lambda unit, first, last: Release(unit))))


def script_units(script: Script) -> Tuple[List[str], Set[str]]:
    """The units ``script`` gathers, in order, and those it releases after their forward."""
    return [s.unit for s in script if isinstance(s, Gather)], {s.unit for s in script if isinstance(s, Release)}


# -- playing a block -----------------------------------------------------------------------------
@dataclass(frozen=True)
class UnitCall:
    """One collective of a block: ``kind`` (all-gather or reduce-scatter) of ``unit``, from
    ``start_s`` to ``end_s`` after the block starts; ``waited_s``: the seconds the block waits for
    it (its exposed part), at its gather point or, past the block's compute, at the block's end."""

    kind: Collective
    unit: str
    start_s: float
    end_s: float
    waited_s: float


@dataclass(frozen=True)
class Played:
    """One block: its compute's seconds, its seconds with what it waits for, and its collectives."""

    compute_s: float
    seconds: float
    calls: Tuple[UnitCall, ...] = ()

    @property
    def exposed_s(self) -> float:
        """The seconds the block waits for its collectives."""
        return self.seconds - self.compute_s


class _Streams:
    """A rank's compute and its ZeRO group's link over one block (module docstring)."""

    def __init__(self, overlap: bool):
        self.overlap = overlap
        self.now = self.link = self.compute = 0.0
        self.calls: Dict[Tuple[Collective, str], List[float]] = {}     # -> [start, end, waited]

    def work(self, seconds: float) -> None:
        self.now += seconds
        self.compute += seconds

    def issue(self, kind: Collective, unit: str, seconds: float) -> None:
        if (kind, unit) in self.calls or seconds <= 0:      # none over a group of one rank
            return
        start = max(self.now, self.link)
        self.link = start + seconds
        self.calls[(kind, unit)] = [start, self.link, 0.0]
        if not self.overlap:
            self.wait(kind, unit)

    def wait(self, kind: Collective, unit: str) -> None:
        call = self.calls.get((kind, unit))
        if call is not None and call[1] > self.now:
            call[2] += call[1] - self.now
            self.now = call[1]

    def played(self) -> Played:
        for call in self.calls.values():            # what runs past the compute is waited for at the end
            if call[1] > self.now:
                call[2] += call[1] - max(call[0], self.now)
        calls = tuple(UnitCall(kind, unit, *c) for (kind, unit), c in self.calls.items())
        return Played(self.compute, max(self.now, self.link), calls)


def play_forward(script: Script, seconds: Mapping[str, UnitSeconds], gather: Set[str], overlap: bool) -> Played:
    """One forward of ``script`` that gathers the units in ``gather`` (module docstring)."""
    s = _Streams(overlap)
    for step in script:
        if isinstance(step, Gather):
            if step.unit in gather:
                s.issue(ALL_GATHER, step.unit, seconds[step.unit].gather_s)
                s.wait(ALL_GATHER, step.unit)
            if step.prefetch in gather:
                s.issue(ALL_GATHER, step.prefetch, seconds[step.prefetch].gather_s)
        elif isinstance(step, Work):
            s.work(step.forward_s)
    return s.played()


def play_backward(script: Script, seconds: Mapping[str, UnitSeconds], regather: Set[str], reduce: Set[str],
                  overlap: bool, share: float = 1.0) -> Played:
    """One backward of ``script`` (``share`` of its compute) that gathers again the units in
    ``regather`` and reduce-scatters those in ``reduce`` (module docstring)."""
    order, _ = script_units(script)
    previous = dict(zip(order[1:], order))
    left = Counter(u for step in script if isinstance(step, Work) for u in step.reads)
    s = _Streams(overlap)
    for step in reversed(script):
        if isinstance(step, Work):
            s.work(step.backward_s * share)
            for u in sorted(step.reads):
                left[u] -= 1
                if left[u] == 0 and u in reduce:          # its last gradient is made
                    s.issue(REDUCE_SCATTER, u, seconds[u].reduce_s)
        elif isinstance(step, Release) and step.unit in regather:
            s.issue(ALL_GATHER, step.unit, seconds[step.unit].gather_s)
            s.wait(ALL_GATHER, step.unit)
            if previous.get(step.unit) in regather:
                s.issue(ALL_GATHER, previous[step.unit], seconds[previous[step.unit]].gather_s)
    return s.played()


@dataclass(frozen=True)
class StagePlays:
    """The blocks of one stage on one plan device: a forward that gathers every unit (``cold``) or
    only the released ones (``warm``: an earlier forward holds the rest), the backward, and a split
    backward's ``B`` (``input_grads``) and ``W`` (``weight_grads``) where the schedule splits it."""

    cold: Played
    warm: Played
    backward: Played
    input_grads: Optional[Played] = None
    weight_grads: Optional[Played] = None

    def of(self, phase: str, cold: bool) -> Played:
        """The play of a block of ``phase`` (``cold``: a forward that gathers every unit)."""
        if phase == "F":
            return self.cold if cold else self.warm
        if phase == "W":
            return self.weight_grads
        return self.input_grads if self.input_grads is not None else self.backward


def stage_plays(script: Script, seconds: Mapping[str, UnitSeconds], overlap: bool, splits: bool) -> StagePlays:
    """``StagePlays`` of a stage's ``script`` (``splits``: the schedule has ``W`` blocks)."""
    order, released = script_units(script)
    units = set(order)
    backward = play_backward(script, seconds, released, units, overlap)
    if not splits:
        return StagePlays(play_forward(script, seconds, units, overlap),
                          play_forward(script, seconds, released, overlap), backward)
    return StagePlays(play_forward(script, seconds, units, overlap), play_forward(script, seconds, released, overlap),
                      backward, play_backward(script, seconds, released, set(), overlap, 1 - WEIGHT_SHARE),
                      play_backward(script, seconds, set(), units, overlap, WEIGHT_SHARE))


# -- a step's blocks -----------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def cold_forwards(schedule: PipelineSchedule) -> FrozenSet[Block]:
    """The forward blocks of ``schedule`` that gather every unit of their stage: walking each
    device's blocks in order, a stage's forward finds its kept units gathered while an earlier
    forward of the stage waits for the backward that reduce-scatters them (``B``, or ``W`` where
    the backward is split), as ``ShardedUnits`` counts forwards per unit."""
    release = "W" if schedule.splits_backward else "B"
    cold = set()
    for device in range(schedule.ndevices):
        held: Counter = Counter()
        for b in schedule.blocks_of(device):
            if b.phase == "F":
                if held[b.stage] == 0:
                    cold.add(b)
                held[b.stage] += 1
            elif b.phase == release:
                held[b.stage] = max(0, held[b.stage] - 1)
    return frozenset(cold)


def section_units(section: Section) -> Tuple[List[str], Set[str]]:
    """The units a lowered ``section`` gathers, in order, and those it releases after their forward."""
    return ([ins.unit for ins in section.instructions if isinstance(ins, Unshard)],
            {ins.unit for ins in section.instructions if isinstance(ins, Reshard)})


def step_counts(units: Mapping[Optional[int], Tuple[List[str], Set[str]]], schedule: Optional[PipelineSchedule],
                pipeline_device: int = 0, nsamples: int = 1) -> Tuple[Counter, Counter]:
    """How often one step all-gathers and reduce-scatters each unit of a plan device whose
    sections (by stage) gather and release ``units`` (``section_units``): without a pipeline,
    ``nsamples`` forwards (each gathering every unit) and backwards; with one, the blocks of its
    ``pipeline_device`` (``cold_forwards`` gather every unit, the others the released ones; ``B``
    gathers the released again; the backward that reduces is ``B``, or ``W`` where it is split)."""
    if schedule is None:
        blocks = [(None, "F", True), (None, "B", False)] * nsamples
        release = "B"
    else:
        cold = cold_forwards(schedule)
        blocks = [(b.stage, b.phase, b in cold) for b in schedule.blocks_of(pipeline_device)]
        release = "W" if schedule.splits_backward else "B"
    gathers, reduces = Counter(), Counter()
    for stage, phase, cold_block in blocks:
        order, released = units.get(stage, ([], set()))
        if phase == "F":
            gathers.update(order if cold_block else [u for u in order if u in released])
        elif phase == "B":
            gathers.update(u for u in order if u in released)
        if phase == release:
            reduces.update(order)
    return gathers, reduces


def block_plays(schedule: PipelineSchedule, plays: Mapping[int, StagePlays]) -> Dict[Block, Played]:
    """The play of each block of ``schedule`` whose stage has ``plays``."""
    cold = cold_forwards(schedule)
    return {b: plays[b.stage].of(b.phase, b in cold) for d in range(schedule.ndevices)
            for b in schedule.blocks_of(d) if b.stage in plays}


def block_extras(schedule: PipelineSchedule, plays: Mapping[int, Sequence[StagePlays]]) -> Dict[Block, float]:
    """The seconds each block of ``schedule`` waits for its collectives (``Played.exposed_s``), the
    most of any device of its stage's group (``plays[stage]``: each one's): what the pipeline
    simulator adds to its compute (``schedule.simulate``'s ``extra``); none kept for a block that
    waits for nothing."""
    cold = cold_forwards(schedule)
    most = {s: {(phase, c): max(p.of(phase, c).exposed_s for p in group) for phase in schedule_phases(schedule)
                for c in (False, True)} for s, group in plays.items() if group}
    out = {}
    for d in range(schedule.ndevices):
        for b in schedule.blocks_of(d):
            wait = most[b.stage][(b.phase, b in cold)] if b.stage in most else 0.0
            if wait > 0:
                out[b] = wait
    return out


def schedule_phases(schedule: PipelineSchedule) -> Tuple[str, ...]:
    """The phases of ``schedule``'s blocks."""
    return ("F", "B", "W") if schedule.splits_backward else ("F", "B")


@dataclass(frozen=True)
class DeviceUnits:
    """A plan device's ZeRO-3 collectives: its units' bytes and seconds and each stage's plays
    (key ``None`` without a pipeline)."""

    bytes: Dict[str, UnitBytes]
    seconds: Dict[str, UnitSeconds]
    plays: Dict[Optional[int], StagePlays]
