"""``Plan``: one compile held in memory, the object every view, benchmark and file is made from.

``plan(module, dummy_args, policy, compute_config)`` traces the module, lets the policy place every
op, checks the placement and runs the cost pass, all in the calling process: no files are written
and no process group is needed. What it returns answers every question about the compile:

>>> p = nbscaler.plan(GPT(cfg), {"idx": idx, "targets": targets}, "tp",       # doctest: +SKIP
...                   ComputeConfig(plan_ngpus=2, runtime_ngpus=2))
>>> p.ops.groupby("split").flops_fwd.sum()        # what the policy split, by FLOPs
>>> p.collectives.bytes_per_device.sum()          # what crosses between the devices
>>> p.summary(optimizer=torch.optim.AdamW)        # memory and time per rank, predicted
>>> print(p.sources[1])                           # the code rank 1 runs

``parallelize`` is ``plan`` followed by writing the files and loading them; ``p.replan(...)`` places
the same traced graphs again under another policy or config without tracing again.
"""

from __future__ import annotations


import functools
import time
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Type, Union

import pandas as pd
import torch
from torch.utils._pytree import tree_map

from nbscaler.codegen.rankfile import generate
from nbscaler.comm.layout import Layout, storage_layouts
from nbscaler.comm.lower import RankPrograms, lower, rank_sections
from nbscaler.comm.traffic import collective_steps
from nbscaler.config import ComputeConfig
from nbscaler.cost.annotate import annotate_costs
from nbscaler.cost.comm_model import local_backend
from nbscaler.cost.hardware import Hardware
from nbscaler.comm.placed import PlacedGraphs
from nbscaler.cost.memory import DeviceRuns, device_runs, memory_per_rank, paused_gc
from nbscaler.cost.step_figures import StepFigures
from nbscaler.cost.timing import StepModel, backend_on, predicted_timeline, products_of
from nbscaler.ir.backward_split import mark_backward_split
from nbscaler.ir.graph import IRGraph
from nbscaler.planning import tables
from nbscaler.planning.assumed import ATTR as ASSUMED, assumed_lines
from nbscaler.planning.step import plan_step
from nbscaler.planning.fingerprint import Table, bundle, of_frames, tag
from nbscaler.planning.explanation import Explanation, explain
from nbscaler.policy.builtin import SEQUENCE_PARALLEL, get_policy
from nbscaler.recipe import UNSET, Recipe
from nbscaler.policy.checks import check_placements
from nbscaler.policy.recompute import RECOMPUTE_KEY, mark_recompute, recompute_names
from nbscaler.policy.shard_units import mark_shard_units
from nbscaler.planning.units_table import units_frame
from nbscaler.schedule import PipelineGeometry, PipelineSchedule, Timeline
from nbscaler.trace.modes import trace_modes

Policy = Union[str, Callable[[IRGraph, ComputeConfig], Optional[IRGraph]]]

#: Bumped whenever the layout of ``Plan.to_json()`` (and so of ``plan.json``) changes.
PLAN_FORMAT_VERSION = 1


def policy_name(policy: Policy) -> str:
    """How a policy is named in files and tables: its built-in name, or ``module.qualname``."""
    return policy if isinstance(policy, str) else f"{policy.__module__}.{policy.__qualname__}"


def module_name(module_class: type) -> str:
    return f"{module_class.__module__}.{module_class.__qualname__}"


class PerRank(Mapping):
    """A read-only mapping ``rank -> value`` over ranks ``0 .. n - 1`` whose values are made when
    first read (``make(rank)``) and kept."""

    def __init__(self, n: int, make: Callable[[int], Any]) -> None:
        self._n, self._make, self._made = n, make, {}

    def __getitem__(self, rank: int) -> Any:
        if rank not in self:
            raise KeyError(rank)
        if rank not in self._made:
            self._made[rank] = self._make(rank)
        return self._made[rank]

    def __contains__(self, rank: object) -> bool:
        return isinstance(rank, int) and 0 <= rank < self._n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self._n))

    def __len__(self) -> int:
        return self._n


