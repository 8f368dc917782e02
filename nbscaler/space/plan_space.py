"""``PlanSpace``: a sweep that stays alive, re-priced in milliseconds when the target or the run changes.

``nbscaler.sweep`` answers "which configuration?" once. In the Explorer the user then turns the
question's own knobs (another GPU, more nodes, bf16 or fp32, a bigger batch, longer sequences) and
expects the answer at once. ``PlanSpace`` keeps what a sweep built and re-prices from it:

>>> space = PlanSpace(model, {"input_ids": ids}, Hardware.named("H100-SXM-80GB"), global_batch=64,
...                   micro_batch=(1, 2, 4))                                       # doctest: +SKIP
>>> space.frame                                         # the sweep's table
>>> space.set(hardware="A100-SXM-80GB", nodes=2)        # re-priced: no trace, no placement

What each knob costs, from cheapest:

- ``recipe`` (or ``master_dtype``, ``grad_reduce_dtype``), ``global_batch``: only the pricing (``space.pricing.price``) runs again; a
  global batch that ``micro_batch=None`` turns into new micro-batch sizes traces those sizes.
- ``hardware``, ``nodes``, ``gpus_per_node``: every op's facts are read again on the new target
  (``LayerFacts``) off the placements kept; nothing is traced or placed (a new ``tp`` the new GPU
  count allows is placed, from the trace kept), and a configuration priced before keeps its peak
  memory per device (it depends on the placement, not on the target's speeds).
- ``module_dtype`` (the recipe's), ``sequence``: the two-layer copy is traced again (its tensors' dtype or shape
  change), once per micro-batch size. What was built for earlier values is kept, so turning a knob
  back costs only the pricing.

``sweep()`` is ``PlanSpace(...).frame``: one pricing path for both.
"""

from __future__ import annotations

import copy
import gc
import itertools
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pandas as pd
import torch
from tqdm.auto import tqdm

from nbscaler.columns import SweepColumn as S
from nbscaler.comm.layout import storage_layouts
from nbscaler.config import ComputeConfig
from nbscaler.cost.hardware import Hardware
from nbscaler.cost.memory import paused_gc
from nbscaler.cost.nccl import NcclModel
from nbscaler.cost.roofline import RooflineOps
from nbscaler.cost.timing import products_of, target_models
from nbscaler.space.layer_facts import LayerFacts, PlacementMemo, read_facts
from nbscaler.space.op_ledger import Kinds
from nbscaler.space.pricing import Staged, pipeline_seconds, price
from nbscaler.space.prune import check_prune, pruned_rows
from nbscaler.space.ranges import (CONTEXT_KIND_VALUES, RECOMPUTE_VALUES, Ranges, at_software, checked_ranges,
                                   combination_problem, context_kind_at, reshard_at, sequence_parallel_at,
                                   software_ranges, virtual_stages_of)
from nbscaler.planning.planner import plan
from nbscaler.planning.stack import Stack, check_layers_alike, find_stack, one_sequence, shallow
from nbscaler.policy.primitives import PolicyError
from nbscaler.recipe import UNSET, Recipe
from nbscaler.space.row_config import CopyPlacementKey, config_of, pas_config, placement_of

CONFIG_COLUMNS = (S.TP, S.CP, S.EP, S.PP, S.DP, S.MICRO_BATCH, S.MICRO_BATCHES, S.RECOMPUTE, S.SEQUENCE_PARALLEL,
                  S.CONTEXT_PARALLEL_KIND, S.ZERO_STAGE, S.ZERO_RESHARD_AFTER_FORWARD, S.SCHEDULER, S.VIRTUAL_STAGES,
                  S.FLOAT8, S.COMPILED)
PREDICTION_COLUMNS = (S.STEP_TIME_S, S.TOKENS_PER_S, S.MFU, S.HFU, S.PEAK_BYTES, S.FITS, S.BUBBLE,
                      S.TP_COMM_SHARE, S.DP_COMM_SHARE, S.PP_SEND_SHARE, S.FSDP_COMM_SHARE)
