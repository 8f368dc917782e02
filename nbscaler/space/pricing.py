"""One configuration of a sweep, priced from ``LayerFacts`` with the functions ``plan.summary`` uses.

A configuration's full plan would cut the model into stages (``policy.staging``), replay each
device's stages and add up their ops (``cost.timing``, ``cost.memory``). Here the stages are cut by
``stage_cuts`` on the full model's op FLOPs, each stage's sums are the copy's per-op facts times how
often each op repeats in it, and the rest is ``plan.summary``'s own code: ``schedule.simulate_totals`` for
the pipeline, ``cost.timing.sync_time``'s and ``update_time``'s pieces for the gradient
synchronisation and the optimizer step, ``cost.memory.weight_memory``, ``gradient_buckets`` and
``cost.moments`` for the memory at the peak moment, on the weights each device would store.

A sweep prices many configurations of few placements, so what does not depend on the target or
the configuration is worked out once: the weights each device holds and their buckets' bytes
(``Staged.kept``), each pipeline simulated once for the ZeRO stages that share it
(``Staged.simulated``).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import functools
import itertools
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from nbscaler.columns import MEMORY_CATEGORIES, SummaryColumn as C, SweepColumn as S
from nbscaler.config import ComputeConfig
from nbscaler.recipe import Recipe
from nbscaler.cost.hardware import Hardware
from nbscaler.cost.gathered import GatheredUnits
from nbscaler.cost.local import UnitEvent
from nbscaler.cost.memory import completed_units, gradient_buckets, unit_bytes_held, weight_memory
from nbscaler.cost.moments import GradientPaths, Gradients, step_peak
from nbscaler.cost.ranks import LocalWeight
from nbscaler.cost.roofline import skips_masked_pairs
from nbscaler.comm.unit_gathers import with_gathers
from nbscaler.cost.fsdp import (Gather, Release, Script, StagePlays, Work, block_extras, stage_plays, unit_bytes,
                                unit_seconds)
from nbscaler.cost.step_figures import (DeviceStep, PipelineParts, StepFigures, overlap_window, overlaps_communication,
                                        step_tokens)
from nbscaler.cost.timing import (bucket_seconds, exposed_sync, is_zero3, partial_ranks, partials_of, reduced_buckets,
                                  update_seconds, updated_numels)
from nbscaler.ir.graph import RECOMPUTE_REGION, REST_UNIT
from nbscaler.space.layer_facts import LayerFacts
from nbscaler.space.op_ledger import (BWD, FLOPS_AGAIN, FLOPS_B, FLOPS_F, FWD, MASKED_B, MASKED_F, SAVED, SAVED_TAIL,
                                     TP_BWD, TP_FWD)
from nbscaler.planning.stack import repeat_counts
from nbscaler.policy.staging import stage_cuts
from nbscaler.schedule import Block, PipelineGeometry, StepTotals, simulate_totals


class Staged:
    """The full model cut into ``nstages`` stages as ``stage_by_cost`` would cut it, with each
    stage's per-op sums on each tensor-parallel index (``sums[stage][index]``, a facts vector)."""

    def __init__(self, facts: LayerFacts, nstages: int, alike: Optional[Dict] = None):
        self.facts = facts
        # where the cuts fall and what the devices hold do not depend on the target: kept with the
        # placement's memo (LayerFacts.memo); only the sums of the ops' seconds are the target's own
        self._kept: Dict[Tuple, Any] = facts.memo.staged.setdefault(nstages, {})
        self.cuts = self.kept(("cuts",), lambda: stage_cuts(facts.flops, facts.expansion.layer_key, nstages))
        # what the devices hold follows from the copy's weights, where they are read and the cuts
        # alone: ``alike`` (a sweep's) shares it between placements that agree on those (the
        # copy traced at other micro-batch sizes)
        self._holds: Dict[Tuple, Any] = (self._kept if alike is None else
                                         alike.setdefault((_weights_id(facts, alike), tuple(self.cuts)), {}))
        self.sums = [[c @ m for m in facts.matrix] for c in self.kept(("counts",), lambda: self._counts(nstages))]
        for s, cut in enumerate(self.cuts, start=1):
            self.sums[s] = [v + d for v, d in zip(self.sums[s], facts.stage_start(cut))]
            self.sums[s - 1] = [v + d for v, d in zip(self.sums[s - 1], facts.stage_end(cut))]
        self._timelines: Dict[Tuple, Any] = {}
        self._scripts: Dict[Tuple, Script] = {}

    def _counts(self, nstages: int) -> List:
        """How often each op of the copy repeats in each stage (``planning.stack.repeat_counts``)."""
        bounds = [0, *self.cuts, len(self.facts.expansion)]
        return [repeat_counts(self.facts.expansion, bounds[s], bounds[s + 1]) for s in range(nstages)]

    def simulated(self, schedule, forward: List[float], backward: List[float], latency: float,
                  post: float, extra: Optional[Dict[Block, float]] = None) -> StepTotals:
        """``schedule.simulate_totals`` on these stage costs (and ``extra`` seconds of single
        blocks: ZeRO stage 3's waits), once per costs: the configurations that differ only in
        their ZeRO stage (1 or 2) or the target's memory play the same pipeline."""
        if schedule.ndevices == 1:          # nothing is sent: the send costs change nothing
            latency = post = 0.0
        key = (schedule.name, schedule.nstages, schedule.nmicros, schedule.ndevices, tuple(forward),
               tuple(backward), latency, post, frozenset((extra or {}).items()))
        if key not in self._timelines:
            self._timelines[key] = simulate_totals(schedule, forward, backward, latency, post, extra=extra)
        return self._timelines[key]

    def script(self, stage: int, index: int, reshard_after_forward: bool) -> Script:
        """ZeRO stage 3's ``cost.fsdp.Script`` of ``stage`` on tensor-parallel ``index``: the full
        model's ops of the stage, in order, as its section's instructions (the ops of one recomputed
        region, in one layer, one instruction), each with the seconds ``_pipeline`` sums and the
        units of the parameters it reads (each layer of the stack one, the rest ``REST_UNIT``), and
        what the stage's first layer adds (``LayerFacts.stage_start_rows``, each op's share in the run
        that holds it) and its sends (``stage_end``, at its end); its runs of compute between gather
        points made one (``cost.fsdp.compact``)."""
        key = (stage, index, reshard_after_forward)
        if key not in self._scripts:
            steps, counts, first = self.kept(("zero3 layout", stage, index, reshard_after_forward),
                                             lambda: self._layout(stage, index, reshard_after_forward))
            rows = self.facts.matrix[index]
            fwd, bwd = counts @ (rows[:, FWD] + rows[:, TP_FWD]), counts @ (rows[:, BWD] + rows[:, TP_BWD])
            if stage > 0:                       # each op of the layer after the cut adds its share of the start
                start = self.facts.stage_start_rows(self.cuts[stage - 1])[index]
                fwd += first[:, :len(start)] @ (start[:, FWD] + start[:, TP_FWD])
                bwd += first[:, :len(start)] @ (start[:, BWD] + start[:, TP_BWD])
            if stage < len(self.cuts):          # and the last its sends
                end = self.facts.stage_end(self.cuts[stage])[index]
                fwd[-1], bwd[-1] = fwd[-1] + end[TP_FWD], bwd[-1] + end[TP_BWD]
            self._scripts[key] = tuple(Work(float(fwd[s[0]]), float(bwd[s[0]]), s[1]) if isinstance(s, tuple) else s
                                       for s in steps)
        return self._scripts[key]

    def unit_events(self, stage: int, index: int, reshard_after_forward: bool) -> Tuple[UnitEvent, ...]:
        """ZeRO stage 3's gathers and frees in a forward of ``stage`` on tensor-parallel ``index``,
        each with the bytes saved for the backward before it, as ``cost.local``'s replay records
        them for ``cost.gathered`` (the memory model)."""
        key = ("zero3 events", stage, index, reshard_after_forward)
        if key not in self._scripts:
            steps, counts, _ = self.kept(("zero3 layout", stage, index, reshard_after_forward),
                                         lambda: self._layout(stage, index, reshard_after_forward))
            per_run = counts @ self.facts.matrix[index][:, SAVED]
            saved = float(self.facts.stage_start(self.cuts[stage - 1])[index][SAVED]) if stage > 0 else 0.0
            events = []
            for item in steps:
                if isinstance(item, tuple):
                    saved += float(per_run[item[0]])
                elif isinstance(item, Gather):
                    events.append(UnitEvent(True, item.unit, item.prefetch, int(saved)))
                else:
                    events.append(UnitEvent(False, item.unit, None, int(saved)))
            self._scripts[key] = tuple(events)
        return self._scripts[key]

    def _layout(self, stage: int, index: int, reshard_after_forward: bool):
        """What ``script`` lays out whatever the target: its gather and release points, and between
        them each run of compute as ``(run, units read)``, with how often each op of the copy falls
        in each run (``counts``, runs x ops) and which run holds each of the stage's first ops
        (``first``, runs x ops: ``[r, k]`` is 1 where full-model op ``start + k`` is in run ``r``)."""
        facts, exp = self.facts, self.facts.expansion
        stack = exp.stack
        reads = _param_readers(facts, index)
        bounds = [0, *self.cuts, len(exp)]
        entries: List[Tuple[Optional[Tuple], List[int], frozenset, List[int]]] = []
        if stage > 0:
            entries.append((None, [], frozenset(), []))      # the stage's start
        for v in range(bounds[stage], bounds[stage + 1]):
            j = int(exp.template[v])
            layer = (v - exp.before) // exp.size if exp.before <= v < exp.before + stack.depth * exp.size else None
            units = frozenset(REST_UNIT if stack.weight_layer(name) is None else f"{stack.path}.{layer}"
                              for name in reads.get(j, ()))
            region = exp.nodes[j].meta.get(RECOMPUTE_REGION)
            if region is not None and entries and entries[-1][0] == (region, layer):   # one recomputed region
                entries[-1][1].append(j)
                entries[-1][3].append(v - bounds[stage])
                entries[-1] = (entries[-1][0], entries[-1][1], entries[-1][2] | units, entries[-1][3])
            else:
                entries.append(((region, layer) if region is not None else None, [j], units, [v - bounds[stage]]))
        if stage + 1 < len(bounds) - 1:
            entries.append((None, [], frozenset(), []))      # its sends
        placed = with_gathers(entries, [e[2] for e in entries], reshard_after_forward,
                              lambda unit, prefetch: Gather(unit, prefetch), lambda unit, first, last: Release(unit))
        steps: List = []
        runs: List[List[int]] = []
        places: List[List[int]] = []              # each run's ops, as places in the stage
        for item in placed:
            if isinstance(item, (Gather, Release)):
                steps.append(item)
            elif steps and isinstance(steps[-1], tuple):
                runs[-1] += item[1]
                places[-1] += item[3]
                steps[-1] = (steps[-1][0], steps[-1][1] | item[2])
            else:
                runs.append(list(item[1]))
                places.append(list(item[3]))
                steps.append((len(runs) - 1, item[2]))
        ops = len(exp.nodes)
        counts = np.array([np.bincount(np.array(r, dtype=np.int64), minlength=ops) for r in runs], dtype=float)
        first = np.array([np.bincount(np.array([k for k in p if k < ops], dtype=np.int64), minlength=ops)
                          for p in places], dtype=float)
        return tuple(steps), counts.reshape(len(runs), ops), first.reshape(len(runs), ops)

    def stage_of(self, position: int) -> int:
        return bisect.bisect_right(self.cuts, position)

    def weights(self, index: int, stages: Tuple[int, ...]) -> List[LocalWeight]:
        """The weights a device of tensor-parallel ``index`` holding ``stages`` stores, in the
        runtime's order, as ``cost.ranks.local_weights`` lists them for the full plan."""
        return self.held(("weights", index, stages), lambda: list(self._expanded(index, stages)))

    def params(self, index: int, stages: Tuple[int, ...]) -> List[LocalWeight]:
        """The parameters among ``weights(index, stages)``."""
        return self.held(("params", index, stages), lambda: [w for w in self.weights(index, stages)
                                                              if w.kind == "param"])

    def kept(self, key: Tuple, make):
        """``make()``, once per ``key``, for every target: ``key`` must name all it depends on
        beyond this placement and stage count."""
        if key not in self._kept:
            self._kept[key] = make()
        return self._kept[key]

    def held(self, key: Tuple, make):
        """``kept`` for what depends on the weights the devices hold and not on the placement's
        activations: ``key`` must name all it depends on beyond those weights."""
        if key not in self._holds:
            self._holds[key] = make()
        return self._holds[key]

    def _expanded(self, index: int, stages: Tuple[int, ...]):
        """The copy's weights at full depth, those the device's ``stages`` read: each run of the
        stack's second layer's weights (its parameters, later its buffers) once per later layer,
        layer after layer, where the run sits."""
        stack = self.facts.expansion.stack
        listed = self.facts.weights[index]
        for i, (w, readers) in enumerate(listed):
            if stack.weight_layer(w.name) != 1:
                yield from self._held(w, readers, w.name, None, stages)
            elif i == 0 or stack.weight_layer(listed[i - 1][0].name) != 1:
                run = list(itertools.takewhile(lambda wr: stack.weight_layer(wr[0].name) == 1, listed[i:]))
                for k in range(1, stack.depth):
                    for w1, r1 in run:
                        yield from self._held(w1, r1, stack.renamed(w1.name, k), k, stages)

    def _held(self, w: LocalWeight, readers: Tuple[int, ...], name: str, layer: Optional[int],
              stages: Tuple[int, ...]):
        exp = self.facts.expansion
        held = {self.stage_of(v) for r in readers for v in exp.positions(r, layer)} & set(stages)
        if held:
            trained = tuple(sorted(held)) if w.trained else ()
            # its layout, group and slice kept; its ZeRO-3 unit, as the runtime's (read under stage 3 only)
            yield dataclasses.replace(w, name=name, stages=trained, unit=self.facts.expansion.stack.unit_of(name))


