"""Predict the timeline of a pipeline schedule from per-stage costs.

The simulator plays the schedule the way the executor runs it:

- every device runs its blocks strictly in the order of its list, one at a time;
- a block starts when its device is free and the blocks it depends on have finished
  (see :meth:`~nbscaler.schedule.pipeline.PipelineSchedule.dependencies`), plus ``latency`` when
  the result has to travel from another device;
- a transfer between devices also costs each side ``post`` on its own device: the sending block
  lasts that much longer (the executor starts its sends inside the block), and the receiving block
  starts no sooner than ``post`` after its device's previous block (the executor posts receives
  between blocks, so that time is idle, not work);
- a block that several devices share (a sharded stage) starts when all of them reach it, and keeps
  all of them busy for its whole duration.

The result is a :class:`~nbscaler.schedule.timeline.Timeline`, with the pipeline device in the
``rank`` column. Its ``bubble_fraction`` is the idle share of device time; for equal stages with a
backward twice the forward, GPipe and 1F1B both idle ``(p-1) / (m+p-1)`` of it:

>>> line = simulate(build_schedule("1f1b", nstages=4, nmicros=8), forward_costs=1.0)
>>> line.makespan, round(line.bubble_fraction, 4)
(33.0, 0.2727)

A schedule whose devices wait on each other in a circle never finishes; the simulator finds that
and raises :class:`DeadlockError` naming where each device is stuck.
"""

from __future__ import annotations

import functools
from collections import deque
from typing import Mapping, NamedTuple, Optional, Sequence, Union

from nbscaler.schedule.block import PHASES, Block
from nbscaler.schedule.pipeline import PipelineSchedule
from nbscaler.schedule.timeline import TimedBlock, Timeline

Costs = Union[float, Sequence[float]]


class DeadlockError(ValueError):
    """The schedule cannot finish: every device that still has work waits for work that cannot run."""


def _per_stage(arg: str, costs: Costs, nstages: int) -> list[float]:
    """``costs`` as one number per stage; a single number means every stage costs the same."""
    values = [float(costs)] * nstages if isinstance(costs, (int, float)) else [float(c) for c in costs]
    if len(values) != nstages:
        raise ValueError(f"{arg} has {len(values)} entries, but the schedule has {nstages} stages: "
                         "give one cost per stage, or a single number for equal stages.")
    if any(v < 0 for v in values):
        raise ValueError(f"{arg}={values} has a negative cost: costs are durations, use values >= 0.")
    return values


def simulate(schedule: PipelineSchedule, forward_costs: Costs, backward_costs: Optional[Costs] = None,
             latency: float = 0.0, post: float = 0.0, weight_costs: Optional[Costs] = None,
             extra: Optional[Mapping[Block, float]] = None) -> Timeline:
    """The predicted timeline of one step of ``schedule``.

    Args:
        schedule: the schedule to play.
        forward_costs: the time of one micro-batch's forward, per stage (or one number for all).
        backward_costs: the same for the whole backward; twice the forward when not given.
        weight_costs: for a schedule with ``W`` blocks, the part of the backward that computes
            the weight gradients (``W``); ``B`` takes the rest. Half the backward when not given,
            so ``T_F = T_B = T_W`` by default.
        latency: the time a result takes to reach another device (point-to-point send/recv).
        post: the time a device spends starting one transfer to or from another device, on each
            side (see above).
        extra: seconds added to single blocks' costs, for what differs between the blocks of one
            stage and phase (ZeRO stage 3's exposed gathers: ``cost.fsdp.block_extras``).

    Raises:
        ValueError: a cost list does not fit the schedule.
        DeadlockError: no device can proceed before the schedule has finished.
    """
    order, starts, ends, _ = _timed(schedule, forward_costs, backward_costs, latency, post, weight_costs, extra)
    timed = [TimedBlock(d, step.block.stage, step.block.micro, step.block.phase, start, end)
             for step, start, end in zip(order, starts, ends) for d in step.devices]
    timed.sort(key=lambda t: (t.rank, t.t_start))
    return Timeline(tuple(timed), schedule.ndevices)


