"""autodist: search the placement of every op, scored by the cost model, and say why.

>>> pm = parallelize(model, args, "autodist", ComputeConfig(2, 4,                 # doctest: +SKIP
...                  pas_config={"memory_limit_bytes": 2 * 2**30}))
>>> print(nbscaler.plan(model, args, "autodist", cfg).explain())                  # doctest: +SKIP

For each op it chooses to replicate it or to split it along one of the dims its annotation allows,
on the unit's devices (or, in a pipeline, on its stage's devices). The cost of a plan is the time of
every op on its share, profiled on this device, plus the collectives its edges then need, from the
alpha-beta model (``search``); the search is exact where the graph allows (``search``'s docstring
says when it is not). Under ``memory_limit_bytes`` it weighs bytes against seconds, raising the
weight until the exact memory model says every device fits. With a pipeline, it also chooses where
to cut: balanced by FLOPs, or by the searched times at the layer boundaries (or at
``pipeline_pivots``), whichever the schedule simulator predicts to be faster.

It may also choose how many devices make a unit (``autodist_plan_ngpus='auto'``): a unit of one
device replicates everything, which is data parallelism, and a step then trains one batch per unit,
so candidates of different unit sizes (and stage counts) are compared by predicted time per batch.

For a target that is not this machine (``pas_config['hardware']``), ``nbscaler.plan`` first chooses
tp, pp, micro-batch, recomputation and ZeRO with ``nbscaler.sweep``'s prices
(``nbscaler.space.autodist``); this policy refuses such a config on a traced graph.

The knobs are ``pas_config`` keys (``options``), with ``recompute`` and ``recompute_modules`` taken as
given: the plans it scores recompute those regions (``nbscaler.policy.recompute``). When neither is given and no
plan fits ``memory_limit_bytes``, it recomputes every layer of the model's layer lists and searches
again (the plan's config then names them); ``planfile`` saves and loads a chosen plan;
``explain`` records, per op, the choice against the runner-up.

With ``pas_config={'sequence_parallel': True}`` the ``tp`` placement it weighs its search against
(``_keep_faster_builtin``) is sequence parallel (``nbscaler.policy.builtin``), with ``False`` it is
not, and without the key both compete: when the sequence-parallel one wins, the plan's config says
``sequence_parallel=True``. The search itself may split any op along the sequence whatever the key
says, as along any axis its annotation allows.
"""

from __future__ import annotations

import time
from typing import Dict, List, Optional, Tuple

from nbscaler.comm.layout import storage_layouts
from nbscaler.comm.placed import PlacedGraphs
from nbscaler.config import ComputeConfig
from nbscaler.cost import comm_model
from nbscaler.cost.memory import device_runs, memory_per_rank
from nbscaler.cost.timing import StepModel, profiler_for
from nbscaler.ir.graph import IRGraph, IRNode
from nbscaler.policy.autodist.candidates import candidate_configs, config_key, samples_per_step, with_unit
from nbscaler.policy.autodist.costs import ChoiceCosts, optimizer_state_factor
from nbscaler.policy.autodist.explain import explain_rows
from nbscaler.policy.autodist.options import AutodistOptions
from nbscaler.policy.autodist.planfile import load_plan, save_plan, saved_plan_ngpus
from nbscaler.policy.autodist.search import SearchResult, search
from nbscaler.policy.primitives import PolicyError, partition, replicate
from nbscaler.policy.recompute import RECOMPUTE_KEY, granularity, mark_recompute, recompute_names
from nbscaler.policy.staging import layer_of, stage_by_cost
from nbscaler.schedule import PipelineGeometry

__all__ = ["AutodistOptions", "autodist", "samples_per_step"]

#: The rival name of the sequence-parallel ``tp`` placement (``_keep_faster_builtin``).
TP_SEQUENCE_PARALLEL = "tp sequence parallel"

#: The heaviest weight on bytes autodist tries under a memory limit is its first weight times 2**this.
MAX_WEIGHT_STEPS = 24


