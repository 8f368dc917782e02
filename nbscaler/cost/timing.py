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
  the optimizer step (profiled, with the reducer's copies).

Op times are read at the speed the ranks last measured side by side (``cost.speed``), so a
profile from a quieter minute, or from one process alone, is scaled to the machine as it runs them.

What limits it: Python overhead between ops and the pipeline executor's bookkeeping (beyond
starting its sends and receives) are not counted; ranks are assumed in step (none waits at a
collective for a slower peer); with more ranks than cores, the calibration sees every rank busy at
once, which a pipeline's ranks are not.

The pass ``annotate_times`` writes ``node.meta['local_time_fwd_s']`` and ``['local_time_bwd_s']``,
per device, as the memory model writes ``local_saved_bytes``.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple, Type

import pandas as pd
import torch

from nbscaler.columns import SummaryColumn as C
from nbscaler.comm.layout import Layout
from nbscaler.config import ComputeConfig, threads_per_rank
from nbscaler.cost import comm_model
from nbscaler.cost.comm_model import CommModel
from nbscaler.cost.local import LocalRun
from nbscaler.cost.memory import DeviceRuns, buckets, stage_runs, zero_group_size
from nbscaler.cost.profile import OpProfiler
from nbscaler.cost.ranks import local_weights, stage_io, train_graph
from nbscaler.ir.graph import IRGraph
from nbscaler.schedule import PipelineGeometry, TimedBlock, Timeline, simulate

_PROFILERS: Dict[str, OpProfiler] = {}


def default_profiler(threads: Optional[int] = None, ranks: int = 1) -> OpProfiler:
    """One profiler per device (and CPU thread count) and number of ranks for the process, so its
    table is read from disk once; each call reads the ranks' latest speed calibration."""
    probe = OpProfiler(threads=threads, ranks=ranks)
    profiler = _PROFILERS.setdefault(f"{probe.path}|{ranks}", probe)
    profiler.refresh_speed()
    return profiler


def profiler_for(cfg: ComputeConfig) -> OpProfiler:
    """The profiler that times ops as the ranks of ``cfg`` will run them: on a CPU, with the share
    of this host's cores each rank gets (``threads_per_rank``; all ranks on this host, the notebook
    case), read at the speed those ranks last measured side by side. A plan made in a notebook of
    16 cores for 4 ranks is timed at 4 threads, not 16."""
    return default_profiler(threads_per_rank(os.cpu_count() or 1, cfg.runtime_ngpus), cfg.runtime_ngpus)


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
    for c in run.collectives:
        f = comm.forward(c.fn, c.in_bytes, len(c.devices))
        fwd += f
        bwd += comm.backward(c.fn, c.in_bytes, len(c.devices)) + (f if c.recomputed else 0.0)
    return fwd, bwd + profiler.overhead_s