KNOBS = ("hardware", "nodes", "gpus_per_node", "recipe", "module_dtype", "master_dtype", "grad_reduce_dtype",
         "global_batch", "sequence")
#: The knobs that change a field of the recipe (``PlanSpace.set``).
RECIPE_KNOBS = ("module_dtype", "master_dtype", "grad_reduce_dtype")
#: The dtype a space computes in when neither its recipe nor ``module_dtype=`` says: a sweep plans real runs.
SWEEP_MODULE_DTYPE = torch.bfloat16
"""What ``PlanSpace.set`` takes."""


class PlanSpace:
    """Every configuration of ``module`` on a target, priced, and re-priced when a knob changes.

    Takes ``nbscaler.sweep``'s arguments (see there); ``frame`` is the sweep's table for the knobs
    as they stand, ``set(**knobs)`` changes some (``KNOBS``) and returns the new table.
    ``settle``: after tracing and placing, run the cycle collector once (``_settle``), for a space
    that lives on to be re-priced; a sweep asked once (``nbscaler.sweep``, autodist) leaves it.
    ``last_price_s`` is how long the last pricing took, ``traces`` how many times the two-layer
    copy has been traced so far (what a knob that needs none must leave alone).
    """

    def __init__(self, module: torch.nn.Module, dummy_args: Dict[str, Any], hardware: Hardware, *,
                 global_batch: int, tp: Optional[Sequence[int]] = None, pp: Optional[Sequence[int]] = None,
                 micro_batch: Optional[Sequence[int]] = None, recompute: Sequence = RECOMPUTE_VALUES,
                 sequence_parallel: Sequence[bool] = (False, True),
                 zero_stage: Sequence[int] = (0, 1, 2), zero_reshard_after_forward: Sequence[bool] = (True,),
                 recipe: Optional[Recipe] = None, optimizer: Any = UNSET,
                 master_dtype: Any = UNSET, module_dtype: Any = UNSET, grad_reduce_dtype: Any = UNSET,
                 scheduler: str = "1f1b", virtual_stages: Sequence[int] = (1,), progress: bool = False,
                 prune: Optional[float] = None, settle: bool = True, cp: Sequence[int] = (1,),
                 context_parallel_kind: Sequence[str] = CONTEXT_KIND_VALUES, float8: Optional[Sequence] = None,
                 compiled: Optional[Sequence[bool]] = None, ep: Sequence[int] = (1,), **optimizer_kwargs: Any):
        check_prune(prune)
        self.recipe = space_recipe(recipe, optimizer=optimizer, optimizer_kwargs=optimizer_kwargs,
                                   master_dtype=master_dtype, module_dtype=module_dtype,
                                   grad_reduce_dtype=grad_reduce_dtype)
        self.prune = prune
        self.stack = find_stack(module)
        check_layers_alike(module, self.stack)
        self.ranges = Ranges(*(tuple(r) if r is not None else None for r in (tp, pp, micro_batch)),
                             tuple(recompute), tuple(sequence_parallel), tuple(zero_stage), scheduler,
                             tuple(virtual_stages), tuple(zero_reshard_after_forward), tuple(cp),
                             tuple(context_parallel_kind), None if float8 is None else tuple(float8),
                             None if compiled is None else tuple(compiled), tuple(ep))
        self.hardware, self.global_batch = hardware, global_batch
        self._two = copy.deepcopy(shallow(module, self.stack, 2))   # its own weights: module_dtype casts them
        self._args = {_sequence_of(dummy_args): dummy_args}
        self.sequence = _sequence_of(dummy_args)
        self._traced: Dict[Tuple, Any] = {}        # (sequence, dtype, micro) -> the copy's first Plan
        self._placed: Dict[Tuple, Any] = {}        # (sequence, dtype, *CopyPlacementKey) -> Plan, or why not
        self._facts: Dict[Tuple, Any] = {}         # (target, placement key) -> LayerFacts, or why not
        self._models: Dict[Tuple, Tuple[RooflineOps, NcclModel]] = {}
        self._kinds = Kinds()                       # the distinct ops and collectives of every placement
        self._staged: Dict[Tuple, Staged] = {}
        self._memos: Dict[Tuple, PlacementMemo] = {}   # placement key -> what its facts keep on every target
        self._peaks: Dict[Tuple, float] = {}        # peak bytes per device of a configuration, on any target
        self._alike: Dict = {}                      # what devices hold, for placements alike in weights (Staged)
        self._partial_grads: Dict[Tuple, bool] = {}  # placement key -> whether some weight has partial gradients
        self.traces = 0
        self.last_price_s = 0.0
        self.frame = self._price(progress)
        self.settle = settle
        if settle:
            _settle()

    # -- the knobs ------------------------------------------------------------------------------
    def set(self, **knobs: Any) -> pd.DataFrame:
        """Change knobs (``hardware``: a ``Hardware`` or a catalogue name; ``nodes``,
        ``gpus_per_node``; ``recipe``, or one field of it: ``module_dtype``, ``master_dtype``,
        ``grad_reduce_dtype``; ``global_batch``; ``sequence``: tokens per sequence) and re-price.
        A bad value raises ``ValueError`` naming it, and the space stays as it was."""
        unknown = sorted(set(knobs) - set(KNOBS))
        if unknown:
            raise ValueError(f"PlanSpace.set: no knob {', '.join(unknown)}; the knobs are {', '.join(KNOBS)}.")
        before = {k: getattr(self, k) for k in ("hardware", "recipe", "global_batch", "sequence")}
        try:
            # a catalogue name starts from its entry, with the nodes the space has unless others are given
            name, nodes = knobs.get("hardware"), knobs.get("nodes")
            nodes = self.hardware.nodes if isinstance(name, str) and nodes is None else nodes
            self.hardware = Hardware.resolve(self.hardware if name is None else name, nodes=nodes,
                                             gpus_per_node=knobs.get("gpus_per_node"))
            recipe = Recipe.of(knobs["recipe"]) if "recipe" in knobs else self.recipe
            changes = {k: knobs[k] for k in RECIPE_KNOBS if k in knobs}
            if changes or "recipe" in knobs:
                self.recipe = space_recipe(recipe.replace(**changes), module_dtype=changes.get("module_dtype", UNSET))
            for name in ("global_batch", "sequence"):
                if name in knobs:
                    setattr(self, name, knobs[name])
            self._check_dtypes()
            if "sequence" in knobs:
                self._args_at(self.sequence)
            placed = len(self._placed)
            self.frame = self._price(False)
            if self.settle and len(self._placed) > placed:
                _settle()
        except Exception:
            for name, value in before.items():
                setattr(self, name, value)
            raise
        return self.frame

    def config(self, row) -> ComputeConfig:
        """The ``ComputeConfig`` of one row of ``frame`` on the target as it stands."""
        return config_of(row, self.hardware.ngpus, self.stack.path)

    @property
    def modes_agree(self) -> bool:
        """Whether the two-layer copy traced the same in training and eval mode (``trace_modes``
        made one ``'any'`` graph) at every micro-batch size traced: then the full model, whose
        layers are the copy's, does too."""
        return bool(self._traced) and all(set(p.graphs) == {"any"} for p in self._traced.values())

    @property
    def dummy_args(self) -> Dict[str, Any]:
        """The dummy inputs (one sequence) at the current ``sequence``."""
        return self._args_at(self.sequence)

    # -- pricing --------------------------------------------------------------------------------
    def _price(self, progress: bool) -> pd.DataFrame:
        """The frame for the knobs as they stand, with the cycle collector paused: pricing makes
        many small objects, and each collection would walk every object the kept placements hold."""
        start = time.perf_counter()
        with paused_gc():
            frame = self._price_rows(progress)
        self.last_price_s = time.perf_counter() - start
        return frame

    def _price_rows(self, progress: bool) -> pd.DataFrame:
        hardware, global_batch = self.hardware, self.global_batch
        if hardware.is_local:
            raise ValueError("sweep prices on a target: pass a Hardware such as Hardware.named('H100-SXM-80GB'); "
                             "Hardware.local() would profile the ops of every configuration on this machine.")
        r = self.ranges
        ranges = checked_ranges(hardware, self.stack, global_batch, r.tp, r.pp, r.micro_batch, r.recompute,
                         r.sequence_parallel, r.zero_stage, r.zero_reshard_after_forward, r.cp,
                         r.context_parallel_kind, r.ep)
        tp, pp, micro, recompute, sequence_parallel, zero, reshard, cps, kinds, eps = ranges
        combos = [(t, c, e, p, m, rec, sp, kind, z, keep, v, f8, comp)
                  for f8, comp in software_ranges(hardware, self.recipe, r.float8, r.compiled, self.stack.path)
                  for t, c, e, p, m, rec, z, v in itertools.product(
                      tp, cps, eps, pp, micro, recompute, zero, virtual_stages_of(r.scheduler, r.virtual_stages))
                  for sp in sequence_parallel_at(t, sequence_parallel)
                  for kind in context_kind_at(c, kinds) for keep in reshard_at(z, reshard)]
        rows, excluded, runnable = [], [], []
        for *layout, f8, comp in tqdm(combos, desc="sweep", unit="config", disable=not progress):
            found = self._priced_or_why(*layout, f8, comp)
            if isinstance(found, dict):
                excluded.append(found)
            elif self.prune is not None:
                runnable.append(found)
            else:
                rows.append(found[-1]())
        if self.prune is not None:
            makers = {id(found[1]): found[-1] for found in runnable}      # config -> what prices its row
            rows += pruned_rows([found[:-1] for found in runnable], lambda config, *_: makers[id(config)](),
                                hardware, float(self.prune))
        frame = _frame(rows, excluded, self.stack)
        frame.attrs["pruned"] = len(runnable) - len(rows) if self.prune is not None else 0
        return frame

    def _priced_or_why(self, t: int, c: int, e: int, p: int, m: int, rec: str, sp: bool, kind: str, z: int, keep: bool,
                       v: int, f8: str, comp: bool):
        """One combination: the row of its configuration with why it cannot run (a dict), or
        ``(pipeline seconds, config, cfg, facts, staged, price)`` where ``price()`` makes its row."""
        hardware, recipe = at_software(self.hardware, self.recipe, f8, comp, self.stack.path)
        target = (repr(hardware), products_of(recipe))
        if target not in self._models:        # op and collective times, kept per target and products
            self._models[target] = target_models(hardware, recipe)
        ops, comm = self._models[target]
        width = t * c * e * p
        config = {S.TP: t, S.CP: c, S.EP: e, S.PP: p,
                  S.DP: hardware.ngpus // width if hardware.ngpus % width == 0 else 0,
                  S.MICRO_BATCH: m, S.RECOMPUTE: rec, S.SEQUENCE_PARALLEL: sp, S.CONTEXT_PARALLEL_KIND: kind,
                  S.ZERO_STAGE: z, S.ZERO_RESHARD_AFTER_FORWARD: keep, S.SCHEDULER: self.ranges.scheduler,
                  S.VIRTUAL_STAGES: v, S.FLOAT8: f8, S.COMPILED: comp}
        reason = combination_problem(hardware, self.global_batch, t, p, m, c, self.sequence, e)
        if reason is not None:
            return {**config, "reason": reason}
        config[S.MICRO_BATCHES] = self.global_batch // (config[S.DP] * m)
        try:
            cfg = config_of(config, hardware.ngpus, self.stack.path)
            placement = self._canonical(placement_of(config))
            facts = self._facts_of(target, ops, comm, placement)
            staged = self._staged_of(target, facts, placement, cfg.pipeline_nstages)
        except (ValueError, PolicyError) as err:
            return {**config, "reason": str(err)}
        peak_key = (*self._key(*placement), hardware.ngpus, p, z, keep, v, config[S.MICRO_BATCHES], recipe)

        def priced() -> Dict[str, Any]:
            return {**config, **price(facts, cfg, hardware, ops, comm, recipe, staged, (self._peaks, peak_key))}
        seconds = pipeline_seconds(facts, cfg, comm, staged) if self.prune is not None else 0.0
        return seconds, config, cfg, facts, staged, priced

    def _key(self, *rest: Any) -> Tuple:
        return (self.sequence, self.module_dtype, *rest)

    def _facts_of(self, target: Tuple, ops, comm, placement: CopyPlacementKey) -> LayerFacts:
        """The copy's facts on the target under ``placement``; a placement the policy refuses (or
        one that splits no heads) raises, once and again from the cache."""
        key = (*target, *self._key(*placement))
        if key not in self._facts:
            try:
                memo = self._memos.get(self._key(*placement))
                self._facts[key] = read_facts(self._placement(placement), self.stack, ops, comm, memo, self._kinds)
                self._memos[self._key(*placement)] = self._facts[key].memo
            except (ValueError, PolicyError) as err:
                self._facts[key] = err
        return _raised(self._facts[key])

    def _staged_of(self, target: Tuple, facts: LayerFacts, placement: CopyPlacementKey, nstages: int) -> Staged:
        key = (*target, *self._key(*placement, nstages))
        if key not in self._staged:
            self._staged[key] = Staged(facts, nstages, self._alike)
        return self._staged[key]

    def _canonical(self, placement: CopyPlacementKey) -> CopyPlacementKey:
        """``placement``, or the same without ZeRO stage 2 where that stores every weight alike:
        one placement (and one set of facts) for both."""
        if not placement.zero_stage_2:
            return placement
        without = placement._replace(zero_stage_2=False)
        key = self._key(*without)
        if key not in self._partial_grads:
            placed = self._placement(without)
            self._partial_grads[key] = storage_layouts(placed.graphs.values(), False) != placed.storage
        return placement if self._partial_grads[key] else without

    def _placement(self, placement: CopyPlacementKey):
        """The two-layer copy placed over ``placement.tp`` devices (traced once per micro-batch
        size, sequence and dtype; placed again from that trace for each tp, recompute and
        sequence parallelism)."""
        key = self._key(*placement)
        if key not in self._placed:
            try:
                self._placed[key] = self._place(placement)
            except (ValueError, PolicyError) as err:
                self._placed[key] = err
        return _raised(self._placed[key])

    def _place(self, placement: CopyPlacementKey):
        tp, devices = placement.tp, placement.devices
        pas = pas_config(placement.recompute, placement.sequence_parallel, self.stack.path, placement.cp,
                         placement.kind, placement.ep)
        cfg = ComputeConfig(devices, devices, use_end2end=True, use_pipeline=True, pipeline_nstages=1, pipeline_nmicros=1,
                            pipeline_scheduler="1f1b", use_zero=placement.zero_stage_2,
                            zero_stage=2 if placement.zero_stage_2 else 1, pas_config=pas)
        traced = self._key(placement.micro)
        if traced not in self._traced:
            args = one_sequence(self._args_at(self.sequence), placement.micro)
            self._traced[traced] = plan(self._two, args, "hybrid", cfg, module_dtype=self.module_dtype)
            self.traces += 1
            placed = self._traced[traced]
        else:
            placed = self._traced[traced].replan(compute_config=cfg)
        whole = [n for n in placed.graph.nodes if n.op == "attention" and
                 (n.placement.split is None if n.placement.inner is None else n.placement.inner.name is None)]
        if tp > 1 and whole:
            heads = whole[0].inputs[0].shape[1]
            raise ValueError(f"tp={tp} does not divide the {heads} attention heads, so every device of a group "
                             f"would run attention whole; use a tp that divides {heads}")
        return placed

    def _args_at(self, sequence: int) -> Dict[str, Any]:
        if not isinstance(sequence, int) or isinstance(sequence, bool) or sequence < 1:
            raise ValueError(f"sequence={sequence!r} must be a whole number of tokens >= 1.")
        if sequence not in self._args:
            first = next(iter(self._args))
            self._args[sequence] = _resized(self._args[first], first, sequence)
        return self._args[sequence]

    @property
    def module_dtype(self) -> Optional[torch.dtype]:
        """The dtype the module computes in (the recipe's)."""
        return self.recipe.module_dtype

    @property
    def master_dtype(self) -> Optional[torch.dtype]:
        """The master copies' dtype (the recipe's)."""
        return self.recipe.master_dtype

    @property
    def optimizer(self) -> Any:
        """The optimizer priced (the recipe's)."""
        return self.recipe.optimizer

    @property
    def optimizer_kwargs(self) -> Dict[str, Any]:
        """Its keywords (the recipe's)."""
        return self.recipe.kwargs

    def _check_dtypes(self) -> None:
        if self.module_dtype is not None:
            self.hardware.peak_flops(self.module_dtype)      # raises where the target lacks that precision