@dataclass(eq=False)
class Plan:
    """A placed, checked and costed compile of one module under one policy and compute config."""

    graphs: Dict[str, IRGraph]                 # mode -> placed graph: 'any', or 'train' and 'eval'
    config: ComputeConfig
    policy_name: str
    module_name: str
    compile_seconds: float = 0.0
    policy: Optional[Policy] = field(default=None, repr=False)
    #: the training recipe a run of this plan uses, where one was given (``parallelize(recipe=)``):
    #: each rank file states it
    recipe: Optional[Recipe] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.storage: Dict[str, Layout] = storage_layouts(
            self.graphs.values(), self.config.sums_partial_grads_after_backward)
        self.geometry: Optional[PipelineGeometry] = self.config.grid.pipeline

    # -- what was compiled ----------------------------------------------------------------------
    @property
    def graph(self) -> IRGraph:
        """The training graph (the only one when both modes trace the same)."""
        return self.graphs.get("train", self.graphs.get("any", next(iter(self.graphs.values()))))

    @property
    def placed(self) -> PlacedGraphs:
        """The graphs, the weights' storage, the config and the geometry, as the cost model reads them."""
        return PlacedGraphs(self.graphs, self.storage, self.config, self.geometry)

    @property
    def schedule(self) -> Optional[PipelineSchedule]:
        return self.geometry.schedule if self.geometry is not None else None

    @property
    def sources(self) -> Mapping[int, str]:
        """Runtime rank -> the text of its ``gencode{rank}.py`` (each generated when first read)."""
        return PerRank(self.config.runtime_ngpus, lambda r: self._generated[r][0])

    @property
    def source_lines(self) -> Mapping[int, Dict[int, List[int]]]:
        """Runtime rank -> node index of ``graph`` -> the lines (1-based) of ``sources[rank]`` that
        run it: its call and the collectives its inputs needed. A node a rank does not run is absent."""
        mode = next(m for m, g in self.graphs.items() if g is self.graph)
        index = {n.name: i for i, n in enumerate(self.graph.nodes)}
        return PerRank(self.config.runtime_ngpus, lambda r: {index[name]: lines for name, lines
                                                             in self._generated[r][1].get(mode, {}).items()})

    def rank_nodes(self, rank: int) -> List[int]:
        """Indexes of the nodes of ``graph`` that runtime ``rank`` runs, without generating its code."""
        index = {id(n): i for i, n in enumerate(self.graph.nodes)}
        sections = rank_sections(self.graphs, self.config.device_of(rank), self.geometry)
        return sorted({index[id(n)] for sec in sections if sec.graph is self.graph for n in sec.nodes()})

    @functools.cached_property
    def programs(self) -> RankPrograms:
        """Runtime rank -> what it runs and stores (``comm.lower``), each plan device lowered once,
        when first asked for: code generation prints it, the cost model replays it and the traffic
        table counts its conversions."""
        return lower(self)

    @functools.cached_property
    def _generated(self) -> "PerRank":
        """Runtime rank -> (source text, mode -> node name -> line numbers), each rank generated once,
        when first asked: a view of one rank of a 64-device plan generates one file, not 64."""
        return PerRank(self.config.runtime_ngpus, self._generate)

    def _generate(self, rank: int) -> Tuple[str, Dict[str, Dict[str, List[int]]]]:
        cfg = self.config
        lines: Dict[str, Dict[str, List[int]]] = {}
        text = generate(self.programs[rank], self.graphs, rank=rank, plan_ngpus=cfg.plan_ngpus,
                        runtime_ngpus=cfg.runtime_ngpus, module_name=self.module_name,
                        policy_name=self.policy_name, geometry=self.geometry, line_map=lines,
                        recipe=self.recipe)
        return text, lines

    # -- tables -----------------------------------------------------------------------------------
    @functools.cached_property
    def ops(self) -> pd.DataFrame:
        """One row per node of the training graph: placement, shapes and cost facts."""
        return tag(tables.ops_frame(self.graph, self.programs.distinct()), Table.OPS, self)

    @functools.cached_property
    def units(self) -> pd.DataFrame:
        """ZeRO stage 3's units per plan device: parameters, gathered and shard bytes, and whether
        the forward frees each after it (``planning.units_table``); empty without stage 3."""
        return units_frame(self.programs, self.config, self.recipe_of())

    @property
    def collectives(self) -> pd.DataFrame:
        """One row per collective on an edge of the training graph (and per pipeline crossing),
        with the bytes the backend a run on this machine uses sends (``collectives_on``)."""
        return self.collectives_on(local_backend(self.config.runtime_ngpus))

    def collectives_on(self, backend: Optional[str]) -> pd.DataFrame:
        """``collectives`` with the bytes ``backend`` sends for each (``None``: the ideal
        collectives'); its ``runs`` column names what crosses the links (``layouts.EMULATED``)."""
        frames = self.__dict__.setdefault("_collectives", {})
        if backend not in frames:
            steps = collective_steps(self.programs.distinct(), self.graph, backend)
            frames[backend] = tag(tables.collectives_frame(steps), Table.COLLECTIVES, self)
        return frames[backend]

    def traffic(self, hardware: Optional[Hardware] = None) -> pd.DataFrame:
        """Bytes each runtime rank sends and receives in one training step on the graph's edges and
        pipeline crossings, as the backend on ``hardware`` (default: this machine) runs them;
        ``summary()`` adds the gradient synchronisation between units."""
        return tables.traffic_per_rank(self, backend=backend_on(hardware, self.config.runtime_ngpus))

    def summary(self, optimizer: Any = UNSET, *, hardware: Optional[Hardware] = None, recipe: Optional[Recipe] = None,
                master_dtype: Any = UNSET, grad_reduce_dtype: Any = UNSET, **optimizer_kwargs: Any) -> pd.DataFrame:
        """One row per runtime rank: FLOPs, traffic, memory by kind and the step time, predicted
        for a run that trains with ``recipe`` (``nbscaler.Recipe``; default ``Recipe()``, AdamW with
        fp32 masters). ``optimizer``, ``master_dtype``, ``grad_reduce_dtype`` and
        ``optimizer_kwargs`` are shorthands for its fields, as ``build_optimizer`` takes them: the
        memory counts the master copies and the optimizer state in their dtypes (``memory()``), and
        the gradient synchronisation sends the gradients in the recipe's reduce dtype.

        With ``hardware`` (``nbscaler.Hardware``), the step is timed on that target from each op's
        FLOPs and bytes and NCCL's collective costs, with nothing run on this machine, and the rows
        add its capacity, ``fits``, ``hardware_flops``, ``mfu``, ``hfu`` and ``tokens_per_s``
        (``nbscaler.columns``). On this machine ``.attrs['assumed']`` holds what the prediction
        assumes, one line each (``assumed()``)."""
        chosen = self.recipe_of(recipe, optimizer=optimizer, master_dtype=master_dtype,
                                grad_reduce_dtype=grad_reduce_dtype, optimizer_kwargs=optimizer_kwargs)
        frame = tables.summary_frame(self, chosen, hardware)
        frame.attrs[ASSUMED] = self.assumed(hardware)
        return tag(frame, Table.SUMMARY, self)

    def assumed(self, hardware: Optional[Hardware] = None) -> List[str]:
        """What a prediction of this plan on ``hardware`` (this machine by default) assumes, one line
        each: the backend its collectives are priced for, collectives left at uncalibrated defaults,
        more ranks than cores (``planning.assumed``; none on a target). ``summary()`` carries them
        in ``.attrs['assumed']``; ``explain()`` and the views show them."""
        return assumed_lines(self, hardware)

    def step_figures(self, optimizer: Any = UNSET, *, recipe: Optional[Recipe] = None,
                     hardware: Optional[Hardware] = None, master_dtype: Any = UNSET, grad_reduce_dtype: Any = UNSET,
                     **optimizer_kwargs: Any) -> StepFigures:
        """One training step with ``recipe`` (default ``Recipe()``; the other keywords are shorthands
        for its fields, as in ``summary``), priced (``cost.step_figures.StepFigures``): each plan
        device's compute, exposed gradient synchronisation and optimizer step, its FLOPs, and on
        ``hardware`` the job's step time, MFU, HFU and tokens/s. ``summary`` reads its step from here."""
        chosen = self.recipe_of(recipe, optimizer=optimizer, master_dtype=master_dtype,
                                grad_reduce_dtype=grad_reduce_dtype, optimizer_kwargs=optimizer_kwargs)
        return plan_step(self, chosen, hardware)

    def memory(self, optimizer: Any = UNSET, *, recipe: Optional[Recipe] = None, master_dtype: Any = UNSET,
               grad_reduce_dtype: Any = UNSET, **optimizer_kwargs: Any) -> pd.DataFrame:
        """Predicted bytes per runtime rank by kind (parameters, gradients, optimizer state, ...)
        for a run that trains with ``recipe`` (default ``Recipe()``; the other keywords are
        shorthands for its fields, as in ``summary``).

        With master copies (the default's fp32 ones of a bf16 module) the optimizer updates them:
        they count in ``optimizer_bytes`` with its state, and the gradients are in that dtype after
        the step (``nbscaler.cost.memory``)."""
        chosen = self.recipe_of(recipe, optimizer=optimizer, master_dtype=master_dtype,
                                grad_reduce_dtype=grad_reduce_dtype, optimizer_kwargs=optimizer_kwargs)
        return tag(memory_per_rank(self.placed, chosen, runs=self.runs_for(chosen),
                                   weights_of=self.programs.weights), Table.MEMORY, self)

    def timeline(self, hardware: Optional[Hardware] = None, *, recipe: Optional[Recipe] = None) -> Timeline:
        """The predicted timeline of one training step, rows ``(rank, stage, micro, phase, t_start, t_end)``,
        on this machine or on ``hardware``. Its blocks are the forwards and backwards; under ZeRO
        stage 3 each lasts what it waits for its units' all-gathers and reduce-scatters too, which
        ``.collectives`` holds, each named with its unit (``cost.fsdp``; the reduce-scatters in
        ``recipe``'s reduce dtype). ``.collectives`` also holds each bucket of the data-parallel
        gradient synchronisation (``sync=True``, named ``bucket i``), where ``summary`` prices it
        (``cost.timing.sync_spans``): what they wait after the blocks is the step's exposed
        synchronisation. ``recipe`` is checked against the plan as ``summary`` checks it."""
        chosen = self.recipe_of(recipe)
        return predicted_timeline(self.placed, runs=self.runs_for(chosen), hardware=hardware,
                                  model=self.step_model(hardware, chosen),
                                  recipe=chosen, program_of=self.programs.device)

    def unit_collectives(self, hardware: Optional[Hardware] = None, *, recipe: Optional[Recipe] = None) -> pd.DataFrame:
        """Under ZeRO stage 3, one row per plan device and unit: what the unit's all-gathers and
        reduce-scatter move, what each costs on the ZeRO group's link, how many one training step
        runs and how long it waits for them (``nbscaler.columns.UnitColumn``; ``cost.fsdp``), on
        this machine or on ``hardware``, gradients reduced as ``recipe`` says (default ``Recipe()``).
        Empty under any other configuration."""
        chosen = self.recipe_of(recipe)
        cfg = self.config
        model = self.step_model(hardware, chosen) or StepModel(self.placed, runs=self.runs_for(chosen),
                                                               hardware=hardware, weights_of=self.programs.weights,
                                                               program_of=self.programs.device, recipe=chosen)
        return model.unit_table(cfg.pipeline_nmicros if cfg.use_pipeline else 1, chosen)

    def recipe_of(self, recipe: Optional[Recipe] = None, **shorthands: Any) -> Recipe:
        """The recipe a prediction of this plan uses: ``Recipe.of(recipe, **shorthands)``, whose
        ``module_dtype``, when it has one, must be the dtype the plan's parameters are held in."""
        chosen = Recipe.of(recipe, **shorthands)
        held = {t.dtype for t in self.graph.weights.values() if t.kind == "param" and t.dtype.is_floating_point}
        if chosen.module_dtype is not None and held and held != {chosen.module_dtype}:
            raise ValueError(f"recipe.module_dtype={chosen.module_dtype} but this plan's parameters are held in "
                             f"{', '.join(sorted(map(str, held)))}: plan with module_dtype={chosen.module_dtype}, "
                             "or give a recipe without module_dtype.")
        return chosen

    def step_model(self, hardware: Optional[Hardware] = None, recipe: Optional[Recipe] = None) -> Optional[StepModel]:
        """The step model (each device's section times) on target ``hardware`` for a run with
        ``recipe``'s products (fp8 or not, ``cost.timing.products_of``), made once per hardware and
        products and kept: ``timeline`` and ``summary`` on one target share it. ``None`` on this
        machine (no ``hardware``, or ``Hardware.local()``), where the op profiles and the
        calibration can change between calls and each call builds its own."""
        if hardware is None or hardware.is_local:
            return None
        models = self.__dict__.setdefault("_step_models", [])     # (hardware, products, model): Hardware is unhashable
        priced = products_of(recipe), recipe.expert_imbalance if recipe is not None else 1.0   # what the model reads
        for known, made_for, model in models:
            if known == hardware and made_for == priced:
                return model
        model = StepModel(self.placed, runs=self.runs_for(recipe), hardware=hardware, weights_of=self.programs.weights,
                          program_of=self.programs.device, recipe=recipe)
        models.append((hardware, priced, model))
        return model

    @functools.cached_property
    def local_runs(self) -> Optional[DeviceRuns]:
        """Each plan device's training forward replayed on fake tensors (local shapes, collectives,
        saved tensors): what the memory table and the step model both read; made once per plan."""
        if self.config.inference_only:
            return None
        return device_runs(self.placed, self.programs.device)

    def runs_for(self, recipe: Optional[Recipe] = None) -> Optional[DeviceRuns]:
        """``local_runs`` for the routing ``recipe`` prices (``Recipe.expert_imbalance``): the
        balanced replay, or one made for that imbalance once and kept."""
        imbalance = recipe.expert_imbalance if recipe is not None else 1.0
        if imbalance == 1.0 or self.config.inference_only:
            return self.local_runs
        made = self.__dict__.setdefault("_imbalanced_runs", {})
        if imbalance not in made:
            made[imbalance] = device_runs(self.placed, self.programs.device, imbalance)
        return made[imbalance]

    # -- again, differently -----------------------------------------------------------------------
    def replan(self, policy: Optional[Policy] = None, compute_config: Optional[ComputeConfig] = None) -> "Plan":
        """The same traced graphs placed under another policy and/or config: no tracing, so fast.

        This plan is left as it is; the new one works on copies of its graphs.
        """
        policy = policy if policy is not None else self.policy
        if policy is None:
            raise ValueError("this plan does not know the policy it was made with; pass policy=...")
        return place(_unplaced_copies(self.graphs), policy, compute_config or self.config, self.module_name)

    # -- saved forms ------------------------------------------------------------------------------
    def to_json(self) -> Dict[str, Any]:
        """What ``plan.json`` holds: the config, every node's placement and cost, weights, collectives."""
        return tables.plan_json(self, PLAN_FORMAT_VERSION)

    def explain(self) -> Explanation:
        """What the policy did (and, for autodist, why): text to print, with ``.table`` behind it."""
        return explain(self)

    def _repr_html_(self) -> str:
        return tables.plan_html(self)

    def _repr_mimebundle_(self, **kwargs: Any) -> Dict[str, Any]:
        """Beside the HTML card: the fingerprint of the ops and collectives it sums up
        (``nbscaler.planning.fingerprint``), which a saved notebook is checked against."""
        return bundle(of_frames(self.ops, self.collectives))

    def __repr__(self) -> str:
        cfg = self.config
        return (f"Plan({self.module_name}, policy={self.policy_name!r}, plan_ngpus={cfg.plan_ngpus}, "
                f"runtime_ngpus={cfg.runtime_ngpus}, {len(self.graph)} ops)")


