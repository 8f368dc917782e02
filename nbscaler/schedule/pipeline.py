"""A pipeline schedule: which blocks each device runs, and in which order.

A :class:`PipelineSchedule` is plain data. It answers three questions, for three readers:

- *What does device* ``d`` *run, in order?* :meth:`~PipelineSchedule.blocks_of` (the executor).
- *Which stages live on device* ``d``? :meth:`~PipelineSchedule.stages_of` (code generation).
- *Where does stage* ``s`` *of micro-batch* ``m`` *run?* :meth:`~PipelineSchedule.devices_of`
  (the executor, to know whom to send to and receive from; the simulator).

Devices here are *pipeline devices*, numbered ``0 .. ndevices-1`` within one copy of the model.
Each runtime rank plays one of them; with tensor parallelism inside a stage several ranks play the
same device and run the same blocks.

Pipelines
---------
A micro-batch travels through the stages along one *pipeline*: a :data:`PipelineRoute` that gives,
for every stage, the devices that run it. Most schedules have one pipeline, stage ``s`` on device
``s``. Bidirectional schedules (``chimera_direct``) have two, running in opposite directions over
the same devices, and every micro-batch is given to one of them (``pipeline_of_micro``). A stage
that a route puts on several devices is sharded over them: its blocks appear in the order of
every one of those devices and are run by all of them together (``1f1b_plus`` uses this).

>>> one_device = PipelineSchedule(
...     name="by-hand", nstages=1, nmicros=2,
...     device_blocks=[[Block(0, 0, "F"), Block(0, 0, "B"), Block(0, 1, "F"), Block(0, 1, "B")]],
...     placements=[[[0]]], pipeline_of_micro=[0, 0])
>>> one_device.ndevices, one_device.is_training, one_device.stages_of(0)
(1, True, (0,))
>>> print(one_device)
by-hand: 1 stages x 2 micro-batches on 1 devices
  device 0: F(s0,m0) B(s0,m0) F(s0,m1) B(s0,m1)

A schedule checks itself when it is built, so a hand-made one that loses a block, runs one twice,
puts one on the wrong device, or runs a backward before its forward fails at once with a
``ValueError`` naming the block.
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator

from nbscaler.schedule.block import Block

PipelineRoute = tuple[tuple[int, ...], ...]
"""The devices a micro-batch passes through, stage by stage: ``route[stage]`` are the devices
that run ``stage`` (more than one for a sharded stage)."""


@dataclass(frozen=True)
class PipelineSchedule:
    """The ordered blocks of every pipeline device, and where each stage lives.

    Attributes:
        name: the scheduler that made it, e.g. ``'1f1b'``.
        nstages: number of stages; blocks use stage indices ``0 .. nstages-1`` in data-flow order.
        nmicros: micro-batches per step; blocks use indices ``0 .. nmicros-1``.
        device_blocks: ``device_blocks[d]`` is what device ``d`` runs, in order.
        placements: the pipelines; ``placements[k][stage]`` lists the devices of ``stage`` in
            pipeline ``k``.
        pipeline_of_micro: ``pipeline_of_micro[m]`` is the pipeline micro-batch ``m`` goes through.

    Any list given is stored as a tuple, so a schedule is immutable and hashable.
    """

    name: str
    nstages: int
    nmicros: int
    device_blocks: tuple[tuple[Block, ...], ...]
    placements: tuple[PipelineRoute, ...]
    pipeline_of_micro: tuple[int, ...]

    def __post_init__(self) -> None:
        freeze = object.__setattr__  # a frozen dataclass normalising its own fields
        freeze(self, "device_blocks", tuple(tuple(blocks) for blocks in self.device_blocks))
        freeze(self, "placements", tuple(tuple(tuple(devs) for devs in p) for p in self.placements))
        freeze(self, "pipeline_of_micro", tuple(self.pipeline_of_micro))
        self._check_placements()
        self._check_blocks()

    def __hash__(self) -> int:
        # schedules key the simulator's and the sweep's caches, asked thousands of times a sweep:
        # hashed once (the fields never change)
        if "_hash" not in self.__dict__:
            object.__setattr__(self, "_hash", hash((self.name, self.nstages, self.nmicros, self.device_blocks,
                                                   self.placements, self.pipeline_of_micro)))
        return self.__dict__["_hash"]

    # -- what the executor and code generation ask -------------------------------------------
    @property
    def ndevices(self) -> int:
        return len(self.device_blocks)

    @property
    def is_training(self) -> bool:
        """Whether the schedule has backward blocks (inference schedules run forwards only)."""
        return any(block.phase == "B" for _, block in self)

    @functools.cached_property              # asked per device of every configuration a sweep prices
    def splits_backward(self) -> bool:
        """Whether the backward is split into ``B`` (input gradients) and ``W`` (weight gradients)."""
        return any(block.phase == "W" for _, block in self)

    @property
    def release_phase(self) -> str:
        """The phase whose block frees what its stage's forward saved: ``W`` when the backward is
        split (``B`` keeps the graph for ``W``, less the ops that feed no weight), else ``B``."""
        return "W" if self.splits_backward else "B"

    def blocks_of(self, device: int) -> tuple[Block, ...]:
        """The blocks device ``device`` runs, in the order it must run them."""
        return self.device_blocks[device]

    def stages_of(self, device: int) -> tuple[int, ...]:
        """The stages whose code and weights device ``device`` holds, in increasing order."""
        return tuple(sorted({s for p in self.placements for s, devs in enumerate(p) if device in devs}))

    def devices_of(self, stage: int, micro: int) -> tuple[int, ...]:
        """The devices that run ``stage`` for micro-batch ``micro``."""
        return self.placements[self.pipeline_of_micro[micro]][stage]

    def dependencies(self, block: Block) -> tuple[Block, ...]:
        """The blocks whose results ``block`` consumes.

        A forward needs the activations of the previous stage. A backward needs the gradient from
        the next stage and the activations its own forward saved; the last stage starts the
        backward from its own forward (the loss). A weight-gradient block needs its backward's
        output gradients, which that backward leaves behind.

        >>> s = build_schedule("gpipe", nstages=3, nmicros=1)
        >>> [str(b) for b in s.dependencies(Block(1, 0, "B"))]
        ['F(s1,m0)', 'B(s2,m0)']
        """
        if block.phase == "F":
            return (Block(block.stage - 1, block.micro, "F"),) if block.stage > 0 else ()
        if block.phase == "W":
            return (Block(block.stage, block.micro, "B"),)
        own_forward = Block(block.stage, block.micro, "F")
        if block.stage == self.nstages - 1:
            return (own_forward,)
        return own_forward, Block(block.stage + 1, block.micro, "B")

    def __iter__(self) -> Iterator[tuple[int, Block]]:
        """``(device, block)`` pairs, device by device, each device in its run order."""
        for device, blocks in enumerate(self.device_blocks):
            for block in blocks:
                yield device, block

    def forward_only(self) -> "PipelineSchedule":
        """The same placement and order with the backward blocks dropped: inference on a layout
        built for training.

        >>> print(build_schedule("1f1b", nstages=2, nmicros=2).forward_only())
        1f1b: 2 stages x 2 micro-batches on 2 devices
          device 0: F(s0,m0) F(s0,m1)
          device 1: F(s1,m0) F(s1,m1)
        """
        blocks = [[b for b in device if b.phase == "F"] for device in self.device_blocks]  # no B, no W
        return PipelineSchedule(self.name, self.nstages, self.nmicros, blocks, self.placements,
                                self.pipeline_of_micro)

    # -- plain data ----------------------------------------------------------------------------
    def to_rows(self) -> list[dict[str, Any]]:
        """One dict per (device, block), ready for ``pandas.DataFrame(schedule.to_rows())``.

        ``order`` is the block's position in its device's list.
        """
        return [
            {"device": device, "order": order, "stage": b.stage, "micro": b.micro, "phase": b.phase}
            for device, blocks in enumerate(self.device_blocks)
            for order, b in enumerate(blocks)
        ]

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict that :meth:`from_dict` turns back into an equal schedule."""
        return {
            "name": self.name,
            "nstages": self.nstages,
            "nmicros": self.nmicros,
            "device_blocks": [[[b.stage, b.micro, b.phase] for b in blocks] for blocks in self.device_blocks],
            "placements": [[list(devs) for devs in p] for p in self.placements],
            "pipeline_of_micro": list(self.pipeline_of_micro),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PipelineSchedule":
        blocks = [[Block(*fields) for fields in device] for device in data["device_blocks"]]
        return cls(data["name"], data["nstages"], data["nmicros"], blocks,
                   data["placements"], data["pipeline_of_micro"])

    def __str__(self) -> str:
        lines = [f"{self.name}: {self.nstages} stages x {self.nmicros} micro-batches on {self.ndevices} devices"]
        lines += [f"  device {d}: " + " ".join(map(str, blocks)) for d, blocks in enumerate(self.device_blocks)]
        return "\n".join(lines)

    # -- self-checks ---------------------------------------------------------------------------
    def _fail(self, problem: str) -> None:
        raise ValueError(f"pipeline schedule {self.name!r} is invalid: {problem}")

    def _check_placements(self) -> None:
        for field_name in ("nstages", "nmicros"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                self._fail(f"{field_name}={value!r}; it must be a positive integer.")
        if not self.device_blocks:
            self._fail("it has no devices; give device_blocks one list per pipeline device.")
        for k, placement in enumerate(self.placements):
            if len(placement) != self.nstages:
                self._fail(f"placements[{k}] places {len(placement)} stages; it must place all {self.nstages}.")
            for stage, devices in enumerate(placement):
                if not devices or any(d not in range(self.ndevices) for d in devices):
                    self._fail(f"placements[{k}][{stage}]={devices!r}; use devices in 0..{self.ndevices - 1}.")
        if len(self.pipeline_of_micro) != self.nmicros:
            self._fail(f"pipeline_of_micro has {len(self.pipeline_of_micro)} entries; "
                       f"it needs one per micro-batch ({self.nmicros}).")
        for m, k in enumerate(self.pipeline_of_micro):
            if k not in range(len(self.placements)):
                self._fail(f"pipeline_of_micro[{m}]={k!r}; use a pipeline in 0..{len(self.placements) - 1}.")

    def _check_blocks(self) -> None:
        if not self._blocks_as_placed():
            self._explain_blocks()
        if self.is_training:
            self._check_order()

    def _blocks_as_placed(self) -> bool:
        """Whether each device runs exactly the blocks its placements give it, each once: the one
        check of every block a sweep's many schedules pay; ``_explain_blocks`` says what is wrong."""
        phases = ("F", "B", "W")[:1 + self.is_training + self.splits_backward]
        expected: list[set] = [set() for _ in self.device_blocks]
        for micro in range(self.nmicros):
            for stage in range(self.nstages):
                for device in self.devices_of(stage, micro):
                    if device >= len(expected):
                        return False
                    expected[device].update(Block(stage, micro, phase) for phase in phases)
        return all(len(blocks) == len(want) and set(blocks) == want
                   for blocks, want in zip(self.device_blocks, expected))

    def _explain_blocks(self) -> None:
        runs = Counter()  # (device, block) -> how often it appears
        for device, block in self:
            if block.stage >= self.nstages or block.micro >= self.nmicros:
                self._fail(f"{block} on device {device} is out of range "
                           f"({self.nstages} stages, {self.nmicros} micro-batches).")
            if device not in self.devices_of(block.stage, block.micro):
                self._fail(f"{block} is on device {device}, but its pipeline places stage {block.stage} "
                           f"on devices {self.devices_of(block.stage, block.micro)}.")
            runs[device, block] += 1
        phases = ("F", "B", "W")[:1 + self.is_training + self.splits_backward]
        for micro in range(self.nmicros):
            for stage in range(self.nstages):
                for phase in phases:
                    block = Block(stage, micro, phase)
                    for device in self.devices_of(stage, micro):
                        if runs[device, block] != 1:
                            self._fail(f"device {device} runs {block} {runs[device, block]} times; "
                                       "every block must run exactly once on each of its devices.")

    def _check_order(self) -> None:
        """Every backward after its forward, every weight-gradient block after its backward."""
        for device, blocks in enumerate(self.device_blocks):
            position = {block: i for i, block in enumerate(blocks)}
            for block in blocks:
                if block.phase == "B" and position[block] < position[Block(block.stage, block.micro, "F")]:
                    self._fail(f"device {device} runs {block} before its forward; "
                               "a backward needs the activations its forward saves.")
                if block.phase == "W" and position[block] < position[Block(block.stage, block.micro, "B")]:
                    self._fail(f"device {device} runs {block} before its backward; "
                               "the weight gradients need the output gradients the backward receives.")


def check_samples(schedule: PipelineSchedule, nsamples: int) -> None:
    """Fail before a step runs when the number of samples does not match the schedule.

    A pipelined ``train_step``/``infer_step`` takes one sample per micro-batch.

    >>> check_samples(build_schedule("1f1b", nstages=2, nmicros=4), 3)
    Traceback (most recent call last):
    ...
    ValueError: got 3 samples, but the '1f1b' schedule runs pipeline_nmicros=4 micro-batches per step: pass exactly 4 samples, or build the module with pipeline_nmicros=3.
    """
    if nsamples != schedule.nmicros:
        rebuild = f", or build the module with pipeline_nmicros={nsamples}" if nsamples >= 1 else ""
        raise ValueError(
            f"got {nsamples} samples, but the {schedule.name!r} schedule runs pipeline_nmicros="
            f"{schedule.nmicros} micro-batches per step: pass exactly {schedule.nmicros} samples{rebuild}."
        )