def sync_time(graphs: Dict[str, IRGraph], storage: Dict[str, Layout], cfg: ComputeConfig, device: int,
              geometry: Optional[PipelineGeometry], comm: CommModel) -> float:
    """Seconds of the gradient synchronisation after the backward: partial gradients summed inside
    the unit (parameters stored ``R*``), then across data-parallel units (and ZeRO's gather)."""
    params = [w for w in local_weights(graphs, storage, device, geometry) if w.kind == "param"]
    total = 0.0
    for n in sorted({p.partial_over for p in params} - {1}):
        for bucket in buckets([p for p in params if p.partial_over == n]):
            total += comm.forward("all_reduce", sum(p.nbytes for p in bucket), n)
    for bucket in buckets(params):
        nbytes = sum(p.nbytes for p in bucket)
        if not cfg.use_zero:
            total += comm.forward("all_reduce", nbytes, cfg.units)
            continue
        n = zero_group_size(cfg)
        shard = -(-nbytes // n)
        total += comm.forward("reduce_scatter", shard * n, n) + comm.forward("all_reduce", shard, cfg.zero_ngroups)
        total += comm.forward("all_gather", shard, n)
    return total


def update_time(graphs: Dict[str, IRGraph], storage: Dict[str, Layout], cfg: ComputeConfig, device: int,
                geometry: Optional[PipelineGeometry], profiler: OpProfiler, optimizer: Type[torch.optim.Optimizer],
                optimizer_kwargs: Dict[str, Any]) -> float:
    """Seconds of the reducer's copies and the optimizer step on plan ``device`` (profiled)."""
    params = [w for w in local_weights(graphs, storage, device, geometry) if w.kind == "param"]
    if not params:
        return 0.0
    if cfg.use_zero:
        n = zero_group_size(cfg)
        numels = [-(-sum(p.numel for p in b) // n) for b in buckets(params)]
    else:
        numels = [p.numel for p in params]
    return profiler.update(numels, params[0].dtype, optimizer, optimizer_kwargs)


class StepModel:
    """Per-device section times and the schedule, from which step times and timelines follow."""

    def __init__(self, graphs: Dict[str, IRGraph], storage: Dict[str, Layout], cfg: ComputeConfig,
                 geometry: Optional[PipelineGeometry], profiler: Optional[OpProfiler] = None,
                 comm: Optional[CommModel] = None, runs: Optional[DeviceRuns] = None):
        self.graphs, self.storage, self.cfg, self.geometry = graphs, storage, cfg, geometry
        self.profiler = profiler or profiler_for(cfg)
        self.comm = comm or comm_model.load(nranks=max(2, cfg.plan_ngpus))
        # device -> stage (None without a pipeline) -> (forward s, backward s)
        self.times: Dict[int, Dict[Optional[int], Tuple[float, float]]] = {}
        stages = {d: runs[d] if runs is not None else stage_runs(graphs, storage, d, geometry) for d in range(cfg.plan_ngpus)}
        self.profiler.profile(op for by_stage in stages.values() for run in by_stage.values() for op in run.ops)
        for device, by_stage in stages.items():
            self.times[device] = {s: section_time(r, self.profiler, self.comm) for s, r in by_stage.items()}
        self.profiler.save()

    def pipeline_timeline(self) -> Timeline:
        """The simulated step, one row per pipeline device."""
        schedule = self.geometry.schedule
        forward, backward = [0.0] * schedule.nstages, [0.0] * schedule.nstages
        for s in range(schedule.nstages):
            for device in self.geometry.stage_group(s):
                f, b = self.times[device][s]
                forward[s], backward[s] = max(forward[s], f), max(backward[s], b)
        graph = train_graph(self.graphs)
        carries = [stage_io(graph, self.geometry, s + 1)[0] for s in range(schedule.nstages - 1)]
        latency = self.comm.p2p(max((sum(t.nbytes for t in c) for c in carries), default=0))
        post = self.comm.p2p_post(max((len(c) for c in carries), default=0))     # one isend/irecv per tensor
        return simulate(schedule, forward, backward, latency, post)

    def timeline(self, nsamples: int = 1) -> Timeline:
        """Predicted blocks of one step per runtime rank (the rows the runtime measures)."""
        blocks: List[TimedBlock] = []
        if self.geometry is None:
            for rank in range(self.cfg.runtime_ngpus):
                f, b = self.times[self.cfg.device_of(rank)][None]
                for m in range(nsamples):
                    t0 = m * (f + b)
                    blocks += [TimedBlock(rank, 0, m, "F", t0, t0 + f), TimedBlock(rank, 0, m, "B", t0 + f, t0 + f + b)]
            return Timeline(tuple(blocks), self.cfg.runtime_ngpus)
        line = self.pipeline_timeline()
        by_device: Dict[int, List[TimedBlock]] = {}
        for blk in line.blocks:
            by_device.setdefault(blk.rank, []).append(blk)
        for rank in range(self.cfg.runtime_ngpus):
            pd_ = self.geometry.pipeline_device(self.cfg.device_of(rank))
            blocks += [TimedBlock(rank, b.stage, b.micro, b.phase, b.t_start, b.t_end) for b in by_device.get(pd_, [])]
        return Timeline(tuple(blocks), self.cfg.runtime_ngpus)

    def step_times(self, nsamples: int = 1, optimizer: Type[torch.optim.Optimizer] = torch.optim.SGD,
                   optimizer_kwargs: Optional[Dict[str, Any]] = None) -> pd.DataFrame:
        """Predicted seconds of one training step per runtime rank."""
        kwargs = {"lr": 1e-3, **(optimizer_kwargs or {})}
        line = self.timeline(nsamples)
        compute = {rank: 0.0 for rank in range(self.cfg.runtime_ngpus)}
        ends = {}
        for blk in line.blocks:
            ends[blk.rank] = max(ends.get(blk.rank, 0.0), blk.t_end)
        makespan = line.makespan if self.geometry is not None else None
        rows = []
        for rank in compute:
            device = self.cfg.device_of(rank)
            step = makespan if makespan is not None else ends.get(rank, 0.0)
            step += sync_time(self.graphs, self.storage, self.cfg, device, self.geometry, self.comm)
            step += update_time(self.graphs, self.storage, self.cfg, device, self.geometry, self.profiler,
                                optimizer, kwargs)
            rows.append({str(C.RANK): rank, str(C.STEP_TIME_S): step})
        self.profiler.save()
        return pd.DataFrame(rows)


def _nsamples(cfg: ComputeConfig) -> int:
    return cfg.pipeline_nmicros if cfg.use_pipeline else 1


def step_time_per_rank(graphs: Dict[str, IRGraph], storage: Dict[str, Layout], cfg: ComputeConfig,
                       geometry: Optional[PipelineGeometry], *, nsamples: Optional[int] = None,
                       optimizer: Type[torch.optim.Optimizer] = torch.optim.SGD,
                       optimizer_kwargs: Optional[Dict[str, Any]] = None, runs: Optional[DeviceRuns] = None) -> pd.DataFrame:
    """Predicted seconds of one training step on every runtime rank (columns ``rank``, ``step_time_s``).

    A step is ``train_step`` on ``nsamples`` samples (the pipeline's micro-batches; one sample
    without a pipeline), the gradient synchronisation and one step of ``optimizer``. Op times are
    profiled on this machine on first use (cached); collectives use the calibrated alpha-beta
    model, or its defaults.
    """
    n = nsamples if nsamples is not None else _nsamples(cfg)
    return StepModel(graphs, storage, cfg, geometry, runs=runs).step_times(n, optimizer, optimizer_kwargs)


def predicted_timeline(graphs: Dict[str, IRGraph], storage: Dict[str, Layout], cfg: ComputeConfig,
                       geometry: Optional[PipelineGeometry], *, nsamples: Optional[int] = None,
                       runs: Optional[DeviceRuns] = None) -> Timeline:
    """The predicted blocks ``(rank, stage, micro, phase, t_start, t_end)`` of one training step:
    the simulated schedule for a pipeline, else a forward and a backward per sample and rank."""
    n = nsamples if nsamples is not None else _nsamples(cfg)
    return StepModel(graphs, storage, cfg, geometry, runs=runs).timeline(n)
