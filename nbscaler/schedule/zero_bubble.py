"""Zero-bubble schedules: the backward split into input and weight gradients (Qi et al. 2024,
"Zero Bubble Pipeline Parallelism"): ``zb_h1`` and ``zbv``.

A stage's backward does two jobs. ``B`` computes the gradient of the stage's input, which the
previous device waits for; ``W`` computes the gradients of the stage's weights, which nobody waits
for. Running ``W`` later, in a slot where the device would otherwise idle, takes it off the
critical path: the gradient travels back through the pipeline at the speed of ``B`` alone.

``zb_h1`` keeps 1F1B's order of forwards and backwards, device ``i`` running ``p - i`` forwards
before its first ``B``, and puts each ``W`` after a ``B``: right after it on the first device,
``i`` backwards later on device ``i``, the last ``i`` at the end. Late devices, which 1F1B leaves
idle at the end of the step, thus run their deferred ``W`` there while the gradients travel on to
the early devices. No device holds more micro-batches' activations than 1F1B's first device,
``p`` (a micro-batch's activations live until its ``W``, but for the loss above the last
weight, which ``B`` lets go), so the peak memory is 1F1B's.

With ``T_F``, ``T_B``, ``T_W`` the times of the three blocks of one stage, the paper gives 1F1B's
idle time per device as ``(p-1)(T_F + T_B + T_W)`` and ZB-H1's as ``(p-1)(T_F + T_B - T_W)``; with
``m >= p`` micro-batches and ``T_F = T_B = T_W`` that is a third, and the idle share is
``(p-1) / (3m + p-1)`` against 1F1B's ``(p-1) / (m+p-1)``. With ``p = m = 4`` (``w2`` is the
weight-gradient block of micro-batch 2)::

    f0 f1 f2 f3 b0 w0 b1 w1 b2 w2 b3 w3
       f0 f1 f2 b0 f3 b1 w0 b2 w1 b3 w2 w3
          f0 f1 b0 f2 b1 f3 b2 w0 b3 w1 w2 w3
             f0 b0 f1 b1 f2 b2 f3 b3 w0 w1 w2 w3

``zbv`` cuts the model into ``2p`` stages and lays them in a V: device ``r`` holds stage ``r`` on
the way down and stage ``2p-1-r`` on the way back up, so the first device both starts and ends
every micro-batch, and the last device runs stages ``p-1`` and ``p`` back to back with no message
between them. Its order is played out with unit costs, each free device running the first of: a
``B`` whose gradient is there, an ``F`` whose activations are there while it holds fewer than
``2p`` stage activations (1F1B's peak, in half-size stages), a pending ``W``; the later stage goes
first. It is not the paper's handcrafted ZB-V, which reaches a zero bubble, but it idles about
half of ZB-H1's share on the same devices and micro-batches. With ``p = 2, m = 4`` (``f2'`` is micro-batch
2 on the device's second stage)::

    f0 f1 f2 f0' b0' w0' f1' b1' b0 w1' b1 f3 w0 f2' b2' w1 w2' b2 w2 f3' b3' w3' b3 w3
    f0 f0' f1 f1' b0' b0 w0' b1' b1 f2 w0 f2' w1' f3 b2' b2 w1 f3' w2' w2 b3' b3 w3' w3
"""

from __future__ import annotations

from nbscaler.schedule.block import Block
from nbscaler.schedule.pipeline import PipelineSchedule
from nbscaler.schedule.schedulers import _line, register_scheduler


def _deferred_weights_order(stage: int, nstages: int, nmicros: int) -> list[Block]:
    """Device ``stage``'s blocks: 1F1B's forwards and backwards, each ``W`` ``stage`` backwards late."""
    warmup = min(nstages - stage, nmicros)
    order = [Block(stage, m, "F") for m in range(warmup)]
    for m in range(nmicros):
        order.append(Block(stage, m, "B"))
        if m >= stage:
            order.append(Block(stage, m - stage, "W"))
        if m + warmup < nmicros:
            order.append(Block(stage, m + warmup, "F"))
    return order + [Block(stage, m, "W") for m in range(max(0, nmicros - stage), nmicros)]


@register_scheduler("zb_h1")
def zb_h1(nstages: int, nmicros: int) -> PipelineSchedule:
    """ZB-H1: one stage per device, 1F1B's memory, ``W`` blocks filling the bubbles."""
    orders = [_deferred_weights_order(s, nstages, nmicros) for s in range(nstages)]
    return PipelineSchedule("zb_h1", nstages, nmicros, orders, [_line(nstages)], [0] * nmicros)


def _v_placement(ndevices: int) -> tuple[tuple[int, ...], ...]:
    """Stage ``s`` down the devices and back up: device ``r`` holds stages ``r`` and ``2p-1-r``."""
    return tuple((s if s < ndevices else 2 * ndevices - 1 - s,) for s in range(2 * ndevices))


def _played_orders(nstages: int, nmicros: int, placement, limit: int) -> list[list[Block]]:
    """Each device's blocks when every block takes one step and a free device runs the first of:
    a ``B`` whose gradient is there (the latest stage first), an ``F`` whose activations are there
    while fewer than ``limit`` stage activations await their ``W`` (the latest stage first), the
    oldest pending ``W``."""
    ndevices = 1 + max(d for (d,) in placement)
    stages = [[s for s in range(nstages) if placement[s] == (d,)][::-1] for d in range(ndevices)]
    done: dict[Block, int] = {}
    next_block = {(s, p): 0 for s in range(nstages) for p in "FBW"}
    orders: list[list[Block]] = [[] for _ in range(ndevices)]
    pending_w: list[list[Block]] = [[] for _ in range(ndevices)]
    live = [0] * ndevices

    def ready(block: Block, step: int) -> bool:
        return block in done and done[block] <= step

    step = 0
    while sum(map(len, orders)) < 3 * nstages * nmicros:
        for d in range(ndevices):
            chosen = None
            for s in stages[d]:
                m = next_block[(s, "B")]
                if m < next_block[(s, "F")] and ready(Block(s, m, "F"), step) and \
                        (s == nstages - 1 or ready(Block(s + 1, m, "B"), step)):
                    chosen = Block(s, m, "B")
                    break
            if chosen is None and live[d] < limit:
                for s in stages[d]:
                    m = next_block[(s, "F")]
                    if m < nmicros and (s == 0 or ready(Block(s - 1, m, "F"), step)):
                        chosen = Block(s, m, "F")
                        break
            if chosen is None and pending_w[d]:
                chosen = pending_w[d].pop(0)
            if chosen is None:
                continue
            next_block[(chosen.stage, chosen.phase)] += 1
            live[d] += {"F": 1, "B": 0, "W": -1}[chosen.phase]
            if chosen.phase == "B":
                pending_w[d].append(Block(chosen.stage, chosen.micro, "W"))
            orders[d].append(chosen)
            done[chosen] = step + 1
        step += 1
    return orders


@register_scheduler("zbv", stages_per_device=2)
def zbv(nstages: int, nmicros: int) -> PipelineSchedule:
    """ZB-V: two stages per device in a V, ``W`` blocks filling the bubbles."""
    ndevices = nstages // 2
    placement = _v_placement(ndevices)
    orders = _played_orders(nstages, nmicros, placement, limit=2 * ndevices)
    return PipelineSchedule("zbv", nstages, nmicros, orders, [placement], [0] * nmicros)