def autodist(graph: IRGraph, cfg: ComputeConfig) -> IRGraph:
    """The autodist policy: place every node of ``graph`` as the search finds best."""
    opts = AutodistOptions.from_config(cfg)
    if (cfg.pas_config or {}).get("hardware") is not None:
        raise PolicyError("autodist on a target (pas_config['hardware']) chooses tp, pp and the micro-batch from "
                          "the module, so it runs from nbscaler.plan(module, ...) or parallelize, not on a traced "
                          "graph (replan); replan the plan it returned with policy='hybrid' instead.")
    if opts.load_plan_path:
        return _load(graph, cfg, opts)
    start = time.perf_counter()
    searcher, info = _search_configs(graph, cfg, opts)
    searcher.profiler.save()                  # op times profiled here serve the next search too
    info["search_s"] = time.perf_counter() - start
    graph.meta["autodist"] = info
    if opts.autodist_nstages is not None or opts.schedulers:
        graph.meta["pipeline_nstages"] = searcher.cfg.pipeline_nstages     # the planner adopts it
    if opts.schedulers and cfg.use_pipeline:
        graph.meta["pipeline_scheduler"] = searcher.cfg.scheduler          # and this
    if searcher.cfg.plan_ngpus != cfg.plan_ngpus:
        graph.meta["plan_ngpus"] = searcher.cfg.plan_ngpus                  # and this
    if opts.save_plan_path:
        save_plan(graph, searcher.cfg.plan_ngpus, opts.save_plan_path)
    return graph


def _load(graph: IRGraph, cfg: ComputeConfig, opts: AutodistOptions) -> IRGraph:
    """Place ``graph`` from a saved plan. Where the unit size is autodist's to choose
    (``autodist_plan_ngpus``), the file's unit size is taken, as the search that saved it chose it."""
    if opts.autodist_plan_ngpus is not None:
        saved = saved_plan_ngpus(opts.load_plan_path)
        if saved != cfg.plan_ngpus:
            cfg = with_unit(cfg, saved)
            graph.meta["plan_ngpus"] = saved
    return load_plan(graph, cfg.plan_ngpus, opts.load_plan_path, cfg.grid.stage_group)


def _keep_faster_builtin(graph: IRGraph, cfg: ComputeConfig, opts: AutodistOptions, searcher: "_Searcher",
                         info: dict) -> None:
    """Keep a built-in placement when the step model predicts it faster than the searched one.

    The search chooses each op's split from its annotation; some plans are made of moves it does not
    take, such as ``tp``'s split of a fused q/k/v projection by heads (a strided split). Each
    built-in that applies is placed, scored with the same step model and memory limit, and the
    fastest plan is kept; ``info['kept']`` says which, ``info['rival_scores']`` the predicted steps.
    Unless ``pas_config`` says whether to use sequence parallelism, ``tp`` competes both without and
    with it (``'tp sequence parallel'``).
    """
    from nbscaler.policy.builtin import SEQUENCE_PARALLEL, data, tp     # the built-ins register autodist
    rivals = {"tp": tp, "data": data}
    if SEQUENCE_PARALLEL not in cfg.pas_config:           # not the user's to say: autodist may choose it
        rivals[TP_SEQUENCE_PARALLEL] = lambda g, c: tp(g, c.with_changes(pas_config={SEQUENCE_PARALLEL: True}))
    scores = {"search": searcher.score()}
    for name, rival in rivals.items():
        try:
            rival(graph, cfg)
        except PolicyError:
            continue
        if opts.memory_limit_bytes is None or searcher.peak_bytes() <= opts.memory_limit_bytes:
            scores[name] = searcher.score()
    kept = min(scores, key=lambda k: (scores[k], k != "search"))
    if kept == "search":
        searcher.place(info["bytes_weight"])
    else:
        rivals[kept](graph, cfg)
    if kept == TP_SEQUENCE_PARALLEL:
        graph.meta[SEQUENCE_PARALLEL] = True              # the planner adopts it into the plan's config
    info["kept"], info["rival_scores"] = kept, scores


