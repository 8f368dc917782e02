"""The built-in pipeline schedulers, registered by name.

Every scheduler is a function ``(nstages, nmicros) -> PipelineSchedule``; :func:`build_schedule`
checks the arguments and calls the one named. The charts in the docstrings show one row per
device, its blocks in run order; ``f3`` is the forward and ``b3`` the backward of micro-batch 3 on
that device's stage (the indentation hints at when each device can start).

How the orders are made
-----------------------
Each scheduler gives every block a *step* on one global clock and :func:`_order_by_step` sorts
each device's blocks by step. Every step is later than the steps of the blocks it depends on, so
running all blocks in step order is a valid execution; each device's list is a slice of that
order, hence no schedule built here can deadlock. The steps only fix the order: the real start
times come from the costs (see :func:`nbscaler.schedule.simulator.simulate`).

>>> print(build_schedule("1f1b", nstages=2, nmicros=3))
1f1b: 2 stages x 3 micro-batches on 2 devices
  device 0: F(s0,m0) F(s0,m1) B(s0,m0) F(s0,m2) B(s0,m1) B(s0,m2)
  device 1: F(s1,m0) B(s1,m0) F(s1,m1) B(s1,m1) F(s1,m2) B(s1,m2)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

from nbscaler.schedule.block import Block
from nbscaler.schedule.pipeline import PipelineSchedule, PipelineRoute

Scheduler = Callable[..., PipelineSchedule]
"""``(nstages, nmicros) -> PipelineSchedule``, or ``(nstages, nmicros, ndevices)`` for a scheduler
whose stages per device are not fixed."""
Check = Callable[[int, int, int], Optional[str]]
"""``(nstages, nmicros, ndevices) -> None``, or what is wrong and how to fix it."""


@dataclass(frozen=True)
class SchedulerSpec:
    """A registered scheduler and what it asks of its arguments.

    Attributes:
        name: the name it is registered under.
        build: the scheduler function.
        training: whether it schedules backwards (``infer_pipe`` does not).
        stages_per_device: how many stages each pipeline device holds (``nstages`` counts
            pipeline devices for ``1f1b_plus``, which adds a shared head stage); ``None`` when any
            number goes (``1f1b_interleaved``): the config's ``pipeline_virtual_stages`` where given
            (``nstages // virtual_stages`` pipeline devices, each tensor-parallel over
            ``plan_ngpus // devices`` plan devices), else every plan device is a pipeline device.
        check: the scheduler's own rules on ``(nstages, nmicros, ndevices)``.
        fixed_nstages: the only stage count it runs (``chimera_direct``: 4); ``None``: any.
        one_device_per_stage: whether each stage must run on one device alone, with no tensor
            parallelism inside it (``chimera_direct``).
        stage_copies: how many copies of each stage it holds (``chimera_direct``: 2, one per
            direction); the copies sum their gradients after the backward, like data-parallel
            replicas.
    """

    name: str
    build: Scheduler
    training: bool = True
    stages_per_device: Optional[int] = 1
    check: Optional[Check] = None
    fixed_nstages: Optional[int] = None
    one_device_per_stage: bool = False
    stage_copies: int = 1

    def per_device(self, virtual_stages: Optional[int] = None) -> Optional[int]:
        """The stages on each pipeline device: the scheduler's own number, else ``virtual_stages``
        (``ComputeConfig.pipeline_virtual_stages``), else ``None``: the stages spread over every plan
        device, one device a stage."""
        return self.stages_per_device if self.stages_per_device is not None else virtual_stages

    def default_nstages(self, plan_ngpus: int, virtual_stages: Optional[int] = None) -> int:
        """The stages when ``pipeline_nstages`` is not set: one per plan device, times its chunks
        (``virtual_stages`` for a scheduler whose chunks are free, two when that is not given)."""
        return plan_ngpus * (self.per_device(virtual_stages) or 2)

    def ndevices(self, nstages: int, plan_ngpus: int, virtual_stages: Optional[int] = None) -> int:
        """The pipeline devices ``nstages`` stages go on within ``plan_ngpus`` plan devices: ``nstages``
        over the stages each holds; every plan device when that is free and not given."""
        per = self.per_device(virtual_stages)
        return plan_ngpus if per is None else nstages // per

    def problem(self, nstages: int, nmicros: int, plan_ngpus: int,
                virtual_stages: Optional[int] = None) -> Optional[tuple[str, str]]:
        """``(field, what is wrong and the fix)`` when a config's pipeline does not suit this
        scheduler, else ``None``. ``ComputeConfig`` asks this; so does :func:`build_schedule`.
        ``virtual_stages``: the stages on each pipeline device the config asks for
        (``pipeline_virtual_stages``), ``None`` when it leaves them to the scheduler."""
        fixed = self.stages_per_device
        if virtual_stages is not None and fixed is not None and virtual_stages != fixed:
            return "pipeline_virtual_stages", (f"{self.name} puts {fixed} stage{'s' if fixed > 1 else ''} on each "
                                               f"pipeline device, so leave pipeline_virtual_stages unset (or give "
                                               f"{fixed}); 1f1b_interleaved takes any number.")
        if virtual_stages is not None and fixed is None:
            return self._virtual_problem(nstages, nmicros, plan_ngpus, virtual_stages)
        per = fixed
        if per is not None and nstages % per:
            return "pipeline_nstages", (f"{self.name} puts {per} stages on each device, so pipeline_nstages="
                                        f"{nstages} must be a multiple of {per}.")
        ndevices = self.ndevices(nstages, plan_ngpus)
        if per is None and nstages % plan_ngpus:
            return "pipeline_nstages", (f"{self.name} gives each of the plan_ngpus={plan_ngpus} devices the same "
                                        f"number of stages, so pipeline_nstages={nstages} must be a multiple "
                                        f"of {plan_ngpus} (or set pipeline_virtual_stages, the stages on each "
                                        "pipeline device, for fewer pipeline devices with tensor parallelism "
                                        "inside each stage).")
        if plan_ngpus % ndevices:
            return "pipeline_nstages", (f"{self.name} puts pipeline_nstages={nstages} stages on {ndevices} "
                                        f"pipeline devices, which must divide plan_ngpus={plan_ngpus} (each "
                                        "stage gets plan_ngpus // devices devices).")
        return self._rules_problem(nstages, nmicros, ndevices)

    def _virtual_problem(self, nstages: int, nmicros: int, plan_ngpus: int,
                         virtual: int) -> Optional[tuple[str, str]]:
        """:meth:`problem` where the config gives the stages on each pipeline device of a scheduler
        that takes any number: ``nstages // virtual`` pipeline devices, each a group of
        ``plan_ngpus // devices`` plan devices."""
        ndevices = nstages // virtual if nstages % virtual == 0 else None
        if ndevices is None or plan_ngpus % ndevices:
            fits = [v for v in range(1, nstages + 1) if nstages % v == 0 and plan_ngpus % (nstages // v) == 0]
            where = (f"{nstages} is not a multiple of {virtual}" if ndevices is None else
                     f"its {ndevices} pipeline devices do not divide plan_ngpus={plan_ngpus}")
            fix = (f"give one of {', '.join(map(str, fits))} (for "
                   f"{', '.join(str(nstages // v) for v in fits)} pipeline devices, each tensor-parallel over "
                   f"{', '.join(str(plan_ngpus * v // nstages) for v in fits)} plan devices)" if fits else f"set pipeline_nstages to a multiple of {virtual} whose quotient "
                   f"divides plan_ngpus={plan_ngpus}")
            return "pipeline_virtual_stages", (f"{self.name} puts pipeline_virtual_stages={virtual} stages on each "
                                               f"pipeline device, and pipeline_nstages={nstages} stages so placed "
                                               f"make no pipeline here: {where}; {fix}.")
        return self._rules_problem(nstages, nmicros, ndevices)

    def _rules_problem(self, nstages: int, nmicros: int, ndevices: int) -> Optional[tuple[str, str]]:
        problem = self._fixed_nstages_problem(nstages)
        if problem is None and self.check is not None:
            problem = self.check(nstages, nmicros, ndevices)
        return None if problem is None else ("pipeline_scheduler", problem)

    def _fixed_nstages_problem(self, nstages: int) -> Optional[str]:
        fixed = self.fixed_nstages
        if fixed is None or nstages == fixed:
            return None
        return (f"{self.name} runs exactly {fixed} stages, not pipeline_nstages={nstages}: "
                f"set pipeline_nstages={fixed}, or use 1f1b or gpipe.")

    def make(self, nstages: int, nmicros: int, ndevices: int) -> PipelineSchedule:
        if self.stages_per_device is None:
            return self.build(nstages, nmicros, ndevices)
        return self.build(nstages, nmicros)


SCHEDULERS: dict[str, SchedulerSpec] = {}


def register_scheduler(name: str, training: bool = True, stages_per_device: Optional[int] = 1,
                       check: Optional[Check] = None, **rules: Any) -> Callable[[Scheduler], Scheduler]:
    """Make a scheduler available to :func:`build_schedule` under ``name``, with its rules (see
    :class:`SchedulerSpec`; ``rules`` are its other fields, such as ``fixed_nstages``), which
    ``ComputeConfig``, autodist and the executor ask instead of knowing the scheduler by name."""

    def register(scheduler: Scheduler) -> Scheduler:
        SCHEDULERS[name] = SchedulerSpec(name, scheduler, training, stages_per_device, check, **rules)
        return scheduler

    return register


def scheduler_spec(name: str) -> SchedulerSpec:
    """The registered scheduler ``name``; ``ValueError`` naming the known ones otherwise."""
    if name not in SCHEDULERS:
        raise ValueError(f"unknown pipeline scheduler {name!r}: use one of {', '.join(SCHEDULERS)}.")
    return SCHEDULERS[name]


def build_schedule(name: str, nstages: int, nmicros: int, ndevices: Optional[int] = None) -> PipelineSchedule:
    """The schedule of scheduler ``name`` for ``nstages`` stages and ``nmicros`` micro-batches.

    ``ndevices`` (the pipeline devices) is needed only by schedulers whose stages per device are
    free (``1f1b_interleaved``); the others derive it from ``nstages``. Raises ``ValueError`` naming
    the bad value and the fix, before anything runs.

    >>> build_schedule("gpipe", nstages=4, nmicros=8).blocks_of(0)[:2]
    (Block(stage=0, micro=0, phase='F'), Block(stage=0, micro=1, phase='F'))
    """
    spec = scheduler_spec(name)
    for arg, value in (("nstages", nstages), ("nmicros", nmicros)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: {arg}={value!r} is invalid; it must be an integer >= 1.")
    if ndevices is None:
        if spec.stages_per_device is None:
            raise ValueError(f"{name} puts any number of stages on a device: give ndevices, the pipeline "
                             "devices the stages are spread over.")
        ndevices = nstages // spec.stages_per_device
    problem = spec.problem(nstages, nmicros, plan_ngpus=ndevices)   # one plan device per pipeline device
    if problem is not None:
        raise ValueError(problem[1])
    return _made(spec, nstages, nmicros, ndevices)


@functools.lru_cache(maxsize=1024)
def _made(spec: SchedulerSpec, nstages: int, nmicros: int, ndevices: int) -> PipelineSchedule:
    """``spec.make``, once per arguments: a schedule is immutable, and a sweep asks for the same
    few (each layout, each micro-batch count) once per configuration and again per target."""
    return spec.make(nstages, nmicros, ndevices)


# -- shared pieces ---------------------------------------------------------------------------------
def _line(nstages: int) -> PipelineRoute:
    """The ordinary pipeline: stage ``s`` on device ``s``."""
    return tuple((s,) for s in range(nstages))


def _order_by_step(name: str, nstages: int, nmicros: int, ndevices: int, placements: list[PipelineRoute],
                   pipeline_of_micro: list[int], steps: dict[Block, float]) -> PipelineSchedule:
    """The schedule in which every device runs its blocks in the order of ``steps``.

    One global sort, then a split by device: blocks with equal steps keep the same relative order
    on every device that shares them.
    """
    device_blocks: list[list[Block]] = [[] for _ in range(ndevices)]
    for block in sorted(steps, key=steps.__getitem__):
        for device in placements[pipeline_of_micro[block.micro]][block.stage]:
            device_blocks[device].append(block)
    return PipelineSchedule(name, nstages, nmicros, device_blocks, placements, pipeline_of_micro)


def _one_f_one_b_steps(position: int, local_micro: int, nstages: int) -> tuple[int, int]:
    """The (forward, backward) steps of 1F1B for stage ``position`` and the ``local_micro``-th micro-batch.

    Stage ``s`` starts at step ``s`` and then alternates a forward step and a backward step; its
    backward of micro-batch ``j`` sits ``nstages-1-s`` pairs after its forward, the time the
    forward takes to reach the last stage and the gradient to come back.
    """
    forward = position + 2 * local_micro
    backward = 2 * local_micro + 2 * nstages - 1 - position
    return forward, backward


# -- the schedulers ----------------------------------------------------------------------------------
@register_scheduler("1f1b")
def one_f_one_b(nstages: int, nmicros: int) -> PipelineSchedule:
    """1F1B: after a short warm-up of forwards, each device alternates one forward and one backward.

    ::

        f0 f1 f2 f3 b0 b1 b2 b3
           f0 f1 f2 b0 f3 b1 b2 b3
              f0 f1 b0 f2 b1 f3 b2 b3
                 f0 b0 f1 b1 f2 b2 f3 b3

    Stage ``s`` runs ``nstages - s`` forwards before its first backward, so it holds the
    activations of at most that many micro-batches, however large ``nmicros`` is. The idle share
    is the same as GPipe's, ``(p-1) / (m+p-1)``; 1F1B saves memory, not time.
    """
    steps: dict[Block, float] = {}
    for s in range(nstages):
        for m in range(nmicros):
            steps[Block(s, m, "F")], steps[Block(s, m, "B")] = _one_f_one_b_steps(s, m, nstages)
    return _order_by_step("1f1b", nstages, nmicros, nstages, [_line(nstages)], [0] * nmicros, steps)


@register_scheduler("1f1b_plus")
def one_f_one_b_plus(nstages: int, nmicros: int) -> PipelineSchedule:
    """1F1B plus a head stage that every device runs together, sharded (tensor-parallel) over all of them.

    Some layers are poor pipeline stages: an embedding table is large in memory but cheap to run,
    and giving it a device of its own wastes that device. ``1f1b_plus`` shards such a layer over
    all the pipeline devices instead and runs the rest as an ordinary 1F1B pipeline.

    The schedule therefore has ``nstages + 1`` stages on ``nstages`` devices: stage 0 is the
    shared head, held by every device, and pipeline stage ``k`` (``1 .. nstages``) is on device
    ``k - 1``. The head's forward of micro-batch ``m`` runs on all devices just before stage 1
    starts ``m``, and its backward just after stage 1 finishes the backward of ``m``; the devices
    run the head's blocks together, so each of them is also a synchronisation point. The run order
    of each device, ``H``/``h`` marking the head's forward/backward::

        H0 f0 H1 f1 H2 f2 H3 f3 b0 h0 b1 h1 b2 h2 b3 h3
        H0 f0 H1 f1 H2 f2 H3 b0 f3 h0 b1 h1 b2 h2 b3 h3
        H0 H1 f0 H2 f1 b0 H3 f2 b1 h0 f3 b2 h1 b3 h2 h3
        H0 H1 f0 H2 b0 f1 H3 b1 f2 h0 b2 f3 h1 b3 h2 h3
    """
    devices = nstages
    head = tuple(range(devices))
    placement = (head,) + _line(devices)
    steps: dict[Block, float] = {}
    for k in range(devices):
        for m in range(nmicros):
            steps[Block(k + 1, m, "F")], steps[Block(k + 1, m, "B")] = _one_f_one_b_steps(k, m, devices)
    for m in range(nmicros):
        # Half a step either side: right before stage 1 takes the micro-batch, right after it hands it back.
        steps[Block(0, m, "F")] = steps[Block(1, m, "F")] - 0.5
        steps[Block(0, m, "B")] = steps[Block(1, m, "B")] + 0.5
    return _order_by_step("1f1b_plus", nstages + 1, nmicros, devices, [placement], [0] * nmicros, steps)


@register_scheduler("gpipe")
def gpipe(nstages: int, nmicros: int) -> PipelineSchedule:
    """GPipe: all forwards, then all backwards.

    ::

        f0 f1 f2 f3                   b0 b1 b2 b3
           f0 f1 f2 f3             b0 b1 b2 b3
              f0 f1 f2 f3       b0 b1 b2 b3
                 f0 f1 f2 f3 b0 b1 b2 b3

    Simple, but every device keeps the activations of all ``nmicros`` micro-batches until the
    backwards start. With forward cost F, backward cost B and equal stages the step takes
    ``(nmicros + nstages - 1) * (F + B)``, so the idle share is ``(p-1) / (m+p-1)``.
    """
    steps: dict[Block, float] = {}
    backwards_start = nmicros + nstages - 1
    for s in range(nstages):
        for m in range(nmicros):
            steps[Block(s, m, "F")] = s + m
            steps[Block(s, m, "B")] = backwards_start + (nstages - 1 - s) + m
    return _order_by_step("gpipe", nstages, nmicros, nstages, [_line(nstages)], [0] * nmicros, steps)


CHIMERA_STAGES = 4


def _chimera_rules(nstages: int, nmicros: int, ndevices: int) -> Optional[str]:
    if nmicros % 2:
        return (f"chimera_direct needs an even number of micro-batches, half per direction, not "
                f"pipeline_nmicros={nmicros}: set pipeline_nmicros={nmicros + 1}.")
    return None


@register_scheduler("chimera_direct", check=_chimera_rules, fixed_nstages=CHIMERA_STAGES,
                    one_device_per_stage=True, stage_copies=2)
def chimera_direct(nstages: int, nmicros: int) -> PipelineSchedule:
    """Chimera: two 4-stage pipelines in opposite directions over the same 4 devices.

    The *down* pipeline puts stage ``s`` on device ``s``; the *up* pipeline puts it on device
    ``3 - s``. Even micro-batches go down, odd ones go up. Each device holds two stages (device 0
    holds stage 0 of the down pipeline and stage 3 of the up pipeline), so the four devices hold two
    copies of the model, and the two copies of each stage sum their gradients like data-parallel
    replicas. While one pipeline fills or drains on a device, the other one uses it,
    which fills most of 1F1B's warm-up and cool-down bubbles.

    The micro-batches are taken four at a time (two per direction), each group scheduled as two
    interleaved 1F1B pipelines; the groups are then run one after the other. That is the *direct*
    concatenation of the Chimera paper: simple, at the price of a bubble between groups.
    One group, micro-batches 0 and 2 going down, 1 and 3 going up::

        f0    f2 f1 b1 f3 b3 b0    b2
           f0 f1 f2 f3 b1 b0 b3 b2
           f1 f0 f3 f2 b0 b1 b2 b3
        f1    f3 f0 b0 f2 b2 b1    b3

    With equal stages and a backward twice the forward, one group idles a quarter of the device
    time, where 1F1B on four micro-batches idles three sevenths.
    """
    down = _line(nstages)
    up = tuple(reversed(down))
    per_group = CHIMERA_STAGES // 2  # micro-batches per direction in one group
    steps: dict[Block, float] = {}
    group_start = 0
    for first in range(0, nmicros, 2 * per_group):
        group = range(first, min(first + 2 * per_group, nmicros))
        for m in group:
            local = (m - first) // 2
            for s in range(nstages):
                forward, backward = _one_f_one_b_steps(s, local, nstages)
                steps[Block(s, m, "F")] = group_start + forward
                steps[Block(s, m, "B")] = group_start + backward
        group_start = max(steps[Block(0, m, "B")] for m in group) + 1
    return _order_by_step("chimera_direct", nstages, nmicros, nstages, [down, up],
                          [m % 2 for m in range(nmicros)], steps)


@register_scheduler("infer_pipe", training=False)
def infer_pipe(nstages: int, nmicros: int) -> PipelineSchedule:
    """Inference: forwards only, each stage passing micro-batch ``m`` on as soon as it is done.

    ::

        f0 f1 f2 f3
           f0 f1 f2 f3
              f0 f1 f2 f3
                 f0 f1 f2 f3
    """
    steps: dict[Block, float] = {Block(s, m, "F"): s + m for s in range(nstages) for m in range(nmicros)}
    return _order_by_step("infer_pipe", nstages, nmicros, nstages, [_line(nstages)], [0] * nmicros, steps)