def space_recipe(recipe: Optional[Recipe] = None, **shorthands: Any) -> Recipe:
    """The recipe a space prices: ``Recipe.of(recipe, **shorthands)``, computing in bf16
    (``SWEEP_MODULE_DTYPE``) where neither it nor ``module_dtype=`` names a dtype
    (``module_dtype=None``: the module's own). A space prices balanced routing: a recipe with an
    ``expert_imbalance`` is refused, with the fix."""
    chosen = Recipe.of(recipe, **shorthands)
    if chosen.expert_imbalance != 1.0:
        raise ValueError(f"Recipe(expert_imbalance={chosen.expert_imbalance}): a plan space prices balanced routing "
                         "from the copy of two layers it replays once; give expert_imbalance=1.0 here, and price a row "
                         "of it at that imbalance with nbscaler.plan(..., config_of(row)).summary(recipe=...).")
    if chosen.module_dtype is None and shorthands.get("module_dtype", UNSET) is UNSET:
        chosen = chosen.replace(module_dtype=SWEEP_MODULE_DTYPE)
    return chosen


def _settle() -> None:
    """One full run of the cycle collector after tracing and placing: the hundreds of thousands of
    objects a placement keeps are young until a collection moves them on, and the collections that
    would (one of 0.1 s, then a full one of 0.3 s and more in a process holding PyTorch) would
    otherwise fall inside the next knob's pricing, which makes a few thousand."""
    gc.collect()