class StepTotals(NamedTuple):
    """A simulated step without its timeline: its ``makespan`` and each device's ``busy`` seconds
    (the time its blocks last), as ``Timeline.makespan`` and its per-rank sums give them."""

    makespan: float
    busy: tuple[float, ...]


def simulate_totals(schedule: PipelineSchedule, forward_costs: Costs, backward_costs: Optional[Costs] = None,
                    latency: float = 0.0, post: float = 0.0, weight_costs: Optional[Costs] = None,
                    extra: Optional[Mapping[Block, float]] = None) -> StepTotals:
    """``simulate``'s makespan and busy time per device without building the timeline: what a
    sweep of many configurations needs of each (the same arguments, the same errors).

    >>> simulate_totals(build_schedule("1f1b", nstages=4, nmicros=8), forward_costs=1.0).makespan
    33.0
    """
    _, starts, ends, busy = _timed(schedule, forward_costs, backward_costs, latency, post, weight_costs, extra)
    return StepTotals(max(ends) - min(starts) if ends else 0.0, tuple(busy))


def _timed(schedule: PipelineSchedule, forward_costs: Costs, backward_costs: Optional[Costs], latency: float,
           post: float, weight_costs: Optional[Costs], extra: Optional[Mapping[Block, float]] = None
           ) -> tuple[tuple["_Step", ...], list[float], list[float], list[float]]:
    """The play order (``_play_order``), each of its blocks' start and end by the rules above, and
    each device's busy seconds."""
    for name, value in (("latency", latency), ("post", post)):
        if value < 0:
            raise ValueError(f"{name}={value} is negative: use a send/recv time >= 0.")
    forward = _per_stage("forward_costs", forward_costs, schedule.nstages)
    backward = ([2 * c for c in forward] if backward_costs is None
                else _per_stage("backward_costs", backward_costs, schedule.nstages))
    cost = _phase_costs(schedule, forward, backward, weight_costs)
    flat = [c for phase in PHASES if phase in cost for c in cost[phase]]     # _Played.cost indexes it, by PHASES
    if extra and any(v < 0 for v in extra.values()):
        raise ValueError(f"extra={dict(extra)} has a negative cost: costs are durations, use values >= 0.")
    added = [extra.get(step.block, 0.0) for step in _play_order(schedule)] if extra else None

    free = [0.0] * schedule.ndevices           # when each device is next free
    busy = [0.0] * schedule.ndevices
    starts: list[float] = []
    ends: list[float] = []                     # the end of each block, in play order
    for k, (device, devices, near, far, receives, sends, c) in enumerate(_played(schedule)):   # kept tight: a sweep plays thousands
        if device >= 0:
            start = free[device]
        else:
            start = max(free[d] for d in devices)
        if receives:
            start += post
        for i in near:
            if ends[i] > start:
                start = ends[i]
        for i in far:
            arrival = ends[i] + latency
            if arrival > start:
                start = arrival
        end = start + flat[c] + (added[k] if added is not None else 0.0)
        if sends:
            end += post
        if device >= 0:
            free[device] = end
            busy[device] += end - start
        else:
            for d in devices:
                free[d] = end
                busy[d] += end - start
        starts.append(start)
        ends.append(end)
    return _play_order(schedule), starts, ends, busy


class _Played(NamedTuple):
    """One step of the play order as ``_timed`` reads it: its device (-1 where several share the
    block), those devices, the places of its inputs from the same devices and from others, whether
    it receives or sends, and its cost's place (``PHASES``' index times the stages, plus its stage)."""

    device: int
    devices: tuple[int, ...]
    near: tuple[int, ...]
    far: tuple[int, ...]
    receives: bool
    sends: bool
    cost: int


@functools.lru_cache(maxsize=256)
def _played(schedule: PipelineSchedule) -> tuple[_Played, ...]:
    return tuple(_Played(step.devices[0] if len(step.devices) == 1 else -1, step.devices,
                         tuple(i for i, far in step.inputs if not far), tuple(i for i, far in step.inputs if far),
                         step.receives, step.sends, PHASES.index(step.block.phase) * schedule.nstages + step.block.stage)
                 for step in _play_order(schedule))


class _Step(NamedTuple):
    """One block as ``simulate`` times it: the devices it keeps busy, its inputs (each as its place
    in the play order, with whether it comes from another device), whether it receives any and
    whether its result leaves."""

    block: Block
    devices: tuple[int, ...]
    inputs: tuple[tuple[int, bool], ...]
    receives: bool
    sends: bool


