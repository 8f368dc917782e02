"""The time model: how long one training step takes on each rank, and the pipeline timeline.

The pieces, each measured or modelled once:

- **ops**: the time of each op at the local shapes the rank runs it with, from a one-off profile on
  this device (``cost.profile``, cached on disk);
- **collectives**: an alpha-beta model (``cost.comm_model``), calibrated on a process group or
  left at its defaults;
- **a section** (a whole forward, or one pipeline stage): the sum of its ops and collectives,
  forward and backward, the autograd engine's start-up once per backward; a recomputed region's
  forward is counted again in the backward;
- **the step**: without a pipeline, ``nsamples`` forwards and backwards one after the other; with
  one, the schedule simulator (``nbscaler.schedule.simulate``) plays the stage times, with a
  send/recv between devices as latency, and the time each side spends starting it; then the
  gradient synchronisation (all-reduce, or ZeRO's reduce-scatter and all-gather, per bucket) and
  the optimizer step (profiled, with the reducer's copies);
- **context parallelism**: a ring attention's passes are priced as the all-gathers that move their
  bytes and drawn on the timeline beside its blocks (``cost.context_calls``); the forward's passes
  overlap the attention's compute, so only what ``(n-1)/n`` of it does not cover adds to the
  block, and the backward's likewise but for its last pass, home (``ring_exposed``); all-gathered
  keys and values are a section's collectives like any other;
- **ZeRO stage 3**: each unit's all-gathers and reduce-scatter run inside the blocks, as FSDP
  prefetches them (``cost.fsdp``): a block lasts its compute plus what it waits for them, which
  the simulator plays per block; there is no synchronisation per bucket after the backward and no
  all-gather after the optimizer step.

Op times are read at the speed the ranks last measured side by side (``cost.speed``), so a
profile from a quieter minute, or from one process alone, is scaled to the machine as it runs them.

On a target (``StepModel(hardware=...)``), ops take their roofline time (``cost.roofline``) and
collectives NCCL's ring/tree cost on the link their group spans (``cost.nccl``): nothing runs on
this machine. What overlaps there: a tensor-parallel collective waits for the op before it and
blocks the one after, so it sits on the critical path, forward and backward; a pipeline's sends
overlap the next block except their latency; the data-parallel gradient reduction runs bucket by
bucket during the backward's last block, as DDP does, and only its first bucket (the gradients the
backward produces last) and what exceeds that block's time add to the step; on a target whose
software waits for the backward to end (``Software(overlap_grad_reduce=False)``, Megatron-LM before
2023) all of it does. Gradients are reduced in the recipe's reduce dtype (``nbscaler.Recipe``).

What limits it: Python overhead between ops and the pipeline executor's bookkeeping (beyond
starting its sends and receives) are not counted; ranks are assumed in step (none waits at a
collective for a slower peer); with more ranks than cores, the calibration sees every rank busy at
once, which a pipeline's ranks are not.

The pass ``annotate_times`` writes ``node.meta['local_time_fwd_s']`` and ``['local_time_bwd_s']``,
per device, as the memory model writes ``local_saved_bytes``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import pandas as pd
import torch

from nbscaler.columns import SummaryColumn as C, UnitColumn as U
from nbscaler.comm.placed import PlacedGraphs
from nbscaler.comm.stages import stage_carries
from nbscaler.config import ComputeConfig, threads_per_rank
from nbscaler.recipe import Float8Scaling, Recipe
from nbscaler.cost import comm_model
from nbscaler.cost.comm_model import CommModel
from nbscaler.cost.hardware import Hardware
from nbscaler.cost.fsdp import (DeviceUnits, Played, Script, block_extras, block_plays, section_script, stage_plays,
                                unit_bytes, unit_seconds)
from nbscaler.cost.context_calls import ContextCall, rings_seconds, section_calls, timeline_calls
from nbscaler.cost.expert_calls import expert_section_calls
from nbscaler.cost.local import LocalRun
from nbscaler.cost.memory import DeviceRuns, ProgramOf, buckets, stage_runs
from nbscaler.comm.lower import lower_device
from nbscaler.cost.nccl import NcclModel
from nbscaler.layouts import Backend, Collective
from nbscaler.cost.profile import OpProfiler
from nbscaler.cost.ranks import LocalWeight, local_weights, train_graph
from nbscaler.cost.roofline import RooflineOps
from nbscaler.cost.step_figures import DeviceStep, PipelineParts, overlap_window, overlaps_communication
from nbscaler.schedule import Block, CollectiveBlock, TimedBlock, Timeline, simulate, simulate_totals

_PROFILERS: Dict[str, OpProfiler] = {}


def default_profiler(threads: Optional[int] = None, ranks: int = 1,
                     device: Optional[torch.device] = None) -> OpProfiler:
    """One profiler per device (and CPU thread count) and number of ranks for the process, so its
    table is read from disk once; each call reads the ranks' latest speed calibration. ``device``:
    where the ops are timed (default: a GPU where there is one, else the CPU)."""
    probe = OpProfiler(device=device, threads=threads, ranks=ranks)
    profiler = _PROFILERS.setdefault(f"{probe.path}|{ranks}", probe)
    profiler.refresh_speed()
    return profiler


def profiler_for(cfg: ComputeConfig) -> OpProfiler:
    """The profiler that times ops as the ranks of ``cfg`` will run them: on a CPU, with the share
    of this host's cores each rank gets (``threads_per_rank``; all ranks on this host, the notebook
    case), read at the speed those ranks last measured side by side. A plan made in a notebook of
    16 cores for 4 ranks is timed at 4 threads, not 16. Ops are timed on the device the ranks
    compute on (``comm_model.local_choice``): the CPU where they run gloo, though a GPU is there."""
    device = comm_model.local_choice(cfg.runtime_ngpus).device(0)
    return default_profiler(threads_per_rank(os.cpu_count() or 1, cfg.runtime_ngpus), cfg.runtime_ngpus, device)


Products = Tuple[Optional[Float8Scaling], Tuple[str, ...]]


def products_of(recipe: Optional[Recipe]) -> Products:
    """What of a recipe changes how long ops take: its fp8 products (``Recipe.float8`` and
    ``float8_skip``); the rest of it changes only the reduction and the update."""
    return (recipe.float8, recipe.float8_skip) if recipe is not None else (None, ())


def target_models(hardware: Hardware, recipe: Optional[Recipe] = None) -> Tuple[RooflineOps, NcclModel]:
    """How a target prices a step's pieces: each op at its roofline time (``cost.roofline``, its
    linear layers' products in fp8 where ``recipe`` says), each collective at NCCL's cost on the
    links its group spans (``cost.nccl``)."""
    return RooflineOps(hardware, *products_of(recipe)), NcclModel(hardware)


def backend_on(hardware: Optional[Hardware], runtime_ngpus: Optional[int] = None) -> Backend:
    """The backend whose collectives are priced on ``hardware``: nccl on a target, on this machine
    (``None`` or ``Hardware.local()``) the one ``runtime_ngpus`` ranks of it run
    (``comm_model.local_backend``)."""
    if hardware is not None and not hardware.is_local:
        return Backend.NCCL
    return comm_model.local_backend(runtime_ngpus)


def collective_time(run: LocalRun, comm: CommModel, profiler: OpProfiler) -> Tuple[float, float]:
    """Forward and backward seconds of one section's collectives (the tensor-parallel ones: a
    section's collectives are its ops' layout changes, and the exposed part of its context-parallel
    rings), a recomputed one's forward again in the backward: the part of ``section_time`` a step
    spends in them."""
    fwd, bwd = rings_seconds(run, comm, profiler.time)      # context parallelism's rings, inside their attentions
    for c in run.collectives:
        f, b = c.seconds(comm)
        fwd, bwd = fwd + f, bwd + b
    return fwd, bwd


def section_time(run: LocalRun, profiler: OpProfiler, comm: CommModel) -> Tuple[float, float]:
    """Forward and backward seconds of one section (a forward or a pipeline stage) on its device.

    The ops and collectives of a recomputed region run their forward again inside the backward, so
    their forward time counts twice; ``local_time_bwd_s`` includes it."""
    fwd = bwd = 0.0
    for op in run.ops:
        f, b = profiler.time(op)
        b += f if op.recomputed else 0.0
        fwd, bwd = fwd + f, bwd + b
        op.node.meta.setdefault("local_time_fwd_s", {})[run.device] = f
        op.node.meta.setdefault("local_time_bwd_s", {})[run.device] = b
    rings = rings_seconds(run, comm, profiler.time)     # context parallelism's rings, inside their attentions
    fwd, bwd = fwd + rings[0], bwd + rings[1]
    for c in run.collectives:                  # a unit's plan devices are the ranks of unit 0
        f, b = c.seconds(comm)
        fwd, bwd = fwd + f, bwd + b
    return fwd, bwd + profiler.overhead_s


def device_params(placed: PlacedGraphs, device: int) -> List[LocalWeight]:
    """The parameters plan ``device`` stores (``local_weights`` without buffers)."""
    return [w for w in local_weights(placed, device) if w.kind == "param"]


def _reduced_bytes(params: List[LocalWeight], recipe: Recipe) -> int:
    """Bytes of ``params``' gradients as the reduction sends them: in ``recipe``'s reduce dtype
    (fp32 for a bf16 model with fp32 masters, as Megatron-LM and ``build_optimizer`` do)."""
    return sum(p.numel * recipe.reduce_dtype(p.dtype).itemsize for p in params)


def sync_buckets(placed: PlacedGraphs, device: int, comm: CommModel, recipe: Recipe,
                 params: Optional[List[LocalWeight]] = None) -> List[Tuple[float, float]]:
    """Seconds of the gradient synchronisation per bucket of plan ``device`` (unit 0), in parameter
    order: ``(during, after)``, what may run while the backward goes on (partial gradients summed
    inside the unit for parameters stored ``R*``, the all-reduce across data-parallel units or
    ZeRO's reduce-scatter) and what waits for the optimizer step (ZeRO's all-gather). ``params``:
    the device's parameters (``device_params``), when the caller has them already. Gradients are
    reduced in ``recipe``'s reduce dtype."""
    params = params if params is not None else device_params(placed, device)
    return bucket_seconds(placed.config, device, comm, reduced_buckets(params, placed.config, recipe))


