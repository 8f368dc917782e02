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
from typing import NamedTuple, Optional, Sequence, Union

from nbscaler.schedule.block import Block
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
             latency: float = 0.0, post: float = 0.0, weight_costs: Optional[Costs] = None) -> Timeline:
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

    Raises:
        ValueError: a cost list does not fit the schedule.
        DeadlockError: no device can proceed before the schedule has finished.
    """
    for name, value in (("latency", latency), ("post", post)):
        if value < 0:
            raise ValueError(f"{name}={value} is negative: use a send/recv time >= 0.")
    forward = _per_stage("forward_costs", forward_costs, schedule.nstages)
    backward = ([2 * c for c in forward] if backward_costs is None
                else _per_stage("backward_costs", backward_costs, schedule.nstages))
    cost = _phase_costs(schedule, forward, backward, weight_costs)

    device_free = [0.0] * schedule.ndevices
    finished: list[float] = []                 # the end of each block, in play order
    timed: list[TimedBlock] = []
    for step in _play_order(schedule):
        block = step.block
        arrivals = [finished[dep] + (latency if far else 0.0) for dep, far in step.inputs]
        receiving = post if step.receives else 0.0
        start = max([device_free[d] + receiving for d in step.devices] + arrivals)
        end = start + cost[block.phase][block.stage] + (post if step.sends else 0.0)
        for d in step.devices:
            device_free[d] = end
            timed.append(TimedBlock(d, block.stage, block.micro, block.phase, start, end))
        finished.append(end)
    timed.sort(key=lambda t: (t.rank, t.t_start))
    return Timeline(tuple(timed), schedule.ndevices)


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
    queues = [deque(schedule.blocks_of(d)) for d in range(schedule.ndevices)]
    done: dict[Block, int] = {}                # block -> its place in the order
    sends = _blocks_sending_away(schedule)
    order: list[_Step] = []

    def ready(block: Block) -> bool:
        devices = schedule.devices_of(block.stage, block.micro)
        return (all(queues[d] and queues[d][0] == block for d in devices)
                and all(dep in done for dep in schedule.dependencies(block)))

    while any(queues):
        progressed = False
        for device in range(schedule.ndevices):
            while queues[device] and ready(queues[device][0]):
                block = queues[device][0]
                inputs = tuple((done[dep], _crosses(schedule, dep, block)) for dep in schedule.dependencies(block))
                devices = schedule.devices_of(block.stage, block.micro)
                order.append(_Step(block, devices, inputs, any(far for _, far in inputs), block in sends))
                for d in devices:
                    queues[d].popleft()
                done[block] = len(order) - 1
                progressed = True
        if not progressed:
            raise DeadlockError(_describe_deadlock(schedule, queues, done))
    return tuple(order)


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


def _crosses(schedule: PipelineSchedule, dep: Block, block: Block) -> bool:
    """Whether ``block`` runs on a device that did not run ``dep``, so ``dep``'s result travels."""
    return not set(schedule.devices_of(block.stage, block.micro)) <= set(schedule.devices_of(dep.stage, dep.micro))


def _blocks_sending_away(schedule: PipelineSchedule) -> set[Block]:
    """The blocks whose result some block on another device depends on."""
    return {dep for device in range(schedule.ndevices) for block in schedule.blocks_of(device)
            for dep in schedule.dependencies(block) if _crosses(schedule, dep, block)}


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