class _Device:
    """One plan device's part of a step: its sync and update seconds, FLOPs, tensor-parallel
    seconds and peak bytes. Devices of one pipeline device whose facts are alike (``LayerFacts.alike``)
    and whose groups cross the same links get the same figures, so each is worked out once."""

    def __init__(self, staged: Staged, cfg: ComputeConfig, geometry: PipelineGeometry, hardware: Hardware,
                 profiler, comm, recipe: Recipe,
                 peaks: Optional[Tuple[Dict, Tuple]] = None):
        self.staged, self.cfg, self.geometry, self.hardware = staged, cfg, geometry, hardware
        self.profiler, self.comm, self.recipe = profiler, comm, recipe
        self.peaks, self.peak_key = peaks if peaks is not None else ({}, (object(),))
        self._memo: Dict[Tuple, Tuple[float, float, float, float, float, float]] = {}

    def spans_nodes(self, ranks) -> bool:
        return len({self.hardware.node_of(r) for r in ranks}) > 1

    def figures(self, device: int, seconds) -> Tuple[float, float, float, float, float, float]:
        """``(sync s, update s, model FLOPs, hardware FLOPs, tp s, peak bytes)`` of ``device``;
        ``seconds(stage, index)`` gives a stage's forward and backward on a tensor-parallel index."""
        cfg, geometry = self.cfg, self.geometry
        pdev, index = geometry.pipeline_device(device), self.staged.facts.alike[device % geometry.tp]
        stages = tuple(geometry.schedule.stages_of(pdev))
        weights, params = self.staged.weights(index, stages), self.staged.params(index, stages)
        partials = self.staged.held(("partials", index, stages), lambda: partials_of(params))
        links = (self.spans_nodes([device + u * cfg.plan_ngpus for u in range(cfg.units)]),
                 *(self.spans_nodes(partial_ranks(device, kind)) for kind in partials))
        key = (pdev, index, links)
        if key not in self._memo:
            # the reduction hides in the backward only where the target's software overlaps it
            overlap = overlap_window((seconds(s, index)[1] for s in stages), self.hardware)
            sync = exposed_sync(bucket_seconds(cfg, device, self.comm, self._reduced(index, stages, params)), overlap)
            update = self._update(index, stages, params)
            peak_key = (*self.peak_key, pdev, index)      # the peak does not depend on the target's speeds
            if peak_key not in self.peaks:
                self.peaks[peak_key] = self._peak(weights, params, stages, index, device)
            self._memo[key] = (sync, update, *self._work(pdev, index), self.peaks[peak_key])
        return self._memo[key]

    def _reduced(self, index: int, stages: Tuple[int, ...], params: List[LocalWeight]):
        """``cost.timing.reduced_buckets`` of the device's parameters (the bytes ``sync_time`` reduces)."""
        return self.staged.held(("reduced", index, stages, self.cfg.reduce_bucket_bytes, self.recipe),
                                lambda: reduced_buckets(params, self.cfg, self.recipe))

    def _update(self, index: int, stages: Tuple[int, ...], params: List[LocalWeight]) -> float:
        """``cost.timing.update_time`` of the device's parameters."""
        cfg = self.cfg
        zero = cfg.grid.zero_group_size if cfg.use_zero else None
        numels = self.staged.held(("numels", index, stages, cfg.reduce_bucket_bytes, zero),
                                  lambda: updated_numels(params, cfg))
        return update_seconds(self.profiler, numels, params[0].dtype if params else None, self.recipe)

    def _work(self, pdev: int, index: int) -> Tuple[float, float, float]:
        """Model FLOPs, hardware FLOPs and tensor-parallel seconds of a device's blocks."""
        sums = self.staged.sums
        blocks = _block_counts(self.geometry.schedule, pdev)
        flops = sum(n * sums[s][index][FLOPS_F if p == "F" else FLOPS_B] for (s, p), n in blocks)
        again = sum(n * sums[s][index][FLOPS_AGAIN] for (s, p), n in blocks if p == "B")
        masked = (sum(n * sums[s][index][MASKED_F if p == "F" else MASKED_B] for (s, p), n in blocks)
                  if skips_masked_pairs(self.hardware) else 0.0)
        tp = sum(n * sums[s][index][TP_FWD if p == "F" else TP_BWD] for (s, p), n in blocks)
        return flops, flops + again - masked, tp

    def _peak(self, weights: List[LocalWeight], params: List[LocalWeight], stages: Tuple[int, ...], index: int,
              device: int) -> float:
        """``peak_bytes`` as ``cost.memory.memory_per_rank`` adds it up."""
        cfg, recipe = self.cfg, self.recipe
        # what the weights and the optimizer hold, and how the gradients are bucketed: the same for
        # every micro-batch count and schedule; of cfg they read the bucket size and ZeRO's stage and group
        zero = (cfg.zero_stage, cfg.grid.zero_group_size) if cfg.use_zero else None
        setting = (index, stages, cfg.reduce_bucket_bytes, cfg.inference_only, zero, recipe)
        row = dict(self.staged.held(("weight_memory", *setting), lambda: weight_memory(weights, cfg, recipe)))
        grads = Gradients(*self.staged.held(("gradients", *setting), lambda: gradient_buckets(weights, cfg, recipe)),
                          paths=self.staged.held(("gradient paths", *setting), GradientPaths))
        saved = {s: int(self.staged.sums[s][index][SAVED]) for s in stages}
        # a split backward's B frees the loss's saved bytes on the last stage, unless it is the first (no data path)
        held_for_w = {s: saved[s] - (int(self.staged.sums[s][index][SAVED_TAIL]) if s > 0 else 0) for s in stages}
        units = None
        if cfg.use_zero and cfg.zero_stage == 3:
            events = {s: self.staged.unit_events(s, index, cfg.zero_reshard_after_forward) for s in stages}
            units = GatheredUnits(unit_bytes_held(params, cfg, recipe), events, completed_units(params))
        held = step_peak(grads, params, saved, self.geometry, device, held_for_w, units)
        row[C.GRAD_BYTES], row[C.ACTIVATION_BYTES] = held.grad_bytes, held.activation_bytes
        row[C.GATHERED_BYTES] = held.gathered_bytes
        return float(sum(row[c] for c in MEMORY_CATEGORIES))


