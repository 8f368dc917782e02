"""``nbscaler.sweep``: every configuration of a training run on a target, priced, in one table.

The question before a real run is not one plan but which: tp 4 or 8, how many pipeline stages,
which micro-batch, recompute or not, ZeRO 1 or 2. ``sweep`` answers it for every combination of
the ranges given, with the predictions ``plan.summary(hardware=...)`` makes for each, in seconds:

>>> frame = nbscaler.sweep(model, {"input_ids": ids}, Hardware.named("H100-SXM-80GB", nodes=8),
...                        global_batch=256, tp=(2, 4, 8), pp=(1, 2, 4, 8))      # doctest: +SKIP
>>> frame[frame.fits].head()            # fastest first (``nbscaler.columns.SweepColumn``)

How it prices. Each configuration is the ``hybrid`` policy with its ``tp`` inside each of ``pp``
stages, ``dp = GPUs / (tp * pp)`` units, a pipeline (of one stage when ``pp`` is 1: gradient
accumulation; ``pp * virtual_stages`` stages under a scheduler that interleaves) over
``global_batch / (dp * micro_batch)`` micro-batches, the model's repeated
layers recomputed or not, and ZeRO's stage (``config_of`` builds that ``ComputeConfig``). Planning
each one whole (trace, place, replay every device on fake tensors) takes tens of seconds per
configuration at 70B (``benchmarks/results/sweep.md``); instead:

1. the model's repeated layers are found (``planning.stack``: ``model.layers``, 80 of them), and a
   copy with two layers is traced once per micro-batch size and placed once per (tp,
   recompute): a handful of small plans;
2. each such plan's ops are priced once on the target (``LayerFacts``: every op's roofline time,
   its tensor-parallel collectives' NCCL time, saved bytes, FLOPs, per tensor-parallel index);
3. per configuration, the full model's stages are cut where ``stage_by_cost`` cuts them (on the
   full depth's op FLOPs, with the second layer standing for every layer after the first), each
   stage sums its ops' facts (plus what a stage's first layer saves of the tensors it receives,
   ``LayerFacts.stage_start``), and the pipeline, the gradient synchronisation, the optimizer step
   and the peak memory come from the very functions ``plan.summary`` calls (``planning.pricing``).

So a row is what ``nbscaler.plan(module, ..., "hybrid", config_of(row, ...)).summary(optimizer,
hardware=hardware, master_dtype=master_dtype)`` predicts, as long as every layer after the first
costs what the second does in the copy (one class, one shape, called in order) and the stages are
cut between layers (a cut inside a layer, for more stages than layers, is priced as if the layer's
recomputed region were whole);
``tests/planning/test_sweep.py`` checks rows against full plans. Sequence parallelism is not swept.

Bad input: a range value that cannot work on the target at all (a ``tp`` or ``pp`` that does not
divide its GPUs, more stages than the model has layers, a size below 1) raises ``ValueError``;
a combination that cannot run (``tp * pp`` not dividing the GPUs, a global batch that ``dp *
micro_batch`` does not divide, a scheduler's rule, a placement the policy refuses, e.g. heads
that ``tp`` does not divide) is left out, with its reason, in ``frame.attrs["excluded"]``.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Type

import pandas as pd
import torch
from tqdm.auto import tqdm

from nbscaler.columns import SweepColumn as S
from nbscaler.config import ComputeConfig, Precision
from nbscaler.cost.hardware import Hardware
from nbscaler.cost.nccl import NcclModel
from nbscaler.cost.roofline import RooflineOps
from nbscaler.planning.layer_facts import LayerFacts, read_facts
from nbscaler.planning.pricing import Staged, pipeline_seconds, price, saved_floor
from nbscaler.planning.stack import Stack, find_stack, one_sequence, shallow
from nbscaler.policy.primitives import PolicyError

CONFIG_COLUMNS = (S.TP, S.PP, S.DP, S.MICRO_BATCH, S.MICRO_BATCHES, S.RECOMPUTE, S.ZERO_STAGE, S.SCHEDULER,
                  S.VIRTUAL_STAGES)
PREDICTION_COLUMNS = (S.STEP_TIME_S, S.TOKENS_PER_S, S.MFU, S.HFU, S.PEAK_BYTES, S.FITS, S.BUBBLE,
                      S.TP_COMM_SHARE, S.DP_COMM_SHARE, S.PP_SEND_SHARE)


def config_of(row, ngpus: int, stack_path: str) -> ComputeConfig:
    """The ``ComputeConfig`` of a sweep row (a mapping with the configuration columns) on
    ``ngpus`` GPUs, recomputing the layers at ``stack_path`` (``frame.attrs["stack"]``)."""
    tp, pp, zero = int(row[S.TP]), int(row[S.PP]), int(row[S.ZERO_STAGE])
    virtual_stages = int(row[S.VIRTUAL_STAGES])
    pas = {"recompute_modules": [stack_path]} if bool(row[S.RECOMPUTE]) else {}
    return ComputeConfig(tp * pp, ngpus, use_end2end=True, use_pipeline=True, pipeline_nstages=pp * virtual_stages,
                         pipeline_nmicros=int(row[S.MICRO_BATCHES]), pipeline_scheduler=str(row[S.SCHEDULER]),
                         use_zero=zero > 0, zero_stage=max(zero, 1), pas_config=pas)


def sweep(module: torch.nn.Module, dummy_args: Dict[str, Any], hardware: Hardware, *, global_batch: int,
          tp: Optional[Sequence[int]] = None, pp: Optional[Sequence[int]] = None,
          micro_batch: Optional[Sequence[int]] = None, recompute: Sequence[bool] = (False, True),
          zero_stage: Sequence[int] = (0, 1, 2), optimizer: Type[torch.optim.Optimizer] = torch.optim.AdamW,
          master_dtype: Optional[torch.dtype] = torch.float32, module_dtype: Optional[torch.dtype] = torch.bfloat16,
          scheduler: str = "1f1b", virtual_stages: Sequence[int] = (1,), progress: bool = True,
          prune: Optional[float] = None, **optimizer_kwargs: Any) -> pd.DataFrame:
    """Every configuration of ``module`` on ``hardware`` the ranges allow, priced (see the module
    docstring for how). ``dummy_args`` hold one sequence; ``global_batch`` counts sequences per step.

    ``tp``, ``pp``: sizes to try (``None``: every divisor of the target's GPUs, ``pp`` at most the
    model's layers); ``micro_batch``: sequences per micro-batch (``None``: every divisor of the
    global batch); ``recompute``: the model's repeated layers recomputed or not; ``zero_stage``:
    0 (no ZeRO), 1, 2; ``scheduler``: the pipeline scheduler (``nbscaler.schedule``), with
    ``virtual_stages`` stages per pipeline device where it takes several (``1f1b_interleaved``;
    ``zbv`` always has two). Returns one row per configuration with the columns of
    ``nbscaler.columns.SweepColumn``, the fitting ones first, each group fastest first;
    ``frame.attrs`` holds ``"stack"`` (the layers recomputed) and ``"excluded"`` (a frame of the
    combinations left out and why).

    ``prune`` is for a search that wants the fastest fitting rows (autodist on a target): with
    ``prune=1.25``, the frame holds each tp x pp layout's fastest fitting row where that is within
    25% of the fastest of all (``prune=1``: that row alone), each as fast as the full sweep's, and
    only what was priced to find them. A combination is not priced when its pipeline's makespan
    alone (``pricing.pipeline_seconds``, never more than the step) is already too slow, or when
    what it saves for the backward alone cannot fit (``_pruned``); ``frame.attrs["pruned"]``
    counts them."""
    if hardware.is_local:
        raise ValueError("sweep prices on a target: pass a Hardware such as Hardware.named('H100-SXM-80GB'); "
                         "Hardware.local() would profile every op at full size on this machine.")
    if prune is not None and not (isinstance(prune, (int, float)) and not isinstance(prune, bool) and prune >= 1):
        raise ValueError(f"sweep's prune={prune!r}: give a factor >= 1 (e.g. 1.25: each layout's fastest fitting "
                         "row within 25% of the fastest), or None to price every configuration.")
    stack = find_stack(module)
    ranges = _ranges(hardware, stack, global_batch, tp, pp, micro_batch, recompute, zero_stage)
    pricer = _Pricer(module, dummy_args, stack, hardware, module_dtype)
    precision = Precision(master_dtype)

    def priced(facts: LayerFacts, cfg: ComputeConfig, staged: Staged) -> Dict[str, Any]:
        return price(facts, cfg, hardware, pricer.ops, pricer.comm, optimizer, optimizer_kwargs, precision, staged)

    rows, excluded, runnable = [], [], []
    combos = list(itertools.product(*ranges, _virtual_stages(scheduler, virtual_stages)))
    for t, p, m, r, z, v in tqdm(combos, desc="sweep", unit="config", disable=not progress):
        config = {S.TP: t, S.PP: p, S.DP: hardware.ngpus // (t * p) if hardware.ngpus % (t * p) == 0 else 0,
                  S.MICRO_BATCH: m, S.RECOMPUTE: r, S.ZERO_STAGE: z, S.SCHEDULER: scheduler, S.VIRTUAL_STAGES: v}
        reason = _combination_problem(hardware, global_batch, t, p, m)
        if reason is None:
            config[S.MICRO_BATCHES] = global_batch // (config[S.DP] * m)
            try:
                cfg = config_of(config, hardware.ngpus, stack.path)
                facts = pricer.facts(m, t, r)
                staged = pricer.staged(facts, m, t, r, cfg.pipeline_nstages)
                if prune is not None:
                    runnable.append((pipeline_seconds(facts, cfg, pricer.comm, staged), config, cfg, facts, staged))
                else:
                    rows.append({**config, **priced(facts, cfg, staged)})
                continue
            except (ValueError, PolicyError) as err:
                reason = str(err)
        excluded.append({**config, "reason": reason})
    if prune is not None:
        rows += _pruned(runnable, priced, hardware, float(prune))
    frame = _frame(rows, excluded, stack)
    frame.attrs["pruned"] = len(runnable) - len(rows) if prune is not None else 0
    return frame


def _pruned(runnable: List[Tuple], priced: Callable, hardware: Hardware, within: float) -> List[Dict]:
    """The rows a pruned sweep prices, in the order of the pipeline's makespan (a floor of the
    step): not those whose floor reaches their tp x pp layout's fastest fitting step, or
    ``within`` times the fastest fitting step of all; not those whose saved activations alone
    (``pricing.saved_floor``) overflow the target, but for the first (the fastest, were memory no
    object)."""
    rows: List[Dict] = []
    fastest: Dict[Tuple[int, int], float] = {}           # per layout: its fastest fitting step so far
    for k, (floor, config, cfg, facts, staged) in enumerate(sorted(runnable, key=lambda r: r[0])):
        layout = (config[S.TP], config[S.PP])
        if floor >= min(fastest.get(layout, float("inf")), within * min(fastest.values(), default=float("inf"))):
            continue
        if k > 0 and not hardware.fits(saved_floor(staged, cfg)):
            continue
        rows.append({**config, **priced(facts, cfg, staged)})
        if rows[-1][S.FITS]:
            fastest[layout] = min(fastest.get(layout, float("inf")), rows[-1][S.STEP_TIME_S])
    return rows


def _virtual_stages(scheduler: str, values: Sequence[int]) -> List[int]:
    """The stages per pipeline device to try: the scheduler's own number where it has one."""
    from nbscaler.schedule.schedulers import scheduler_spec
    fixed = scheduler_spec(scheduler).stages_per_device
    if fixed is not None:
        return [fixed]
    bad = [v for v in values if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    if bad or not values:
        raise ValueError(f"sweep's virtual_stages={tuple(values)!r}: give whole numbers >= 1.")
    return list(values)


def _frame(rows: List[Dict], excluded: List[Dict], stack: Stack) -> pd.DataFrame:
    columns = [str(c) for c in CONFIG_COLUMNS + PREDICTION_COLUMNS]
    if not rows:
        reasons = "; ".join(sorted({e["reason"] for e in excluded}))
        raise ValueError(f"no configuration of the sweep can run: {reasons}")
    frame = pd.DataFrame([{str(k): v for k, v in r.items()} for r in rows], columns=columns)
    frame = frame.sort_values([str(S.FITS), str(S.STEP_TIME_S)], ascending=[False, True], kind="stable")
    frame = frame.reset_index(drop=True)
    frame.attrs["stack"] = stack.path
    frame.attrs["excluded"] = pd.DataFrame([{str(k): v for k, v in e.items()} for e in excluded])
    return frame


def _divisors(n: int) -> List[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _ranges(hardware: Hardware, stack: Stack, global_batch: int, tp, pp, micro_batch, recompute,
            zero_stage) -> Tuple[List, ...]:
    """The values to combine, each checked on its own (``ValueError`` naming the bad one)."""
    if not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch={global_batch!r} must be a whole number of sequences >= 1.")
    gpus = hardware.ngpus
    tp = list(tp) if tp is not None else _divisors(gpus)
    pp = list(pp) if pp is not None else [d for d in _divisors(gpus) if d <= stack.depth]
    micro_batch = list(micro_batch) if micro_batch is not None else _divisors(global_batch)
    for name, values in (("tp", tp), ("pp", pp), ("micro_batch", micro_batch)):
        bad = [v for v in values if not isinstance(v, int) or isinstance(v, bool) or v < 1]
        if bad or not values:
            raise ValueError(f"sweep's {name}={values!r}: give whole numbers >= 1.")
    for name, values in (("tp", tp), ("pp", pp)):
        bad = [v for v in values if gpus % v]
        if bad:
            raise ValueError(f"sweep's {name} values {bad} do not divide the {gpus} GPUs of {hardware.name} "
                             f"x {hardware.nodes} node(s); use divisors of {gpus}: {_divisors(gpus)}.")
    if max(pp) > stack.depth:
        raise ValueError(f"sweep's pp={max(pp)} is more stages than the {stack.depth} layers of {stack.path}; "
                         f"use pp <= {stack.depth}.")
    bad = [z for z in zero_stage if z not in (0, 1, 2)]
    if bad or not zero_stage:
        raise ValueError(f"sweep's zero_stage={tuple(zero_stage)!r}: use 0 (no ZeRO), 1 or 2.")
    recompute = [bool(r) for r in recompute]
    return tp, pp, micro_batch, recompute, list(zero_stage)


def _combination_problem(hardware: Hardware, global_batch: int, tp: int, pp: int, micro: int) -> Optional[str]:
    """Why ``tp`` x ``pp`` with ``micro``-sequence micro-batches cannot run, or ``None``."""
    if hardware.ngpus % (tp * pp):
        return f"tp x pp = {tp * pp} does not divide the {hardware.ngpus} GPUs"
    dp = hardware.ngpus // (tp * pp)
    if global_batch % (dp * micro):
        return f"the global batch {global_batch} is not a multiple of dp x micro_batch = {dp} x {micro}"
    return None


class _Pricer:
    """The sweep's caches: one trace of the two-layer copy per micro-batch size, one placement and
    one ``LayerFacts`` per (micro-batch, tp, recompute), one staging per number of stages."""

    def __init__(self, module: torch.nn.Module, dummy_args: Dict[str, Any], stack: Stack, hardware: Hardware,
                 module_dtype: Optional[torch.dtype]):
        self.two = copy.deepcopy(shallow(module, stack, 2))    # its own weights: module_dtype casts them
        self.args, self.stack, self.module_dtype = dummy_args, stack, module_dtype
        self.ops, self.comm = RooflineOps(hardware), NcclModel(hardware)
        self._traced: Dict[int, Any] = {}
        self._facts: Dict[Tuple[int, int, bool], Any] = {}      # LayerFacts, or why not
        self._staged: Dict[Tuple, Staged] = {}

    def _copy_config(self, tp: int, recompute: bool) -> ComputeConfig:
        pas = {"recompute_modules": [self.stack.path]} if recompute else {}
        return ComputeConfig(tp, tp, use_end2end=True, use_pipeline=True, pipeline_nstages=1, pipeline_nmicros=1,
                             pipeline_scheduler="1f1b", pas_config=pas)

    def facts(self, micro: int, tp: int, recompute: bool) -> LayerFacts:
        """The copy's facts at ``micro`` sequences, ``tp`` and ``recompute``; a placement the
        policy refuses (or one that splits no heads) raises, once and again from the cache."""
        key = (micro, tp, recompute)
        if key not in self._facts:
            try:
                self._facts[key] = read_facts(self._placed(micro, tp, recompute), self.stack, self.ops, self.comm)
            except (ValueError, PolicyError) as err:
                self._facts[key] = err
        found = self._facts[key]
        if isinstance(found, Exception):
            raise found
        return found

    def _placed(self, micro: int, tp: int, recompute: bool):
        from nbscaler.planning.planner import plan
        cfg = self._copy_config(tp, recompute)
        if micro not in self._traced:
            placed = plan(self.two, one_sequence(self.args, micro), "hybrid", cfg, module_dtype=self.module_dtype)
            self._traced[micro] = placed
        else:
            placed = self._traced[micro].replan(compute_config=cfg)
        whole = [n for n in placed.graph.nodes if n.op == "attention" and n.placement.split is None]
        if tp > 1 and whole:
            heads = whole[0].inputs[0].shape[1]
            raise ValueError(f"tp={tp} does not divide the {heads} attention heads, so every device of a group "
                             f"would run attention whole; use a tp that divides {heads}")
        return placed

    def staged(self, facts: LayerFacts, micro: int, tp: int, recompute: bool, nstages: int) -> Staged:
        key = (micro, tp, recompute, nstages)
        if key not in self._staged:
            self._staged[key] = Staged(facts, nstages)
        return self._staged[key]