def plan(module_or_module_class: Union[torch.nn.Module, Type[torch.nn.Module]], dummy_forward_args: Dict[str, Any],
         pas_policy: Policy, compute_config: ComputeConfig, *, module_dtype: Optional[torch.dtype] = None,
         module_fn: Optional[Callable[[], torch.nn.Module]] = None) -> Plan:
    """Trace, place, check and cost a module in memory; see ``Plan``.

    Takes the first four arguments of ``parallelize`` (and its ``module_dtype`` / ``module_fn``),
    writes nothing and needs no process group. This is the compile of one config; ``nbscaler.plan``
    also takes ``"autodist"`` with ``pas_config['hardware']``, which first chooses the config for that
    target in the plan space (``nbscaler.space.autodist``).
    """
    if not isinstance(compute_config, ComputeConfig):
        raise TypeError(f"compute_config must be a ComputeConfig, got {type(compute_config).__name__}")
    module = build_module(module_or_module_class, module_fn, module_dtype)
    return trace_and_place(module, dummy_forward_args, pas_policy, compute_config, module_dtype)


def trace_and_place(module: torch.nn.Module, dummy_forward_args: Dict[str, Any], pas_policy: Policy,
                    compute_config: ComputeConfig, module_dtype: Optional[torch.dtype],
                    modes_agree: bool = False) -> Plan:
    """``plan`` of a built module: trace it (``trace_modes``, with its ``modes_agree``), place it
    and record how long that took. The cycle collector waits meanwhile: the trace of a large model
    makes millions of objects, and each collection on the way would walk all of them again."""
    start = time.perf_counter()
    with paused_gc():
        graphs = trace_modes(module, cast_floats(dummy_forward_args, module_dtype), compute_config, modes_agree)
        result = place(graphs, pas_policy, compute_config, module_name(type(module)))
    result.compile_seconds = time.perf_counter() - start
    return result