Partials = Tuple[int, int]
"""``(n, stride)``: a sum of partial gradients over ``n`` devices ``stride`` apart (``partial_ranks``)."""


def partials_of(params: List[LocalWeight]) -> List[Partials]:
    """The kinds of partial-gradient sums inside the unit ``params`` take, in order."""
    return sorted({(p.partial_over, p.partial_stride) for p in params if p.partial_over > 1})


def partial_ranks(device: int, partial: Partials) -> range:
    """The devices whose partial gradients ``device`` sums with its own: ``n`` neighbours, or over a
    grid its counterparts, ``stride`` apart, in the block of ``n * stride`` devices it is in."""
    n, stride = partial
    base = device - device % (n * stride) + device % stride
    return range(base, base + n * stride, stride)


def reduced_buckets(params: List[LocalWeight], cfg: ComputeConfig,
                    recipe: Recipe) -> Tuple[List[Tuple[Partials, int]], List[int]]:
    """The gradient bytes ``sync_buckets`` reduces, per bucket: ``((n, stride), bytes)`` for each
    bucket of the parameters whose partial gradients ``n`` devices sum first (``partial_ranks``),
    then the bytes of each bucket of all of them, reduced across the units. Of ``cfg`` it reads only
    the bucket size (``reduce_bucket_bytes``), so a sweep keeps it for every configuration of one
    placement."""
    inside = [(kind, _reduced_bytes(bucket, recipe)) for kind in partials_of(params)
              for bucket in buckets([p for p in params if (p.partial_over, p.partial_stride) == kind], cfg)]
    return inside, [_reduced_bytes(bucket, recipe) for bucket in buckets(params, cfg)]