def _param_readers(facts: LayerFacts, index: int) -> Dict[int, List[str]]:
    """Op of the copy -> the names of the parameters on tensor-parallel ``index`` it reads."""
    out: Dict[int, List[str]] = {}
    for w, readers in facts.weights[index]:
        if w.kind == "param":
            for j in readers:
                out.setdefault(j, []).append(w.name)
    return out


class _Zero3:
    """ZeRO stage 3's collectives of configuration ``cfg`` (``cost.fsdp``), from the copy's facts as
    ``StepModel`` works them out from a full plan: per plan device its units' bytes and seconds on
    its ZeRO group's link and each of its stages played, the seconds each block waits (its stage
    group's slowest device's) and each device's wait in a step."""

    def __init__(self, staged: Staged, cfg: ComputeConfig, geometry: PipelineGeometry, hardware: Hardware, comm,
                 recipe: Recipe):
        self.geometry, schedule = geometry, geometry.schedule
        grid, overlap = cfg.grid, overlaps_communication(hardware)
        stack, n = staged.facts.expansion.stack, grid.zero_group_size
        self.plays: Dict[int, Dict[int, StagePlays]] = {}
        alike: Dict[Tuple, Dict[int, StagePlays]] = {}
        for device in range(cfg.plan_ngpus):
            pdev, index = geometry.pipeline_device(device), staged.facts.alike[device % geometry.tp]
            stages = tuple(schedule.stages_of(pdev))
            group, replicas = grid.zero_ranks(device), grid.zero_replica_ranks(device)
            # devices alike in their facts whose groups cross the same links play alike
            key = (index, stages, hardware.link(group), hardware.link(replicas),
                   len({hardware.node_of(r) for r in replicas}))
            if key not in alike:
                params = staged.params(index, stages)
                moved = staged.held(("zero3 units", index, stages, n, recipe),
                                    lambda: unit_bytes(params, stack.unit_of, n, recipe))
                seconds = unit_seconds(moved, comm, group, replicas)
                alike[key] = {s: stage_plays(staged.script(s, index, cfg.zero_reshard_after_forward), seconds,
                                             overlap, schedule.splits_backward) for s in stages}
            self.plays[device] = alike[key]
        self.extra = block_extras(schedule, {s: [self.plays[d][s] for d in geometry.stage_group(s)]
                                             for s in range(schedule.nstages)})

    def fsdp_s(self, device: int) -> float:
        """Seconds ``device``'s blocks wait for the collectives in one step (``StepModel.fsdp_seconds``)."""
        return sum(self.extra.get(b, 0.0) for b in self.geometry.schedule.blocks_of(self.geometry.pipeline_device(device)))


