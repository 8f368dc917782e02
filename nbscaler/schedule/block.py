"""One unit of pipeline work.

A training step of a pipelined model is made of small pieces of work: the forward of stage ``s``
on micro-batch ``m`` and, later, its backward. A :class:`Block` names one such piece and nothing
more. Zero-bubble schedules split the backward in two: ``B`` computes the gradient of the stage's
inputs (the next device waits for it) and ``W`` the gradients of the stage's weights (nobody waits
for it, so it can fill an idle slot later). *Where* it runs and *in which order* is the business of
:class:`~nbscaler.schedule.pipeline.PipelineSchedule`; *how long* it takes is the business of the
simulator or of the runtime's telemetry.

>>> Block(stage=1, micro=0, phase="F")
Block(stage=1, micro=0, phase='F')
>>> print(Block(2, 3, "B"))
B(s2,m3)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Phase = Literal["F", "B", "W"]
PHASES: tuple[Phase, ...] = ("F", "B", "W")
"""Forward; backward (the whole backward, or only the input gradients when the schedule has ``W``
blocks); weight gradients."""


def _is_index(value: object) -> bool:
    # bool is an int subclass, but True is never meant as stage 1.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True, slots=True)
class Block:
    """The ``phase`` (``'F'`` forward, ``'B'`` backward, ``'W'`` weight gradients) of pipeline stage
    ``stage`` on micro-batch ``micro``.

    Blocks are values: two blocks with the same fields are the same piece of work, so they can be
    dictionary keys (the simulator keys finish times by block).
    """

    stage: int
    micro: int
    phase: Phase

    def __post_init__(self) -> None:
        if not _is_index(self.stage):
            raise ValueError(f"Block.stage={self.stage!r} is invalid: use a stage index >= 0.")
        if not _is_index(self.micro):
            raise ValueError(f"Block.micro={self.micro!r} is invalid: use a micro-batch index >= 0.")
        if self.phase not in PHASES:
            raise ValueError(f"Block.phase={self.phase!r} is invalid: use 'F' (forward), 'B' (backward) or "
                             "'W' (weight gradients).")

    def __str__(self) -> str:
        return f"{self.phase}(s{self.stage},m{self.micro})"