#: What a policy may write into ``graph.meta`` for the planner and ``explain()``: the unit size,
#: stage count and modules to recompute it chose (``adopt_policy_choices``), and autodist's record.
POLICY_CHOICES = ("plan_ngpus", "pipeline_nstages", "pipeline_scheduler", RECOMPUTE_KEY, SEQUENCE_PARALLEL, "autodist")


def place(graphs: Dict[str, IRGraph], pas_policy: Policy, cfg: ComputeConfig, name: str) -> Plan:
    """Apply the policy to traced graphs (in place), check the result and run the cost pass."""
    policy = get_policy(pas_policy)
    start = time.perf_counter()
    placed = {}
    for mode, graph in graphs.items():
        for key in POLICY_CHOICES:                 # what an earlier policy chose on these graphs
            graph.meta.pop(key, None)
        out = policy(graph, cfg)
        placed[mode] = graph if out is None else out
        cfg = adopt_policy_choices(placed[mode], cfg)
        check_placements(placed[mode], cfg)
        mark_shard_units(placed[mode], cfg)
        if mode != "eval":                         # the eval forward keeps nothing for a backward
            mark_recompute(placed[mode], cfg)
            if _splits_backward(cfg):
                mark_backward_split(placed[mode])
        annotate_costs(placed[mode])
    return Plan(placed, cfg, policy_name(pas_policy), name, time.perf_counter() - start, policy=pas_policy)