def _weights_id(facts: LayerFacts, alike: Dict) -> int:
    """A number naming the copy's weights on each tensor-parallel index, where each is read and the
    layers' layout: the same for placements alike in all of them (``Staged``'s ``alike``)."""
    if facts.memo.weights_id is None:
        e = facts.expansion
        what = (e.stack.path, e.stack.depth, e.before, e.size, e.after, tuple(tuple(ws) for ws in facts.weights))
        ids = alike.setdefault("ids", {})
        facts.memo.weights_id = ids.setdefault(what, len(ids))
    return facts.memo.weights_id


@functools.lru_cache(maxsize=1024)
def _block_counts(schedule, pdev: int) -> Tuple[Tuple[Tuple[int, str], int], ...]:
    """How many ``F`` and ``B`` blocks of each stage pipeline device ``pdev`` runs (``W`` carries
    no FLOPs of its own here: the backward's are counted at ``B``)."""
    counts = collections.Counter((b.stage, b.phase) for b in schedule.blocks_of(pdev) if b.phase != "W")
    return tuple(sorted(counts.items()))


def price(facts: LayerFacts, cfg: ComputeConfig, hardware: Hardware, profiler, comm, recipe: Recipe,
          staged: Optional[Staged] = None, peaks: Optional[Tuple[Dict, Tuple]] = None) -> Dict[str, Any]:
    """The sweep columns of the predictions (``SweepColumn``) for configuration ``cfg``, trained
    with ``recipe``.

    ``peaks``: a cache of peak bytes per device kept across targets, and the key of everything
    else they depend on (the placement, the stages, ``cfg`` and the recipe), so
    that pricing the same configuration on another target reuses them."""
    geometry = PipelineGeometry.from_config(cfg)
    staged = staged or Staged(facts, geometry.schedule.nstages)
    zero3 = _Zero3(staged, cfg, geometry, hardware, comm, recipe) if is_zero3(cfg) else None
    extra = zero3.extra if zero3 is not None else None
    seconds, line = _pipeline(facts, staged, geometry, comm, extra=extra)
    instant = _pipeline(facts, staged, geometry, comm, sends=False, extra=extra)[1]
    devices = _Device(staged, cfg, geometry, hardware, profiler, comm, recipe, peaks)
    figures = {d: devices.figures(d, seconds) for d in range(cfg.plan_ngpus)}
    parts = {d: DeviceStep(compute_s=line.makespan, sync_s=f[0], update_s=f[1], flops=f[2], hardware_flops=f[3],
                           tp_s=f[4], peak_bytes=f[5], fsdp_s=zero3.fsdp_s(d) if zero3 is not None else 0.0)
             for d, f in figures.items()}
    tokens = step_tokens(facts.tokens, cfg.pipeline_nmicros, cfg.units)
    busy = {d: instant.busy[geometry.pipeline_device(d)] for d in parts}
    step = StepFigures(parts, cfg.units, cfg.runtime_ngpus, hardware, hardware.peak_flops(facts.compute_dtype), tokens,
                       PipelineParts(line.makespan, instant.makespan, busy))
    return {S.STEP_TIME_S: step.step_time_s, S.TOKENS_PER_S: step.tokens_per_s, S.MFU: step.mfu, S.HFU: step.hfu,
            S.PEAK_BYTES: step.peak_bytes, S.FITS: step.fits, S.BUBBLE: step.bubble,
            S.TP_COMM_SHARE: step.tp_comm_share, S.DP_COMM_SHARE: step.dp_comm_share,
            S.PP_SEND_SHARE: step.pp_send_share, S.FSDP_COMM_SHARE: step.fsdp_comm_share}