def _search_configs(graph: IRGraph, cfg: ComputeConfig, opts: AutodistOptions) -> Tuple["_Searcher", dict]:
    """Search under each candidate config; keep (place again) the one predicted fastest per sample.

    Configs with fewer devices per unit train more samples a step (more units), so they are
    compared by the predicted step time over the samples it trains."""
    configs = candidate_configs(cfg, opts)
    if len(configs) == 1:
        searcher, info, _ = _search_config(graph, configs[0], opts)
        return searcher, info
    scores: Dict[Tuple[int, int, str], float] = {}     # (plan_ngpus, nstages, scheduler) -> seconds per step
    failure: Optional[PolicyError] = None
    last = None                                        # the key and search of the placement the graph holds
    for candidate in configs:
        try:
            searcher, info, scores[config_key(candidate)] = _search_config(graph, candidate, opts)
            last = (config_key(candidate), searcher, info)
        except PolicyError as err:             # e.g. this stage count cannot meet the memory limit
            failure, last = err, None          # the graph may hold a part of the failed placement
    if not scores:
        raise failure
    by_key = {config_key(c): c for c in configs}
    per_sample = {k: s / samples_per_step(by_key[k]) for k, s in scores.items()}
    best = min(per_sample, key=lambda k: (per_sample[k], -k[0], k))   # ties: the larger unit, fewer stages
    chosen = by_key[best]
    if last is not None and last[0] == best:
        _, searcher, info = last
    else:
        searcher, info, _ = _search_config(graph, chosen, opts)            # place the winner again
    if opts.autodist_nstages is not None:
        info["nstages_scores"] = {k: s for (d, k, sched), s in scores.items()
                                  if d == chosen.plan_ngpus and sched == chosen.scheduler}
    if opts.schedulers:
        mine = [(sched, s) for (d, _, sched), s in scores.items() if d == chosen.plan_ngpus]
        info["scheduler_scores"] = {x: min(s for sched, s in mine if sched == x) for x in dict(mine)}
    if opts.autodist_plan_ngpus is not None:
        info["plan_ngpus"] = chosen.plan_ngpus
        info["unit_scores"] = {d: min(s for (size, *_), s in per_sample.items() if size == d)
                               for d in sorted({size for size, *_ in per_sample})}
    return searcher, info


def _search_config(graph: IRGraph, cfg: ComputeConfig, opts: AutodistOptions) -> Tuple["_Searcher", dict, float]:
    """Place ``graph`` under one candidate config: the search, then (without a pipeline, on more
    than one device) the built-in placements it is weighed against. Returns the searcher, the
    record of the search and the predicted step time of the placement kept."""
    searcher = _Searcher(graph, cfg, opts, cfg.grid.pipeline)
    info = searcher.run()
    if searcher.geometry is None and not opts.autodist_constraints and cfg.plan_ngpus > 1:
        _keep_faster_builtin(graph, cfg, opts, searcher, info)
        return searcher, info, info["rival_scores"][info["kept"]]
    return searcher, info, searcher.score()


