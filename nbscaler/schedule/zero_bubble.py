"""Zero-bubble schedules: the backward split into input and weight gradients (Qi et al. 2024,
"Zero Bubble Pipeline Parallelism").

A stage's backward does two jobs. ``B`` computes the gradient of the stage's input, which the
previous device waits for; ``W`` computes the gradients of the stage's weights, which nobody waits
for. Running ``W`` later, in a slot where the device would otherwise idle, takes it off the
critical path: the gradient travels back through the pipeline at the speed of ``B`` alone.

``zb_h1`` keeps 1F1B's order of forwards and backwards, device ``i`` running ``p - i`` forwards
before its first ``B``, and puts each ``W`` after a ``B``: right after it on the first device,
``i`` backwards later on device ``i``, the last ``i`` at the end. Late devices, which 1F1B leaves
idle at the end of the step, thus run their deferred ``W`` there while the gradients travel on to
the early devices. No device holds more micro-batches' activations than 1F1B's first device,
``p`` (a micro-batch's activations live until its ``W``), so the peak memory is 1F1B's.

With ``T_F``, ``T_B``, ``T_W`` the times of the three blocks of one stage, the paper gives 1F1B's
idle time per device as ``(p-1)(T_F + T_B + T_W)`` and ZB-H1's as ``(p-1)(T_F + T_B - T_W)``; with
``m >= p`` micro-batches and ``T_F = T_B = T_W`` that is a third, and the idle share is
``(p-1) / (3m + p-1)`` against 1F1B's ``(p-1) / (m+p-1)``. With ``p = m = 4`` (``w2`` is the
weight-gradient block of micro-batch 2)::

    f0 f1 f2 f3 b0 w0 b1 w1 b2 w2 b3 w3
       f0 f1 f2 b0 f3 b1 w0 b2 w1 b3 w2 w3
          f0 f1 b0 f2 b1 f3 b2 w0 b3 w1 w2 w3
             f0 b0 f1 b1 f2 b2 f3 b3 w0 w1 w2 w3
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