def pipeline_seconds(facts: LayerFacts, cfg: ComputeConfig, comm, staged: Optional[Staged] = None) -> float:
    """The pipeline's makespan for ``cfg``: ``price``'s step time without the gradient
    synchronisation, the optimizer step and ZeRO stage 3's waits, so never more than it (a bound a
    search prunes with)."""
    geometry = PipelineGeometry.from_config(cfg)
    return _pipeline(facts, staged or Staged(facts, geometry.schedule.nstages), geometry, comm)[1].makespan


def _pipeline(facts: LayerFacts, staged: Staged, geometry: PipelineGeometry, comm, sends: bool = True,
              extra: Optional[Dict[Block, float]] = None):
    """Each stage's seconds on each tensor-parallel index (``seconds(stage, index)``: forward,
    backward) and the schedule's ``StepTotals`` on them (with ``extra`` seconds of single blocks:
    ZeRO stage 3's waits), with the sends' latency or (``sends=False``) none."""
    schedule, tp, sums = geometry.schedule, geometry.tp, staged.sums
    seconds = lambda s, i: (sums[s][i][FWD] + sums[s][i][TP_FWD], sums[s][i][BWD] + sums[s][i][TP_BWD])
    forward = [max(seconds(s, i)[0] for i in range(tp)) for s in range(schedule.nstages)]
    backward = [max(seconds(s, i)[1] for i in range(tp)) for s in range(schedule.nstages)]
    carried = [facts.carried(c) for c in staged.cuts]
    pairs = [(geometry.stage_group(s)[0], geometry.stage_group(s + 1)[0]) for s in range(len(carried))]
    latency = max((comm.p2p(b, ranks=pair) for (b, _), pair in zip(carried, pairs)), default=comm.p2p(0))
    post = comm.p2p_post(max((n for _, n in carried), default=0))
    return seconds, staged.simulated(schedule, forward, backward, latency if sends else 0.0, post, extra)


def saved_floor(staged: Staged, cfg: ComputeConfig) -> float:
    """Bytes some device surely holds at its peak: what its forwards save before its first
    backward releases any (``cost.moments.step_moments``'s activations at that moment), on its
    busiest tensor-parallel index. The peak also holds weights and gradients, so is never less."""
    schedule = PipelineGeometry.from_config(cfg).schedule
    most = 0.0
    for pdev in range(schedule.ndevices):
        first = list(itertools.takewhile(lambda b: b.phase != schedule.release_phase, schedule.blocks_of(pdev)))
        stages = [b.stage for b in first if b.phase == "F"]
        most = max(most, *(sum(staged.sums[s][i][SAVED] for s in stages) for i in range(len(staged.sums[0]))))
    return most