class _Searcher:
    """One autodist run over one graph: stagings, the memory weight, and the record of it."""

    def __init__(self, graph: IRGraph, cfg: ComputeConfig, opts: AutodistOptions, geometry: Optional[PipelineGeometry]):
        self.graph, self.cfg, self.opts, self.geometry = graph, cfg, opts, geometry
        self.profiler = profiler_for(cfg)
        self.factor = optimizer_state_factor(opts.optimizer)
        self.costs: Dict[Tuple[int, ...], ChoiceCosts] = {}

    def costs_for(self, devices: Tuple[int, ...]) -> ChoiceCosts:
        if devices not in self.costs:
            comm = comm_model.load(comm_model.local_backend(self.cfg.runtime_ngpus), nranks=len(devices))
            self.costs[devices] = ChoiceCosts(self.graph, devices, self.profiler, comm, self.factor,
                                               self.cfg.sums_partial_grads_after_backward)
        return self.costs[devices]

    # -- one placement for a given staging and memory weight -----------------------------------
    def place(self, weight: float) -> Tuple[List[SearchResult], List[dict]]:
        results, rows = [], []
        for stage, nodes, devices in self.sections():
            costs = self.costs_for(devices)
            result = search(nodes, costs, self.opts.pin_of, weight, self.opts.autodist_max_states)
            for node in nodes:
                choice = result.choices[id(node)]
                if choice is None:
                    replicate(node, devices)
                else:
                    partition(node, choice, devices)
            options = {id(n): costs.choices(n, self.opts.pin_of(n.module_path)) for n in nodes}
            rows += explain_rows(nodes, result.choices, costs, options, weight, stage)
            results.append(result)
        return results, rows

    def sections(self) -> List[Tuple[Optional[int], List[IRNode], Tuple[int, ...]]]:
        if self.geometry is None:
            return [(None, list(self.graph.nodes), self.cfg.grid.stage_group(None))]
        return [(s, [n for n in self.graph.nodes if n.stage == s], self.geometry.stage_group(s))
                for s in range(self.geometry.schedule.nstages)]

    def peak_bytes(self) -> int:
        """The most bytes a device holds, with the largest rebuild of a recomputed module on top."""
        placed = self._placed()
        runs = device_runs(placed)
        memory = memory_per_rank(placed, self.opts.recipe, runs=runs)
        rebuilt = max((b for stages in runs.values() for run in stages.values() for b in run.rebuilt.values()),
                      default=0)
        return int(memory["peak_bytes"].max()) + rebuilt

    # -- the whole run ----------------------------------------------------------------------------
    def run(self) -> dict:
        stagings = self.stagings() if self.geometry is not None else [("none", None)]
        best = None
        for name, stages in stagings:
            if stages is not None:
                for node, s in zip(self.graph.nodes, stages):
                    node.stage = s
            results, rows, weight, peak = self.fit_memory()
            score = self.score() if len(stagings) > 1 else None
            if best is None or (score is not None and score < best["score"]):
                best = {"staging": name, "stages": stages, "score": score, "weight": weight}
        if len(stagings) > 1 and best["staging"] != name:          # place the winner again
            for node, s in zip(self.graph.nodes, best["stages"]):
                node.stage = s
            results, rows, weight, peak = self.fit_memory()
        return {"rows": rows, "exact": all(r.exact for r in results), "states": max(r.states for r in results),
                "bytes_weight": weight, "peak_bytes": peak, "memory_limit_bytes": self.opts.memory_limit_bytes,
                "chose_recompute": self.graph.meta.get(RECOMPUTE_KEY),
                "staging": best["staging"], "stagings": [n for n, _ in stagings]}

    def fit_memory(self):
        """Search with no weight on bytes; under a limit, first check that the leanest plan fits,
        then find the smallest weight on bytes (a power of two from small) whose plan fits: the
        fastest plan that does. The weights are bisected: a heavier weight never keeps more bytes.

        The modules of ``recompute_modules`` are recomputed in every plan scored (their regions
        depend on the stages, so they are marked again for each staging)."""
        mark_recompute(self.graph, self.cfg)
        results, rows = self.place(0.0)
        limit = self.opts.memory_limit_bytes
        if limit is None:
            return results, rows, 0.0, None
        peak = self.peak_bytes()
        if peak <= limit:
            return results, rows, 0.0, peak
        base = (sum(r["op_s"] + r["comm_s"] for r in rows) or 1.0) / max(sum(r["bytes"] for r in rows), 1.0) / 16
        fits = {}                                              # exponent -> (results, rows, peak) of a plan that fits
        lean_results, lean_rows = self.place(base * 2 ** MAX_WEIGHT_STEPS)     # bytes outweigh any time saved
        lean_peak = self.peak_bytes()
        if lean_peak > limit and self.recompute_layers():
            return self.fit_memory()
        if lean_peak > limit:
            raise PolicyError(f"autodist found no plan that fits memory_limit_bytes={limit:,} per device: the "
                              f"leanest needs {lean_peak:,} bytes. Use more devices per unit (plan_ngpus), ZeRO "
                              "(use_zero=True), a pipeline, or a higher limit.")
        fits[MAX_WEIGHT_STEPS] = (lean_results, lean_rows, lean_peak)
        low, high = -1, MAX_WEIGHT_STEPS                       # low does not fit (weight 0), high does
        while high - low > 1:
            middle = (low + high) // 2
            results, rows = self.place(base * 2 ** middle)
            peak = self.peak_bytes()
            if peak <= limit:
                high, fits[middle] = middle, (results, rows, peak)
            else:
                low = middle
        if high != middle:                                     # the last plan placed did not fit
            self.place(base * 2 ** high)
        results, rows, peak = fits[high]
        return results, rows, base * 2 ** high, peak

    def recompute_layers(self) -> bool:
        """When no plan fits and the user named no modules to recompute (nor said ``recompute``):
        recompute every layer of the model's layer lists (ModuleLists and the like) and say so in
        ``graph.meta``, which the planner adopts into the plan's config. ``False`` when that was done
        already or there are none."""
        layers = [p for p in self.graph.meta.get("module_containers", ())
                  if any(n.module_path.startswith(p + ".") for n in self.graph.nodes)]
        if recompute_names(self.cfg) or granularity(self.cfg) is not None or not layers:
            return False
        self.cfg = self.cfg.with_changes(pas_config={RECOMPUTE_KEY: layers})
        self.graph.meta[RECOMPUTE_KEY] = layers
        return True

    def stagings(self) -> List[Tuple[str, List[int]]]:
        """Candidate stage assignments: by FLOPs, and by searched time at the allowed cuts."""
        nstages = self.geometry.schedule.nstages
        by_flops = stage_by_cost(self.graph, nstages)
        by_time = balanced_cuts(self.graph, nstages, self.node_seconds(), self.cut_points())
        return [("flops", by_flops)] + ([("time", by_time)] if by_time != by_flops else [])

    def node_seconds(self) -> List[float]:
        """Each op's time under the tensor-parallel search a stage would run (one stage's devices)."""
        devices = self.geometry.stage_group(0)
        costs = self.costs_for(devices)
        result = search(self.graph.nodes, costs, self.opts.pin_of, 0.0, self.opts.autodist_max_states)
        return [costs.op_seconds(n, result.choices[id(n)]) for n in self.graph.nodes]

    def cut_points(self) -> List[int]:
        """Positions a stage may start at: before each pivot module, or where the layer changes."""
        nodes = self.graph.nodes
        pivots = self.opts.pipeline_pivots
        if pivots:
            points = [next((i for i, n in enumerate(nodes) if n.module_path == p or n.module_path.startswith(p + ".")), None)
                      for p in pivots]
            missing = [p for p, i in zip(pivots, points) if i is None]
            if missing:
                raise PolicyError(f"pipeline_pivots {missing} name no module of the traced graph; pivots are module "
                                  f"paths such as {sorted({layer_of(n.module_path) for n in nodes})[:4]}.")
            return sorted({i for i in points if i > 0})
        return [i for i in range(1, len(nodes)) if layer_of(nodes[i].module_path) != layer_of(nodes[i - 1].module_path)]

    def score(self) -> float:
        """The predicted step time of the current placement on its slowest rank: the schedule
        simulator's makespan (without a pipeline, one sample), the gradient synchronisation and
        the step of ``memory_optimizer``."""
        model = StepModel(self._placed(), profiler=self.profiler)
        nsamples = self.cfg.pipeline_nmicros if self.cfg.use_pipeline else 1
        return max(d.step_time_s for d in model.device_steps(nsamples, self.opts.recipe).values())

    def _placed(self) -> PlacedGraphs:
        """The current placement as the cost model reads it: scored as the one graph of a step,
        whatever its mode."""
        return PlacedGraphs({"any": self.graph}, self._storage(), self.cfg, self.geometry)

    def _storage(self):
        return storage_layouts([self.graph], self.cfg.sums_partial_grads_after_backward)


