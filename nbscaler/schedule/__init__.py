"""Pipeline schedules as plain data, and a simulator that predicts their timeline.

A pipelined model is cut into *stages*, each on its own *pipeline device*, and a step's batch is
cut into *micro-batches* (``pipeline_nmicros``, one per sample given to ``train_step``). A
schedule says, for every device, in which order it runs the forward (``F``) and backward (``B``)
of its stages on every micro-batch (zero-bubble schedules split the backward into ``B``, the input
gradients, and ``W``, the weight gradients). One schedule object feeds three consumers:

- the executor, which runs the blocks in that order;
- the simulator, which predicts the timeline and the idle share (the *bubble*) from costs;
- the telemetry views, which draw the measured timeline next to the predicted one, in the same
  row format.

The pieces, one module each:

- :mod:`~nbscaler.schedule.block`: :class:`Block`, one ``(stage, micro, phase)`` unit of work.
- :mod:`~nbscaler.schedule.pipeline`: :class:`PipelineSchedule`, the ordered blocks per device and
  where each stage lives; :func:`check_samples`.
- :mod:`~nbscaler.schedule.schedulers`: the registry (:func:`register_scheduler`, each scheduler
  with the rules ``ComputeConfig`` applies to it) and :func:`build_schedule`; the classic
  schedulers ``1f1b``, ``1f1b_plus``, ``gpipe``, ``chimera_direct`` and ``infer_pipe``.
- :mod:`~nbscaler.schedule.interleaved`: ``1f1b_interleaved``, several non-adjacent stages per
  device (``ComputeConfig.pipeline_virtual_stages`` of them; each pipeline device may be a
  tensor-parallel group of plan devices).
- :mod:`~nbscaler.schedule.zero_bubble`: ``zb_h1`` and ``zbv`` (two stages per device in a V),
  the backward split into ``B`` (input gradients) and ``W`` (weight gradients) blocks, ``W``
  filling the bubbles.
- :mod:`~nbscaler.schedule.geometry`: :class:`PipelineGeometry`, where the pipeline devices and
  their stages sit among a unit's plan devices (stage groups; chimera's copies of each stage).
- :mod:`~nbscaler.schedule.grid`: :class:`RankGrid`, which ranks form a unit, a data-parallel set,
  a ZeRO group; ``ComputeConfig.grid`` builds it.
- :mod:`~nbscaler.schedule.timeline`: :class:`TimedBlock` and :class:`Timeline`, rows
  ``(rank, stage, micro, phase, t_start, t_end)`` and the bubble fraction; :class:`CollectiveBlock`,
  a collective beside them (ZeRO stage 3's gathers and reduce-scatters).
- :mod:`~nbscaler.schedule.simulator`: :func:`simulate` (and :func:`simulate_totals`, its length and busy times alone).

Using a schedule
----------------
Code generation asks which stages a device holds (two for ``chimera_direct``, ``v`` for
``1f1b_interleaved``; the shared head stage plus one for ``1f1b_plus``); the executor walks the
device's blocks and asks where the neighbouring stages of a micro-batch run, to receive from and
send to them::

    geometry = PipelineGeometry.from_config(cfg)       # the scheduler's stages on its devices
    schedule = geometry.schedule
    check_samples(schedule, len(samples))
    for block in schedule.blocks_of(device):
        if block.phase == "F":
            ...  # receive from schedule.devices_of(block.stage - 1, block.micro) unless stage 0,
            ...  # run the forward of block.stage on sample block.micro,
            ...  # send to schedule.devices_of(block.stage + 1, block.micro) unless the last stage
        elif block.phase == "B":
            ...  # the same backwards: receive the gradient from stage + 1, send it to stage - 1
        else:
            ...  # W: the weight gradients B left for later; nothing to send or receive

The charts of the orders are in each scheduler's docstring. One step of ``p = 4`` devices and
``m = 8`` micro-batches, every stage's forward costing 1 and backward 2, idles this share of the
device time (:func:`simulate`; each equals its paper's closed form):

==========================  =============================  ==============
scheduler                   closed form                    idle share
==========================  =============================  ==============
``gpipe``, ``1f1b``         ``(p-1)/(m+p-1)``              3/11 = 0.273
``1f1b_interleaved``, v=2   ``(p-1)/(v*m+p-1)``            3/19 = 0.158
``zb_h1``                   ``(p-1)/(3m+p-1)``             3/27 = 0.111
``zbv``                     (played, none claimed)         0.077
==========================  =============================  ==============

Predicting a timeline
---------------------
>>> schedule = build_schedule("gpipe", nstages=4, nmicros=8)
>>> line = simulate(schedule, forward_costs=[1.0, 1.0, 1.0, 1.0])   # backward: twice the forward
>>> round(line.bubble_fraction, 4)
0.2727
>>> sorted(line.to_rows()[0])
['micro', 'phase', 'rank', 'stage', 't_end', 't_start']
"""

from nbscaler.schedule.block import PHASES, Block, Phase
from nbscaler.schedule.geometry import PipelineGeometry
from nbscaler.schedule.grid import RankGrid
from nbscaler.schedule.pipeline import PipelineRoute, PipelineSchedule, check_samples
from nbscaler.schedule.schedulers import (SCHEDULERS, SchedulerSpec, build_schedule, register_scheduler,
                                          scheduler_spec)
from nbscaler.schedule import interleaved, zero_bubble  # noqa: F401  (they register their schedulers)
from nbscaler.schedule.simulator import DeadlockError, StepTotals, simulate, simulate_totals
from nbscaler.schedule.timeline import CollectiveBlock, TimedBlock, Timeline

__all__ = [
    "Block",
    "CollectiveBlock",
    "DeadlockError",
    "PipelineGeometry",
    "PHASES",
    "Phase",
    "PipelineSchedule",
    "PipelineRoute",
    "RankGrid",
    "SCHEDULERS",
    "SchedulerSpec",
    "TimedBlock",
    "Timeline",
    "build_schedule",
    "check_samples",
    "register_scheduler",
    "scheduler_spec",
    "simulate",
    "simulate_totals",
    "StepTotals",
]