def bucket_seconds(cfg: ComputeConfig, device: int, comm: CommModel,
                   reduced: Tuple[List[Tuple[int, int]], List[int]]) -> List[Tuple[float, float]]:
    """``sync_buckets``' seconds from the bytes ``reduced_buckets`` gives. Under ZeRO stage 3 only
    the sums inside the unit: the reduction across units is each unit's reduce-scatter in the
    backward (``cost.fsdp``), and nothing is gathered after the step. Where ZeRO spans the devices
    that hold the parts (``RankGrid.zero_over_stage``), its reduce-scatter sums them: no sums inside."""
    inside, across = reduced
    if cfg.grid.zero_over_stage:
        inside = []
    if is_zero3(cfg):
        across = []
    out = [(comm.forward(Collective.ALL_REDUCE, nbytes, kind[0], ranks=partial_ranks(device, kind)), 0.0)
           for kind, nbytes in inside]                    # devices of the unit
    seconds = functools.lru_cache(maxsize=None)(_bucket_seconds(cfg, device, comm))   # a model's buckets repeat
    return out + [seconds(nbytes) for nbytes in across]


def _bucket_seconds(cfg: ComputeConfig, device: int, comm: CommModel) -> Callable[[int], Tuple[float, float]]:
    """``(during, after)`` seconds of reducing one bucket of ``nbytes`` across plan ``device``'s
    data-parallel units: an all-reduce, or under ZeRO a reduce-scatter over its ZeRO group and an
    all-reduce across the groups holding the same shard (during), an all-gather (after the step)."""
    grid = cfg.grid
    if not cfg.use_zero:
        units = grid.dp_ranks(device)                  # the same device in every unit
        return lambda nbytes: (comm.forward(Collective.ALL_REDUCE, nbytes, cfg.units, ranks=units), 0.0)
    n, group, replicas = grid.zero_group_size, grid.zero_ranks(device), grid.zero_replica_ranks(device)

    def zero(nbytes: int) -> Tuple[float, float]:
        shard = -(-nbytes // n)
        during = (comm.forward(Collective.REDUCE_SCATTER, shard * n, n, ranks=group)
                  + comm.forward(Collective.ALL_REDUCE, shard, cfg.zero_ngroups, ranks=replicas))
        return during, comm.forward(Collective.ALL_GATHER, shard, n, ranks=group)
    return zero


def is_zero3(cfg: ComputeConfig) -> bool:
    """Whether ``cfg`` trains under ZeRO stage 3 (parameters gathered a unit at a time)."""
    return cfg.use_zero and cfg.zero_stage == 3 and not cfg.inference_only


def sync_time(placed: PlacedGraphs, device: int, comm: CommModel, recipe: Recipe, overlap_s: Optional[float] = None,
              params: Optional[List[LocalWeight]] = None) -> float:
    """Seconds of the gradient synchronisation after the backward (``sync_buckets``, then
    ``exposed_sync``)."""
    return exposed_sync(sync_buckets(placed, device, comm, recipe, params), overlap_s)


def exposed_sync(times: List[Tuple[float, float]], overlap_s: Optional[float]) -> float:
    """What of the synchronisation's ``times`` (``sync_buckets``) the step waits for.

    ``overlap_s=None``: all of it after the backward (a CPU rank computes and communicates on the
    same cores). Else, as DDP on a GPU: each bucket is reduced on its own stream as soon as the
    backward has produced it, during the backward's last ``overlap_s`` seconds; the first bucket
    (the first layers' gradients, produced last) and what does not fit in that time are exposed."""
    if not times:
        return 0.0
    if overlap_s is None:
        return sum(d + a for d, a in times)
    hidden = sum(d for d, _ in times[1:])
    return times[0][0] + max(0.0, hidden - overlap_s) + sum(a for _, a in times)


@dataclass(frozen=True)
class SyncSpan:
    """One part of a bucket's synchronisation on the timeline (``sync_spans``): bucket ``index`` of
    ``sync_buckets``' list, its ``'during'`` or ``'after'`` part, from ``t_start`` to ``t_end``;
    ``waited_s``: its seconds after the backward's end, which the step waits for."""

    index: int
    part: str
    t_start: float
    t_end: float
    waited_s: float


def sync_spans(times: List[Tuple[float, float]], overlap_s: Optional[float], end_s: float,
               update_s: float) -> List[SyncSpan]:
    """Where ``exposed_sync`` puts each bucket of ``times`` (``sync_buckets``) in a step whose
    backward ends at ``end_s``, one after the other on the rank's communication stream.

    The backward makes the last parameters' gradients first, so buckets run in the reverse of
    parameter order. With ``overlap_s``, the buckets after the first run from the start of the
    window (``end_s - overlap_s``), each as soon as the one before ends; the first (ready when the
    backward ends) after them and after ``end_s``. With ``None`` all of them run after ``end_s``.
    ZeRO's all-gathers (the ``after`` parts) follow the optimizer step's ``update_s``, in parameter
    order. Their ``waited_s`` add up to ``exposed_sync(times, overlap_s)``; parts of no seconds
    are left out."""
    spans: List[SyncSpan] = []
    t = end_s if overlap_s is None else end_s - overlap_s
    for i in reversed(range(len(times))):
        if i == 0 and overlap_s is not None:
            t = max(t, end_s)                      # the first bucket is ready when the backward ends
        d = times[i][0]
        if d > 0:
            spans.append(SyncSpan(i, "during", t, t + d, t + d - max(t, end_s) if t + d > end_s else 0.0))
        t += d
    t += update_s
    for i, (_, a) in enumerate(times):
        if a > 0:
            spans.append(SyncSpan(i, "after", t, t + a, a))
        t += a
    return spans


def update_time(placed: PlacedGraphs, device: int, profiler: OpProfiler, recipe: Recipe,
                params: Optional[List[LocalWeight]] = None) -> float:
    """Seconds of the reducer's copies and the optimizer step on plan ``device`` (profiled); with
    ``recipe``'s master copies the step streams them and their state in the master dtype."""
    params = params if params is not None else device_params(placed, device)
    return update_seconds(profiler, updated_numels(params, placed.config), params[0].dtype if params else None, recipe)


def updated_numels(params: List[LocalWeight], cfg: ComputeConfig) -> List[int]:
    """The elements of each tensor the optimizer step updates: each parameter, or under ZeRO this
    rank's shard of each bucket. Of ``cfg`` it reads the bucket size and the ZeRO group."""
    if cfg.use_zero:
        n = cfg.grid.zero_group_size
        return [-(-sum(p.numel for p in b) // n) for b in buckets(params, cfg)]
    return [p.numel for p in params]


def update_seconds(profiler: OpProfiler, numels: List[int], param_dtype: Optional[torch.dtype],
                   recipe: Recipe) -> float:
    """``update_time`` from the ``updated_numels`` of parameters of ``param_dtype`` (none: no step).
    The optimizer is timed at ``lr=1e-3`` unless the recipe sets one: a rate's value costs nothing."""
    if not numels:
        return 0.0
    dtype = recipe.master_of(param_dtype) or param_dtype
    return profiler.update(numels, dtype, recipe.replace(optimizer_kwargs={"lr": 1e-3, **recipe.kwargs}))


class StepModel:
    """Per-device section times and the schedule, from which step times and timelines follow."""

    def __init__(self, placed: PlacedGraphs, profiler: Optional[OpProfiler] = None,
                 comm: Optional[CommModel] = None, runs: Optional[DeviceRuns] = None,
                 hardware: Optional[Hardware] = None, weights_of: Optional[Callable[[int], List[LocalWeight]]] = None,
                 program_of: Optional[ProgramOf] = None, recipe: Optional[Recipe] = None):
        """``runs``, ``weights_of`` and ``program_of`` (plan device -> its lowered program, read
        under ZeRO stage 3): the plan's, when the caller has them. ``recipe``: the run's, where its
        products are in fp8 (``products_of``); every recipe this model prices must agree with it."""
        self.placed, cfg = placed, placed.config
        self.products = products_of(recipe)
        self.graphs, self.cfg, self.geometry = placed.graphs, cfg, placed.geometry
        self.weights_of = weights_of          # plan device -> its weight table, when the caller has them
        self.hardware = hardware
        on_target = hardware is not None and not hardware.is_local
        if on_target:
            hardware.check_ranks(cfg.runtime_ngpus)
        elif self.products[0] is not None:
            raise ValueError(f"Recipe(float8={self.products[0].value!r}) is priced on a target (hardware=Hardware.named("
                             "'H100-SXM-80GB') and the like): this machine's op profiles time products in the "
                             "module's dtype. Use float8=None here.")
        ops, collectives = target_models(hardware, recipe) if on_target else (None, None)
        self.profiler = profiler or ops or profiler_for(cfg)
        self.comm = comm or collectives or comm_model.load(comm_model.local_backend(cfg.runtime_ngpus),
                                                           nranks=max(2, cfg.plan_ngpus))
        # device -> stage (None without a pipeline) -> (forward s, backward s), all of it and its collectives'
        self.times: Dict[int, Dict[Optional[int], Tuple[float, float]]] = {}
        self.collective_times: Dict[int, Dict[Optional[int], Tuple[float, float]]] = {}
        stages = {d: runs[d] if runs is not None else stage_runs(placed, d) for d in range(cfg.plan_ngpus)}
        self.profiler.profile(op for by_stage in stages.values() for run in by_stage.values() for op in run.ops)
        self.runs = stages
        self._context: Dict[Tuple[int, Optional[int]], List[ContextCall]] = {}
        for device, by_stage in stages.items():
            self.times[device] = {s: section_time(r, self.profiler, self.comm) for s, r in by_stage.items()}
            self.collective_times[device] = {s: collective_time(r, self.comm, self.profiler) for s, r in by_stage.items()}
        # ZeRO stage 3: each section's gather points and the compute between them, and each unit's parameters
        self.scripts: Dict[int, Dict[Optional[int], Script]] = {}
        self.unit_params: Dict[int, Tuple[List[LocalWeight], Dict[str, str]]] = {}
        if is_zero3(cfg):
            graph = train_graph(self.graphs)
            for device, by_stage in stages.items():
                program = (program_of(device) if program_of is not None
                           else lower_device(placed.graphs, placed.storage, device, placed.geometry))
                sections = {sec.stage: sec for sec in program.sections if sec.graph is graph}
                self.scripts[device] = {s: section_script(sections[s], r, self.profiler, self.comm)
                                        for s, r in by_stage.items()}
                self.unit_params[device] = (program.weights, {n: u for u, names in program.units.items() for n in names})
        self._units: Dict[Recipe, Dict[int, DeviceUnits]] = {}
        self.profiler.save()

    def shard_units(self, recipe: Recipe) -> Dict[int, DeviceUnits]:
        """Per plan device, ZeRO stage 3's collectives with gradients reduced as ``recipe`` says
        (``cost.fsdp``): each unit's bytes and seconds on the ZeRO group's link, each stage's
        blocks played; ``{}`` without stage 3."""
        if recipe not in self._units:
            grid, overlap = self.cfg.grid, overlaps_communication(self.hardware)
            splits = self.geometry is not None and self.geometry.schedule.splits_backward
            out = {}
            for device, scripts in self.scripts.items():
                weights, unit_of = self.unit_params[device]
                moved = unit_bytes(weights, unit_of.get, grid.zero_group_size, recipe)
                seconds = unit_seconds(moved, self.comm, grid.zero_ranks(device), grid.zero_replica_ranks(device))
                out[device] = DeviceUnits(moved, seconds, {s: stage_plays(script, seconds, overlap, splits)
                                                           for s, script in scripts.items()})
            self._units[recipe] = out
        return self._units[recipe]

    def pipeline_timeline(self, recipe: Optional[Recipe] = None) -> Timeline:
        """The simulated step, one row per pipeline device (``recipe``: how gradients are reduced,
        which ZeRO stage 3's reduce-scatters read; default ``Recipe()``)."""
        *costs, extra = self._stage_costs(recipe)
        return simulate(self.geometry.schedule, *costs, extra=extra)

    def pipeline_parts(self, recipe: Optional[Recipe] = None) -> Optional[PipelineParts]:
        """The pipeline's makespan with its sends' latency and without, and each plan device's
        busy seconds without it (``PipelineParts``): what the bubble and the sends' share of a step
        are read from. ``None`` without a pipeline."""
        if self.geometry is None:
            return None
        forward, backward, latency, post, extra = self._stage_costs(recipe)
        schedule = self.geometry.schedule
        line = simulate_totals(schedule, forward, backward, latency, post, extra=extra)
        instant = simulate_totals(schedule, forward, backward, 0.0, post, extra=extra)
        busy = {d: instant.busy[self.geometry.pipeline_device(d)] for d in range(self.cfg.plan_ngpus)}
        return PipelineParts(line.makespan, instant.makespan, busy)

    def _block_extras(self, recipe: Optional[Recipe]) -> Dict[Block, float]:
        """The seconds each block waits for ZeRO stage 3's collectives (``cost.fsdp.block_extras``),
        its stage group's slowest device's; ``{}`` without stage 3."""
        units = self.shard_units(recipe or Recipe())
        schedule = self.geometry.schedule
        if not units:
            return {}
        return block_extras(schedule, {s: [units[d].plays[s] for d in self.geometry.stage_group(s)]
                                       for s in range(schedule.nstages)})

    def _stage_costs(self, recipe: Optional[Recipe] = None
                     ) -> Tuple[List[float], List[float], float, float, Dict[Block, float]]:
        """Each stage's forward and backward seconds (its slowest device's), a send's latency, the
        time a rank spends starting its sends and receives, and what single blocks add (ZeRO stage
        3's waits: ``_block_extras``), as the simulator takes them."""
        schedule = self.geometry.schedule
        forward, backward = [0.0] * schedule.nstages, [0.0] * schedule.nstages
        for s in range(schedule.nstages):
            for device in self.geometry.stage_group(s):
                f, b = self.times[device][s]
                forward[s], backward[s] = max(forward[s], f), max(backward[s], b)
        graph = train_graph(self.graphs)
        carries = stage_carries(graph, schedule.nstages)
        pairs = [(self.geometry.stage_group(s)[0], self.geometry.stage_group(s + 1)[0]) for s in range(len(carries))]
        latency = max((self.comm.p2p(sum(t.nbytes for t in c), ranks=pair) for c, pair in zip(carries, pairs)),
                      default=self.comm.p2p(0))
        post = self.comm.p2p_post(max((len(c) for c in carries), default=0))     # one isend/irecv per tensor
        return forward, backward, latency, post, self._block_extras(recipe)

    def collective_seconds(self, device: int, nsamples: int) -> float:
        """Seconds plan ``device`` spends in its sections' collectives in one step: each stage's
        forward and backward collectives times how often the schedule runs its blocks (a ``W``
        block's are its ``B``'s), or without a pipeline ``nsamples`` forwards and backwards."""
        times = self.collective_times[device]
        if self.geometry is None:
            f, b = times[None]
            return nsamples * (f + b)
        blocks = self.geometry.schedule.blocks_of(self.geometry.pipeline_device(device))
        view = {s: self.geometry.view_of(s, device) for s in range(self.geometry.schedule.nstages)}
        return sum(self.collective_times[view[blk.stage]][blk.stage][0 if blk.phase == "F" else 1]
                   for blk in blocks if blk.phase != "W")

    def timeline(self, nsamples: int = 1, recipe: Optional[Recipe] = None) -> Timeline:
        """Predicted blocks of one step per runtime rank (the rows the runtime measures); under
        ZeRO stage 3 each unit's all-gathers and reduce-scatters beside them; and each bucket of
        the data-parallel gradient synchronisation where the step's figures price it
        (``sync_spans``; ``recipe``: how gradients are reduced, default ``Recipe()``); under
        context parallelism each attention's ring passes or keys' all-gathers (``cost.context_calls``); under
        expert parallelism each expert op's all-to-alls (``cost.expert_calls``)."""
        recipe = recipe or Recipe()
        line = self._compute_timeline(nsamples, recipe)
        if self.cfg.inference_only:
            return line
        last: Dict[int, TimedBlock] = {}
        for blk in line.blocks:
            if blk.rank not in last or blk.t_end >= last[blk.rank].t_end:
                last[blk.rank] = blk
        spans: Dict[int, List[SyncSpan]] = {}
        calls: List[CollectiveBlock] = list(line.collectives)
        for rank, blk in sorted(last.items()):
            device = self.cfg.device_of(rank)
            if device not in spans:
                spans[device] = self._sync_spans(device, recipe, line.makespan if self.geometry is not None
                                                 else blk.t_end)
            calls += [CollectiveBlock(rank, blk.stage, blk.micro, blk.phase, kind, label, s.t_start, s.t_end,
                                      s.waited_s, sync=True) for s, (kind, label) in spans[device]]
        calls += timeline_calls(line.blocks, self._context_calls)
        return Timeline(line.blocks, line.nranks, tuple(calls))

    def _context_calls(self, rank: int, stage: int) -> List[ContextCall]:
        """Context parallelism's collectives in the blocks of ``stage`` on runtime ``rank``
        (``cost.context_calls``) and expert parallelism's (``cost.expert_calls``), worked out once
        per plan device and stage."""
        device = self.cfg.device_of(rank)
        key = None if self.geometry is None else stage
        if self.geometry is not None:
            device = self.geometry.view_of(stage, device)
        if (device, key) not in self._context:
            run = self.runs.get(device, {}).get(key)
            self._context[(device, key)] = (section_calls(run, self.profiler.time, self.comm)
                                            + expert_section_calls(run, self.profiler.time, self.comm)) if run else []
        return self._context[(device, key)]

    def _sync_spans(self, device: int, recipe: Recipe, end_s: float) -> List[Tuple[SyncSpan, Tuple[str, str]]]:
        """Plan ``device``'s synchronisation on the timeline, its backward ending at ``end_s`` (the
        step's compute, as ``device_steps`` counts it): each span with its collective's kind and its
        bucket's label."""
        params = self._params(device)
        inside, across = reduced_buckets(params, self.cfg, recipe)
        times = bucket_seconds(self.cfg, device, self.comm, (inside, across))
        overlap = overlap_window((b for _, b in self.times[device].values()), self.hardware)
        found = sync_spans(times, overlap, end_s, 0.0)
        if any(s.part == "after" for s in found):      # ZeRO's all-gathers follow the optimizer step
            found = sync_spans(times, overlap, end_s, update_time(self.placed, device, self.profiler, recipe, params))
        npartial = len(inside)                          # bucket_seconds puts the sums inside the unit first
        during = Collective.REDUCE_SCATTER if self.cfg.use_zero and not is_zero3(self.cfg) else Collective.ALL_REDUCE

        def named(s: SyncSpan) -> Tuple[str, str]:
            if s.index < npartial:
                return str(Collective.ALL_REDUCE), f"partial {s.index}"
            kind = Collective.ALL_GATHER if s.part == "after" else during
            return str(kind), f"bucket {s.index - npartial}"
        return [(s, named(s)) for s in found]

    def _params(self, device: int) -> List[LocalWeight]:
        """The parameters plan ``device`` stores (its weight table's, when the caller gave them)."""
        return ([w for w in self.weights_of(device) if w.kind == "param"] if self.weights_of is not None
                else device_params(self.placed, device))

    def _compute_timeline(self, nsamples: int, recipe: Recipe) -> Timeline:
        """``timeline`` without the data-parallel synchronisation: the blocks, and under ZeRO stage 3
        its units' collectives."""
        if products_of(recipe) != self.products:
            raise ValueError(f"this step model prices products as {self.products}, the recipe asks for "
                             f"{products_of(recipe)}: make one with StepModel(..., recipe=recipe) "
                             "(Plan.step_model(hardware, recipe) does).")
        units = self.shard_units(recipe)
        blocks: List[TimedBlock] = []
        calls: List[CollectiveBlock] = []
        if self.geometry is None:
            for rank in range(self.cfg.runtime_ngpus):
                device = self.cfg.device_of(rank)
                f, b = self.times[device][None]
                plays = units[device].plays[None] if units else None
                if plays is not None:        # no pipeline: each forward gathers every unit
                    f, b = f + plays.cold.exposed_s, b + plays.backward.exposed_s
                for m in range(nsamples):
                    t0 = m * (f + b)
                    blocks += [TimedBlock(rank, 0, m, "F", t0, t0 + f), TimedBlock(rank, 0, m, "B", t0 + f, t0 + f + b)]
                    if plays is not None:
                        calls += _calls(rank, blocks[-2], plays.cold) + _calls(rank, blocks[-1], plays.backward)
            return Timeline(tuple(blocks), self.cfg.runtime_ngpus, tuple(calls))
        line = self.pipeline_timeline(recipe)
        by_device: Dict[int, List[TimedBlock]] = {}
        for blk in line.blocks:
            by_device.setdefault(blk.rank, []).append(blk)
        schedule = self.geometry.schedule
        for rank in range(self.cfg.runtime_ngpus):
            device = self.cfg.device_of(rank)
            pd_ = self.geometry.pipeline_device(device)
            mine = [TimedBlock(rank, b.stage, b.micro, b.phase, b.t_start, b.t_end) for b in by_device.get(pd_, [])]
            blocks += mine
            if units:
                plays = {s: units[self.geometry.view_of(s, device)].plays[s] for s in schedule.stages_of(pd_)}
                played = block_plays(schedule, plays)
                calls += [c for b in mine for c in _calls(rank, b, played[b.block])]
        return Timeline(tuple(blocks), self.cfg.runtime_ngpus, tuple(calls))

    def device_steps(self, nsamples: int, recipe: Recipe) -> Dict[int, DeviceStep]:
        """Per plan device, the seconds of one training step's parts (``DeviceStep``'s compute,
        exposed synchronisation and update; FLOPs and bytes are the plan's to add), gradients
        reduced and the update run as ``recipe`` says. Compute is the pipeline's makespan, or
        without one the device's own forwards and backwards."""
        line = self._compute_timeline(nsamples, recipe)
        ends: Dict[int, float] = {}
        for blk in line.blocks:
            ends[blk.rank] = max(ends.get(blk.rank, 0.0), blk.t_end)
        out = {}
        for device in range(self.cfg.plan_ngpus):        # unit 0's ranks are the plan devices
            overlap = overlap_window((b for _, b in self.times[device].values()), self.hardware)
            params = self._params(device)
            sync = sync_time(self.placed, device, self.comm, recipe, overlap, params)
            update = update_time(self.placed, device, self.profiler, recipe, params)
            compute = line.makespan if self.geometry is not None else ends.get(device, 0.0)
            out[device] = DeviceStep(compute_s=compute, sync_s=sync, update_s=update,
                                     tp_s=self.collective_seconds(device, nsamples),
                                     fsdp_s=self.fsdp_seconds(device, nsamples, recipe))
        self.profiler.save()
        return out

    def device_plays(self, device: int, nsamples: int, recipe: Recipe) -> List[Played]:
        """ZeRO stage 3's play of each block plan ``device`` runs in one step, in order: without a
        pipeline ``nsamples`` forwards and backwards; with one, its pipeline device's blocks, each as
        this device plays it (its own share of the stage); ``[]`` without stage 3."""
        units = self.shard_units(recipe)
        if not units:
            return []
        if self.geometry is None:
            plays = units[device].plays[None]
            return [plays.cold, plays.backward] * nsamples
        schedule, pdev = self.geometry.schedule, self.geometry.pipeline_device(device)
        played = block_plays(schedule, {s: units[self.geometry.view_of(s, device)].plays[s]
                                        for s in schedule.stages_of(pdev)})
        return [played[b] for b in schedule.blocks_of(pdev)]

    def unit_table(self, nsamples: int, recipe: Recipe) -> pd.DataFrame:
        """One row per plan device and ZeRO stage 3 unit: its collectives' bytes, seconds, count
        and exposed seconds in one step (``nbscaler.columns.UnitColumn``); no rows without stage 3."""
        rows = []
        for device, units in self.shard_units(recipe).items():
            counts: Dict[Tuple[str, str], int] = {}
            waited: Dict[str, float] = {}
            for played in self.device_plays(device, nsamples, recipe):
                for c in played.calls:
                    counts[(c.kind, c.unit)] = counts.get((c.kind, c.unit), 0) + 1
                    waited[c.unit] = waited.get(c.unit, 0.0) + c.waited_s
            for name, u in units.bytes.items():
                rows.append({U.RANK: device, U.UNIT: name, U.GATHER_BYTES: u.gather_bytes,
                             U.REDUCE_BYTES: u.reduce_bytes, U.GATHER_S: units.seconds[name].gather_s,
                             U.REDUCE_S: units.seconds[name].reduce_s,
                             U.GATHERS: counts.get((Collective.ALL_GATHER, name), 0),
                             U.REDUCES: counts.get((Collective.REDUCE_SCATTER, name), 0),
                             U.EXPOSED_S: waited.get(name, 0.0)})
        return pd.DataFrame(rows, columns=list(U)).rename(columns=str)

    def fsdp_seconds(self, device: int, nsamples: int, recipe: Recipe) -> float:
        """Seconds plan ``device``'s blocks wait for ZeRO stage 3's collectives in one step (part of
        its compute): without a pipeline ``nsamples`` forwards and backwards; with one, each block
        of its pipeline device as the simulator plays it (its stage group's slowest device's)."""
        units = self.shard_units(recipe)
        if not units:
            return 0.0
        if self.geometry is None:
            plays = units[device].plays[None]
            return nsamples * (plays.cold.exposed_s + plays.backward.exposed_s)
        extra = self._block_extras(recipe)
        return sum(extra.get(b, 0.0) for b in self.geometry.schedule.blocks_of(self.geometry.pipeline_device(device)))

    def step_times(self, nsamples: int, recipe: Recipe) -> pd.DataFrame:
        """Predicted seconds of one training step per runtime rank (``device_steps`` added up)."""
        parts = self.device_steps(nsamples, recipe)
        rows = [{str(C.RANK): rank, str(C.STEP_TIME_S): parts[self.cfg.device_of(rank)].step_time_s}
                for rank in range(self.cfg.runtime_ngpus)]
        return pd.DataFrame(rows)


def _calls(rank: int, block: TimedBlock, played) -> List[CollectiveBlock]:
    """The collectives of ``block`` (played as ``played``, ``cost.fsdp.Played``) on the timeline."""
    return [CollectiveBlock(rank, block.stage, block.micro, block.phase, str(c.kind), c.unit,
                            block.t_start + c.start_s, block.t_start + c.end_s, c.waited_s) for c in played.calls]


def _nsamples(cfg: ComputeConfig) -> int:
    return cfg.pipeline_nmicros if cfg.use_pipeline else 1


def predicted_timeline(placed: PlacedGraphs, *, nsamples: Optional[int] = None, runs: Optional[DeviceRuns] = None,
                       hardware: Optional[Hardware] = None, model: Optional[StepModel] = None,
                       recipe: Optional[Recipe] = None, program_of: Optional[ProgramOf] = None) -> Timeline:
    """The predicted blocks ``(rank, stage, micro, phase, t_start, t_end)`` of one training step:
    the simulated schedule for a pipeline, else a forward and a backward per sample and rank; on
    ``hardware`` when given (``model``: this plan's ``StepModel`` on it, when the caller keeps one;
    ``program_of``: its lowered programs). Under ZeRO stage 3 with each unit's all-gathers and
    reduce-scatters beside them, gradients reduced as ``recipe`` says (default ``Recipe()``)."""
    n = nsamples if nsamples is not None else _nsamples(placed.config)
    model = model or StepModel(placed, runs=runs, hardware=hardware, program_of=program_of, recipe=recipe)
    return model.timeline(n, recipe)
