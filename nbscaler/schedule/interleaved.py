"""Interleaved 1F1B: each device holds several non-adjacent stages (Narayanan et al. 2021, the
schedule of Megatron-LM).

With ``p`` devices and ``v`` chunks per device the model is cut into ``v * p`` stages and device
``r`` holds stages ``r, r + p, r + 2p, ...``: a micro-batch goes round the devices ``v`` times.
Each stage is ``1/v`` of a device's share of the model, so the pipeline fills and drains in
``1/v`` of the time and the idle share drops from 1F1B's ``(p-1) / (m+p-1)`` to
``(p-1) / (v*m + p-1)``, for ``v`` times as many point-to-point messages.

Each device runs its *virtual* micro-batches (a micro-batch on one of its chunks) in groups of
``p``: micro-batches ``0..p-1`` on its first chunk, then the same ``p`` on its second chunk, and so
on, then the next ``p`` micro-batches. Backwards run the chunks in reverse. After a warm-up of
``2(p-r-1) + (v-1)p`` forwards, device ``r`` alternates one forward and one backward, then drains
its backwards (with one chunk that is exactly 1F1B). With ``p = 2, v = 2, m = 4`` (stages 0 and 2 on device 0, 1 and 3 on device 1;
``f2.1`` is the forward of micro-batch 2 on the device's second chunk)::

    f0.0 f1.0 f0.1 f1.1 f2.0 b0.1 f3.0 b1.1 f2.1 b0.0 f3.1 b1.0 b2.1 b3.1 b2.0 b3.0
         f0.0 f1.0 f0.1 b0.1 f1.1 b1.1 f2.0 b0.0 f3.0 b1.0 f2.1 b2.1 f3.1 b3.1 b2.0 b3.0

The groups of ``p`` are why ``nmicros`` must be a multiple of ``p``.

The ``p`` devices here are pipeline devices: with ``ComputeConfig.pipeline_virtual_stages=v`` a
unit of ``plan_ngpus`` plan devices has ``p = nstages / v`` of them, each a group of
``plan_ngpus / p`` plan devices over which ``hybrid`` splits its stages tensor-parallel (Megatron-LM's
virtual pipeline stages); without it ``p = plan_ngpus``.
"""

from __future__ import annotations

from typing import Optional

from nbscaler.schedule.block import Block
from nbscaler.schedule.pipeline import PipelineSchedule
from nbscaler.schedule.schedulers import register_scheduler


def _interleaved_rules(nstages: int, nmicros: int, ndevices: int) -> Optional[str]:
    if nmicros % ndevices:
        multiple = -(-nmicros // ndevices) * ndevices
        return (f"1f1b_interleaved runs the micro-batches in groups of the {ndevices} pipeline devices, so "
                f"pipeline_nmicros={nmicros} must be a multiple of {ndevices}: set pipeline_nmicros={multiple}.")
    return None


def _virtual_order(ndevices: int, chunks: int, nmicros: int, backward: bool) -> list[tuple[int, int]]:
    """``(chunk, micro)`` in the order a device runs its forwards (or backwards)."""
    order = []
    for k in range(chunks * nmicros):
        group, within = divmod(k, ndevices * chunks)
        chunk = within // ndevices
        order.append((chunks - 1 - chunk if backward else chunk, group * ndevices + within % ndevices))
    return order


def _warmup(rank: int, ndevices: int, chunks: int, nmicros: int) -> int:
    """The forwards device ``rank`` runs before its first backward: 1F1B's ``p - r - 1`` with one
    chunk; with more, Megatron-LM's count, or all of them when one group of ``p`` micro-batches
    leaves no steady state."""
    if chunks == 1:
        return ndevices - rank - 1
    if nmicros == ndevices:
        return chunks * nmicros
    return 2 * (ndevices - rank - 1) + (chunks - 1) * ndevices


@register_scheduler("1f1b_interleaved", stages_per_device=None, check=_interleaved_rules)
def one_f_one_b_interleaved(nstages: int, nmicros: int, ndevices: int) -> PipelineSchedule:
    """Interleaved 1F1B over ``ndevices`` devices, each holding ``nstages // ndevices`` chunks."""
    p, chunks = ndevices, nstages // ndevices
    device_blocks = []
    for r in range(p):
        forwards = [Block(c * p + r, m, "F") for c, m in _virtual_order(p, chunks, nmicros, backward=False)]
        backwards = [Block(c * p + r, m, "B") for c, m in _virtual_order(p, chunks, nmicros, backward=True)]
        warmup = min(_warmup(r, p, chunks, nmicros), len(forwards))
        blocks = forwards[:warmup]
        for k, forward in enumerate(forwards[warmup:]):
            blocks += [forward, backwards[k]]
        blocks += backwards[len(forwards) - warmup:]
        device_blocks.append(blocks)
    placement = tuple((s % p,) for s in range(nstages))
    return PipelineSchedule("1f1b_interleaved", nstages, nmicros, device_blocks, [placement], [0] * nmicros)