def _splits_backward(cfg: ComputeConfig) -> bool:
    """Whether the config's schedule splits the backward into ``B`` and ``W`` blocks (zero bubble)."""
    return cfg.use_pipeline and not cfg.inference_only and PipelineGeometry.from_config(cfg).schedule.splits_backward


def adopt_policy_choices(graph: IRGraph, cfg: ComputeConfig) -> ComputeConfig:
    """A policy that chose the number of devices per unit or of pipeline stages (autodist's
    ``autodist_plan_ngpus``, ``autodist_nstages`` and ``autodist_scheduler``) says so in
    ``graph.meta['plan_ngpus']``, ``graph.meta['pipeline_nstages']`` and ``['pipeline_scheduler']``; the plan's config takes them, and so do later modes'
    policies. So for the modules it chose to recompute (``graph.meta['recompute_modules']``) and
    sequence parallelism (``graph.meta['sequence_parallel']``)."""
    plan_ngpus = graph.meta.get("plan_ngpus")
    if plan_ngpus is not None and plan_ngpus != cfg.plan_ngpus:
        cfg = cfg.with_changes(plan_ngpus=plan_ngpus, pas_config={"autodist_plan_ngpus": plan_ngpus})
    nstages, scheduler = graph.meta.get("pipeline_nstages"), graph.meta.get("pipeline_scheduler")
    if scheduler is not None and scheduler != cfg.scheduler:       # with its stages: each fits the other
        cfg = cfg.with_changes(pipeline_scheduler=scheduler, pipeline_nstages=nstages)
    elif nstages is not None and nstages != cfg.pipeline_nstages:
        cfg = cfg.with_changes(pipeline_nstages=nstages, pas_config={"autodist_nstages": nstages})
    chosen = graph.meta.get(RECOMPUTE_KEY)
    if chosen is not None and list(chosen) != recompute_names(cfg):
        cfg = cfg.with_changes(pas_config={RECOMPUTE_KEY: list(chosen)})
    if graph.meta.get(SEQUENCE_PARALLEL) and not cfg.pas_config.get(SEQUENCE_PARALLEL):
        cfg = cfg.with_changes(pas_config={SEQUENCE_PARALLEL: True})
    return cfg