def _raised(found):
    if isinstance(found, Exception):
        raise found
    return found


def _sequence_of(args) -> Optional[int]:
    """Tokens per sequence of ``args``: the second dimension of its first integer tensor of 2 or more
    dimensions (``None`` where none has one)."""
    from torch.utils._pytree import tree_leaves
    for t in tree_leaves(args):
        if isinstance(t, torch.Tensor) and t.ndim >= 2 and not t.is_floating_point() and t.dtype != torch.bool:
            return int(t.shape[1])
    return None


def _resized(args, old: Optional[int], new: int):
    """``args`` with every tensor whose second dimension is ``old`` tokens long made ``new`` long
    (its tokens repeated cyclically), a tensor passed twice still one tensor."""
    from torch.utils._pytree import tree_map
    if old is None:
        raise ValueError("sequence: the dummy inputs hold no token tensor (an integer tensor of shape "
                         "(1, T, ...)), so the sequence length cannot change.")
    done: Dict[int, torch.Tensor] = {}

    def resize(t):
        if not isinstance(t, torch.Tensor) or t.ndim < 2 or t.shape[1] != old:
            return t
        if id(t) not in done:
            done[id(t)] = t[:, torch.arange(new) % old]           # (1, new, ...)
        return done[id(t)]
    return tree_map(resize, args)


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