def balanced_cuts(graph: IRGraph, nstages: int, seconds: List[float], points: List[int]) -> List[int]:
    """Stages (one per node) cut at ``points`` so that the slowest stage is as fast as it can be."""
    n = len(seconds)
    if len(points) < nstages - 1:
        raise PolicyError(f"the graph has {len(points)} places to cut it into pipeline stages, but {nstages} "
                          f"stages need {nstages - 1}; name more pipeline_pivots or use fewer stages.")
    prefix = [0.0]
    for s in seconds:
        prefix.append(prefix[-1] + s)
    bounds = [0] + points + [n]
    # best[k][j]: the slowest stage when the first k stages cover nodes up to bounds[j]
    inf = float("inf")
    best = [[inf] * len(bounds) for _ in range(nstages + 1)]
    back = [[0] * len(bounds) for _ in range(nstages + 1)]
    best[0][0] = 0.0
    for k in range(1, nstages + 1):
        for j in range(1, len(bounds)):
            for i in range(j):
                cost = max(best[k - 1][i], prefix[bounds[j]] - prefix[bounds[i]])
                if cost < best[k][j]:
                    best[k][j], back[k][j] = cost, i
    stages, j = [0] * n, len(bounds) - 1
    for k in range(nstages, 0, -1):
        i = back[k][j]
        for pos in range(bounds[i], bounds[j]):
            stages[pos] = k - 1
        j = i
    return stages