def build_module(module_or_class, module_fn: Optional[Callable[[], torch.nn.Module]],
                 module_dtype: Optional[torch.dtype]) -> torch.nn.Module:
    """The module to trace: the object itself, or ``module_fn()`` / ``cls()`` for a class."""
    is_class = isinstance(module_or_class, type)
    cls = module_or_class if is_class else type(module_or_class)
    if not issubclass(cls, torch.nn.Module):
        raise TypeError(f"parallelize takes a torch.nn.Module or a subclass of it, got {cls.__name__}")
    module = (module_fn() if module_fn else cls()) if is_class else module_or_class
    return module.to(module_dtype) if module_dtype is not None else module


def cast_floats(dummy_args: Dict[str, Any], module_dtype: Optional[torch.dtype]) -> Dict[str, Any]:
    """Floating inputs follow the module's dtype, as they will at run time."""
    if module_dtype is None:
        return dummy_args
    return tree_map(lambda t: t.to(module_dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                    dummy_args)


def unplace(graphs: Dict[str, IRGraph]) -> Dict[str, IRGraph]:
    """Clear every node's placement, stage and cost facts (in place), ready for another policy."""
    for g in graphs.values():
        for node in g.nodes:
            node.placement, node.stage = None, None
            node.meta.clear()
    return graphs


def _unplaced_copies(graphs: Dict[str, IRGraph]) -> Dict[str, IRGraph]:
    return {mode: g.copy() for mode, g in graphs.items()}