@functools.lru_cache(maxsize=256)
def _play_order(schedule: PipelineSchedule) -> tuple[_Step, ...]:
    """The order the devices run the schedule's blocks in: sweeping the devices, each runs the
    blocks at the head of its list while their devices are all there and their inputs are done.
    Which block can run never depends on the costs, only when, so a schedule is played through
    once and each ``simulate`` times the blocks in this order (a sweep simulates one schedule on
    many costs). ``DeadlockError`` where no device can go on."""
    ids: dict[Block, int] = {}                 # blocks by number: the sweep below compares numbers
    blocks: list[Block] = []
    lists = []
    for d in range(schedule.ndevices):
        for b in schedule.blocks_of(d):
            if b not in ids:
                ids[b] = len(blocks)
                blocks.append(b)
        lists.append([ids[b] for b in schedule.blocks_of(d)])
    devices = [schedule.devices_of(b.stage, b.micro) for b in blocks]
    deps = [schedule.dependencies(b) for b in blocks]
    inputs = [tuple(ids[dep] for dep in ds if dep in ids) for ds in deps]
    waits = [len(ds) != len(i) for ds, i in zip(deps, inputs)]   # on a block that never runs: a deadlock
    heads = [0] * schedule.ndevices
    done: dict[int, int] = {}                  # block -> its place in the order
    played: list[int] = []
    while len(played) < len(blocks):
        progressed = False
        for device, queue in enumerate(lists):
            while heads[device] < len(queue):
                block = queue[heads[device]]
                devs = devices[block]
                if (waits[block] or any(i not in done for i in inputs[block])
                        or (len(devs) > 1 and not all(heads[d] < len(lists[d]) and lists[d][heads[d]] == block
                                                      for d in devs))):
                    break
                for d in devs:
                    heads[d] += 1
                done[block] = len(played)
                played.append(block)
                progressed = True
        if not progressed:
            queues = [deque(blocks[i] for i in q[h:]) for q, h in zip(lists, heads)]
            raise DeadlockError(_describe_deadlock(schedule, queues, {blocks[i]: k for i, k in done.items()}))
    steps = [tuple((done[i], not set(devices[b]) <= set(devices[i])) for i in inputs[b]) for b in played]
    sends = {dep for step in steps for dep, far in step if far}    # results that travel
    return tuple(_Step(blocks[b], devices[b], step, any(far for _, far in step), k in sends)
                 for k, (b, step) in enumerate(zip(played, steps)))


def _phase_costs(schedule: PipelineSchedule, forward: list[float], backward: list[float],
                 weight_costs: Optional[Costs]) -> dict[str, list[float]]:
    """The per-stage cost of each phase; ``B`` is the backward less its ``W`` when the schedule
    splits it."""
    if not schedule.splits_backward:
        return {"F": forward, "B": backward}
    weight = ([c / 2 for c in backward] if weight_costs is None
              else _per_stage("weight_costs", weight_costs, schedule.nstages))
    if any(w > b for w, b in zip(weight, backward)):
        raise ValueError(f"weight_costs={weight} exceed backward_costs={backward}: the weight gradients are "
                         "part of the backward; give each stage's W no more than its backward.")
    return {"F": forward, "B": [b - w for b, w in zip(backward, weight)], "W": weight}


def _describe_deadlock(schedule: PipelineSchedule, queues: list[deque], finished: dict[Block, int]) -> str:
    stuck = []
    for device, queue in enumerate(queues):
        if not queue:
            continue
        block = queue[0]
        missing = [str(dep) for dep in schedule.dependencies(block) if dep not in finished]
        absent = [d for d in schedule.devices_of(block.stage, block.micro) if not queues[d] or queues[d][0] != block]
        reason = f"waits for {', '.join(missing)}" if missing else f"waits for devices {absent} to reach it"
        stuck.append(f"device {device} at {block} {reason}")
    return (f"pipeline schedule {schedule.name!r} deadlocks, no device can proceed: " + "; ".join(stuck)
            + ". Reorder the blocks so that each one comes after the blocks it waits for.")
