"""The memory model: what each runtime rank holds during a training step, by category.

The categories and their names are those of ``nbscaler.columns`` (measured memory uses the same):

- **parameters and buffers**: the weights the rank's generated module creates, at local shapes;
- **gradients**: the ``.grad`` of the local parameters and, with ZeRO, of the optimizer's shards,
  as the step makes and frees them (``cost.moments``): without ZeRO and under ZeRO stage 1 every
  gradient lives from the backward to the step (stage 1 reduce-scatters them into the shards when
  the optimizer steps); under stage 2 a bucket's gradients are reduce-scattered as soon as the
  backward has made them all;
- **optimizer state**: learnt per optimizer class by stepping it once on tiny tensors (``a * numel
  + b`` bytes per optimizer parameter: 0 for SGD, ``numel`` floats for momentum, two and a step
  counter for Adam), applied to the local parameters or, with ZeRO, to the shards. Shards follow
  the runtime's buckets: parameters in order, split at ``ComputeConfig.reduce_bucket_bytes`` and at
  dtype changes (``nbscaler.config.split_buckets``), each padded to
  a multiple of the ZeRO group size. Without master copies a shard is a view of the flat
  parameters, so it adds no bytes of its own; the parameters include the padding;
- **mixed precision** (``nbscaler.Recipe``, as ``build_optimizer(..., master_dtype=)``
  runs it): the optimizer updates master copies of the local parameters (with ZeRO, of the shards)
  in the master dtype; the copies count as optimizer state and the state is learnt in their dtype.
  Gradients are in the parameters' dtype until the synchronisation moves them onto the masters
  (``cost.moments``); ``nbscaler.columns`` gives the bytes per parameter this makes;
- **activations**: what autograd saves during the forward, from replaying the rank's code on fake
  tensors (``cost.local``), times the micro-batches in flight on each stage of a pipeline (under a
  split backward, from ``F`` to ``W``, except what ``W`` never reads: ``held_for_weights``). A
  recomputed module (``recompute_modules``) saves only its inputs, as ``torch.utils.checkpoint``
  keeps them; what its ops would have saved lives again only while the backward rebuilds it, one
  module at a time. That transient is left out of the table (the runtime's count of saved tensors
  does not see it either) and kept per module in ``LocalRun.rebuilt``; autodist adds the largest
  to the peak it checks against a memory limit, and ``plan.explain()`` states it.

Parameters, buffers and optimizer state are held throughout a step; gradients and activations
change with its moments (``nbscaler.columns.StepMoment``), and the table gives them at the moment
that holds the most, ``peak_bytes`` being the sum there. Everything here is exact for the runtime
as it is (the tests compare it with measured counts), except ops the fake replay cannot run
(data-dependent shapes), whose saved tensors are guessed with a warning.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, Type

import pandas as pd
import torch

from nbscaler.columns import MEMORY_CATEGORIES, MEMORY_COLUMNS, SummaryColumn as C
from nbscaler.comm.lower import lower_device, rank_sections, train_graph
from nbscaler.comm.placed import PlacedGraphs
from nbscaler.comm.program import RankProgram, Section
from nbscaler.config import ComputeConfig, split_buckets
from nbscaler.recipe import Recipe
from nbscaler.cost.local import LocalRun, run_local
from nbscaler.cost.fsdp import unit_bytes as fsdp_unit_bytes
from nbscaler.cost.gathered import GatheredUnits
from nbscaler.cost.moments import Gradients, step_moments, step_peak
from nbscaler.cost.ranks import LocalWeight, local_weights
from nbscaler.cost.same_sections import Replays
from nbscaler.ir.backward_split import BackwardPart, backward_parts
from nbscaler.ir.graph import IRNode
from nbscaler.layouts import Collective
from nbscaler.schedule import PipelineGeometry

# -- optimizer state ---------------------------------------------------------------------------
def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    seen, total = set(), 0
    for state in optimizer.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.untyped_storage()._cdata not in seen:
                seen.add(v.untyped_storage()._cdata)
                total += v.untyped_storage().nbytes()
    return total


@functools.lru_cache(maxsize=None)
def _state_line(optimizer: Type[torch.optim.Optimizer], kwargs: Tuple, dtype: torch.dtype) -> Tuple[int, int]:
    """``(a, b)``: one optimizer parameter of ``n`` elements gets ``a * n + b`` bytes of state."""
    sizes = []
    for n in (1, 5):
        p = torch.nn.Parameter(torch.zeros(n, dtype=dtype))
        p.grad = torch.ones_like(p)
        opt = optimizer([p], **dict(kwargs))
        opt.step()
        sizes.append(_state_bytes(opt))
    per_elem = (sizes[1] - sizes[0]) // 4
    return per_elem, sizes[0] - per_elem


def optimizer_state_bytes(optimizer: Type[torch.optim.Optimizer], optimizer_kwargs: Optional[Dict[str, Any]],
                          numel: int, dtype: torch.dtype) -> int:
    """Bytes of state ``optimizer`` keeps for one parameter of ``numel`` elements of ``dtype``."""
    kwargs = tuple(sorted((optimizer_kwargs or {}).items()))
    a, b = _state_line(optimizer, kwargs, dtype)
    return a * numel + b


# -- gradients and optimizer parameters --------------------------------------------------------
def buckets(params: List[LocalWeight], cfg: ComputeConfig) -> List[List[LocalWeight]]:
    """The reducer's buckets: consecutive parameters of one dtype, up to ``cfg.reduce_bucket_bytes``
    each; under ZeRO stage 3 one per unit and dtype (``runtime.fsdp.ShardedUnits``: units in the order
    of their first parameter, dtypes in the order each first comes in the unit)."""
    if _stage3(cfg):
        groups: Dict[str, Dict[torch.dtype, List[LocalWeight]]] = {}
        for p in params:
            if p.unit is not None:
                groups.setdefault(p.unit, {}).setdefault(p.dtype, []).append(p)
        return [b for by_dtype in groups.values() for b in by_dtype.values()]
    runs = split_buckets([(p.nbytes, p.dtype) for p in params], cfg.reduce_bucket_bytes)
    return [[params[i] for i in run] for run in runs]


def _stage3(cfg: ComputeConfig) -> bool:
    return cfg.use_zero and cfg.zero_stage == 3


def unit_bytes_held(params: List[LocalWeight], cfg: ComputeConfig, recipe: Recipe) -> Dict[str, int]:
    """ZeRO stage 3: each unit's bytes when gathered (its flat buckets, padded to a multiple of the
    ZeRO group, in the parameters' dtypes: ``cost.fsdp.unit_bytes``)."""
    unit_of = {p.name: p.unit for p in params}.get
    return {unit: b.gather_bytes for unit, b in fsdp_unit_bytes(params, unit_of, cfg.grid.zero_group_size, recipe).items()}


def completed_units(params: List[LocalWeight]) -> Set[str]:
    """The units whose every parameter the training backward gives a gradient (so the runtime
    reduces and frees them as it goes; the others wait for the optimizer step)."""
    units: Dict[str, bool] = {}
    for p in params:
        if p.unit is not None:
            units[p.unit] = units.get(p.unit, True) and p.trained
    return {unit for unit, complete in units.items() if complete}


def optimizer_params(params: List[LocalWeight], cfg: ComputeConfig) -> List[Tuple[int, torch.dtype]]:
    """``(numel, dtype)`` of each parameter the rank's optimizer updates: the local parameters, or
    with ZeRO one flat shard per bucket (``ceil(numel / N)`` elements for a group of ``N``)."""
    if not cfg.use_zero:
        return [(p.numel, p.dtype) for p in params]
    n = cfg.grid.zero_group_size
    return [(-(-sum(p.numel for p in b) // n), b[0].dtype) for b in buckets(params, cfg)]


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def weight_memory(weights: List[LocalWeight], cfg: ComputeConfig, recipe: Recipe) -> Dict[str, int]:
    """Parameters, optimizer state and buffers of one rank (bytes): what it holds at every moment,
    training with ``recipe``: with master copies the optimizer's bytes are the copies and their state."""
    params = [w for w in weights if w.kind == "param"]
    row = {C.PARAM_BYTES: sum(p.nbytes for p in params),
           C.BUFFER_BYTES: sum(w.nbytes for w in weights if w.kind != "param")}
    if cfg.inference_only:
        return {**row, C.OPTIMIZER_BYTES: 0}
    slots = optimizer_params(params, cfg)
    if _stage3(cfg):          # the shards alone, and not even those where master copies replace them
        row[C.PARAM_BYTES] = sum(numel * _itemsize(dt) for numel, dt in slots if recipe.master_of(dt) is None)
    elif cfg.use_zero:
        n = cfg.grid.zero_group_size
        row[C.PARAM_BYTES] = sum(numel * n * _itemsize(dt) for numel, dt in slots)     # flat, padded
    row[C.OPTIMIZER_BYTES] = 0
    for numel, dt in slots:
        master = recipe.master_of(dt)
        copy = numel * _itemsize(master) if master is not None else 0
        row[C.OPTIMIZER_BYTES] += copy + optimizer_state_bytes(recipe.optimizer, recipe.kwargs, numel, master or dt)
    return row


def gradients(weights: List[LocalWeight], cfg: ComputeConfig, recipe: Recipe) -> Gradients:
    """The rank's gradients at the start of a step (none), bucketed as its reducer buckets them,
    with the gradient bytes the synchronisation leaves per bucket on the optimizer's side: ZeRO's
    shard, or the master copies' without ZeRO (nothing without either)."""
    return Gradients(*gradient_buckets(weights, cfg, recipe))


def gradient_buckets(weights: List[LocalWeight], cfg: ComputeConfig,
                     recipe: Recipe) -> Tuple[List[List[LocalWeight]], List[int], int, List[LocalWeight]]:
    """``Gradients``' arguments for ``gradients`` (buckets, shard bytes, ZeRO stage, parameter order): what a step starts from, which a sweep keeps for
    the configurations that share it (of ``cfg`` it reads the bucket size and ZeRO's stage and group)."""
    params = [w for w in weights if w.kind == "param"]
    groups = buckets(params, cfg)
    if not cfg.use_zero and all(recipe.master_of(p.dtype) is None for p in params):
        return groups, [], 0, params
    # Without ZeRO the optimizer's parameters are one per parameter; the bytes are summed per bucket.
    updated = [numel * _itemsize(recipe.master_of(dt) or dt) for numel, dt in optimizer_params(params, cfg)]
    if cfg.use_zero:
        return groups, updated, cfg.zero_stage, params
    sizes = iter(updated)
    return groups, [sum(next(sizes) for _ in b) for b in groups], 0, params


# -- activations -------------------------------------------------------------------------------
WeightsOf = Callable[[int], List[LocalWeight]]
ProgramOf = Callable[[int], RankProgram]
"""plan device -> its lowered program (``comm.lower``, e.g. ``plan.programs.device``)."""


def stage_runs(placed: PlacedGraphs, device: int, program: Optional[RankProgram] = None,
               replay: Optional[Callable[[Section], LocalRun]] = None) -> Dict[Optional[int], LocalRun]:
    """The training forward of plan ``device`` replayed on fake tensors, per stage it holds
    (key ``None`` without a pipeline), each section by ``replay`` (``run_local`` by default)."""
    program = program or lower_device(placed.graphs, placed.storage, device, placed.geometry)
    graph = train_graph(placed.graphs)
    replay = replay or run_local
    return {sec.stage: replay(sec) for sec in program.sections if sec.graph is graph}


DeviceRuns = Dict[int, Dict[Optional[int], LocalRun]]
"""plan device -> its ``stage_runs``: what the memory table and the step model both replay."""


def device_runs(placed: PlacedGraphs, program_of: Optional[ProgramOf] = None, imbalance: float = 1.0) -> DeviceRuns:
    """``stage_runs`` of every plan device, computed once for callers that need them twice.

    Devices whose programs are the same up to their rank (the members of one tensor-parallel group:
    the same nodes, each on the same group) replay the same way, so one of them is replayed and the
    others get its run under their own number. A device's place in a group changes only which piece
    a collective keeps and whether ``first_only`` keeps its values (the first device) or makes
    zeros (the others), so a run is shared only where its collectives cut evenly, and only between
    devices that are first in the same ``first_only`` groups (``_shares``).

    The devices left to replay share again where their sections are the same but for names: the
    stages of repeated layers (``cost.same_sections``). ``imbalance``: the routing priced
    (``Recipe.expert_imbalance``, ``run_local``)."""
    with paused_gc():
        return _device_runs(placed, program_of, imbalance)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Python's cycle collector off for a while: a replay allocates many small objects, which
    makes it walk every object of the process (a 70B plan's graphs are over half a million) several
    times, 0.3 s or more each; what the replay leaves is collected once it is back on."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _device_runs(placed: PlacedGraphs, program_of: Optional[ProgramOf], imbalance: float) -> DeviceRuns:
    cfg, geometry = placed.config, placed.geometry
    graph = train_graph(placed.graphs)
    replays = Replays(imbalance)
    by_stage: Dict[Optional[int], List[IRNode]] = {}
    for n in graph.nodes:
        by_stage.setdefault(n.stage if geometry is not None else None, []).append(n)
    replayed: Dict[Tuple, List[Dict[Optional[int], LocalRun]]] = {}
    out: DeviceRuns = {}
    for device in range(cfg.plan_ngpus):
        secs = rank_sections({"train": graph}, device, geometry)
        views = {sec.stage: sec.device for sec in secs}
        key = tuple(_program_key(by_stage.get(sec.stage, []), sec.device, sec.stage) for sec in secs)
        twin = next((t for t in replayed.get(key, []) if all(_shares(r, views[s]) for s, r in t.items())), None)
        if twin is not None:
            out[device] = {s: _renumbered(run, views[s]) for s, run in twin.items()}
        else:
            program = program_of(device) if program_of is not None else None
            out[device] = stage_runs(placed, device, program, replays.run)
            replayed.setdefault(key, []).append(out[device])
    return out


def _program_key(nodes: List[IRNode], device: int, stage: Optional[int]) -> Tuple:
    """What ``run_local`` of ``device`` depends on besides its place in each group: the nodes it
    runs and the group of each, and the stage's whole group (which gathers the stage's outputs)."""
    mine = tuple((i, n.placement.devices) for i, n in enumerate(nodes) if device in n.placement.devices)
    return stage, mine, tuple(sorted({d for n in nodes for d in n.placement.devices}))


_CUTS = {Collective.CHUNK: 1, Collective.REDUCE_SCATTER: 1, Collective.ALL_TO_ALL: 0}     # collectives that keep one piece of n


def _first(device: int, group: Tuple[int, ...]) -> bool:
    """Whether ``device`` is at index 0 of ``group``, as the replay finds its index."""
    return device not in group or group[0] == device


def _shares(run: LocalRun, device: int) -> bool:
    """Whether ``device`` would replay ``run`` (of another device of the same program) the same:
    every piece a collective kept is exactly ``1/n`` of a non-empty tensor it cut (so the cut
    divides evenly and all pieces have one shape), and ``device`` is first in a ``first_only``
    group exactly where ``run.device`` is."""
    for c in run.collectives:
        if len(c.devices) < 2:
            continue
        if c.fn in _CUTS and not (c.in_bytes > 0 and c.out_bytes * len(c.devices) ** _CUTS[c.fn] == c.in_bytes):
            return False
        if c.fn == Collective.FIRST_ONLY and _first(device, c.devices) != _first(run.device, c.devices):
            return False
    return True


def _renumbered(run: LocalRun, device: int) -> LocalRun:
    """``run`` as replayed by ``device``: the same ops, collectives and saved bytes."""
    return LocalRun(device, run.stage, list(run.ops), list(run.collectives), dict(run.saved), run.exact,
                    dict(run.rebuilt), list(run.units))


def in_flight_peak(saved: Dict[Optional[int], int], geometry: Optional[PipelineGeometry], device: int,
                   held_for_w: Optional[Dict[Optional[int], int]] = None) -> int:
    """The most bytes saved at once: one forward without a pipeline; with one, the running total
    over the device's blocks (a forward adds its stage's bytes, the backward frees them; a split
    backward's ``B`` frees all but ``held_for_w`` of them, default all kept, and ``W`` the rest)."""
    if geometry is None:
        return saved[None]
    return max(h.activation_bytes for h in step_moments(Gradients([], [], 0), [], saved, geometry, device, held_for_w))


def held_for_weights(run: LocalRun, parts: Dict[str, BackwardPart]) -> int:
    """Of what a stage's forward saved, the bytes a split backward's ``B`` leaves for ``W``: those
    of the ops whose gradient ``W`` runs (a weight-side input: ``B+W`` or ``W`` in ``parts``, node
    name -> ``ir.backward_split.backward_parts``) and of every op that feeds one, which ``W``'s
    starting nodes reach. The ops after the stage's last weight (the loss and its log-softmax on
    the last stage) feed none: nothing refers to them once ``B`` has run
    (``runtime.split_backward``), so they die there. A stage whose ``W`` walks its whole graph
    again (a weight read twice along its data path) keeps everything until ``W``; this count does
    not see that case."""
    tail = feeding_no_weight([op.node for op in run.ops],
                             lambda n: parts[n.name] in (BackwardPart.W, BackwardPart.BOTH))
    keys = dict.fromkeys(k for op in run.ops if op.node.name not in tail for k in op.saved_keys)
    return sum(run.saved[k] for k in keys)


def feeding_no_weight(nodes: Sequence[IRNode], reads_weight: Callable[[IRNode], bool]) -> Set[str]:
    """The names of ``nodes`` (in forward order) whose outputs reach no node that ``reads_weight``:
    what a split backward's ``W`` never walks."""
    needed: Set[int] = set()
    tail: Set[str] = set()
    for node in reversed(nodes):
        if reads_weight(node) or any(id(t) in needed for t in node.output_tensors):
            needed.update(id(t) for t in node.inputs)
        else:
            tail.add(node.name)
    return tail


def gathered_units(params: List[LocalWeight], runs: Dict[Optional[int], LocalRun], cfg: ComputeConfig,
                   recipe: Recipe) -> Optional[GatheredUnits]:
    """ZeRO stage 3's gathered parameters for ``cost.moments`` (``None`` otherwise): each unit's
    bytes, the forwards' gathers and frees as replayed, and the units whose backward completes."""
    if not _stage3(cfg):
        return None
    return GatheredUnits(unit_bytes_held(params, cfg, recipe), {s: r.units for s, r in runs.items()},
                         completed_units(params))


def annotate_saved_bytes(runs: Dict[Optional[int], LocalRun]) -> None:
    """The pass: ``node.meta['local_saved_bytes'][device]``, what each node newly saves for the
    backward on each device that runs it."""
    for run in runs.values():
        for op in run.ops:
            op.node.meta.setdefault("local_saved_bytes", {})[run.device] = op.saved_bytes


# -- the table ---------------------------------------------------------------------------------
def memory_per_rank(placed: PlacedGraphs, recipe: Recipe, runs: Optional[DeviceRuns] = None,
                    weights_of: Optional[WeightsOf] = None) -> pd.DataFrame:
    """Predicted memory of every runtime rank at the peak of a training step, by category (bytes).

    Args:
        placed: the placed graphs, how each weight is stored, the config (ZeRO, units, pipeline)
            and the pipeline geometry.
        recipe: how the run trains: the optimizer (its state is learnt by stepping it on tiny
            tensors), its keywords (``momentum``, ``amsgrad``, ... change the state) and the
            master copies (``build_optimizer``'s).
        runs: ``device_runs`` of the plan (for ``recipe.expert_imbalance``), when the caller has them already.
        weights_of: plan device -> its weight table (``plan.programs.weights``), when the caller has them.

    Returns:
        One row per rank with the columns ``rank``, ``param_bytes``, ``gathered_bytes``, ``grad_bytes``,
        ``optimizer_bytes``, ``buffer_bytes``, ``activation_bytes``, ``peak_bytes``: each
        category as held at the rank's peak moment (``nbscaler.columns``).
    """
    cfg, geometry = placed.config, placed.geometry
    by_device: Dict[int, Dict[str, int]] = {}
    parts = None
    if geometry is not None and geometry.schedule.splits_backward and not cfg.inference_only:
        graph = train_graph(placed.graphs)
        parts = {n.name: part for n, part in zip(graph.nodes, backward_parts(graph))}
    for device in range(cfg.plan_ngpus):
        weights = weights_of(device) if weights_of is not None else local_weights(placed, device)
        row = weight_memory(weights, cfg, recipe)
        row[C.GATHERED_BYTES] = 0
        if cfg.inference_only:
            row[C.GRAD_BYTES] = row[C.ACTIVATION_BYTES] = 0
        else:
            stages = runs[device] if runs is not None else stage_runs(
                placed, device, replay=functools.partial(run_local, imbalance=recipe.expert_imbalance))
            annotate_saved_bytes(stages)
            saved = {s: r.saved_bytes for s, r in stages.items()}
            held_for_w = ({s: held_for_weights(r, parts) for s, r in stages.items()}
                          if parts is not None else None)
            params = [w for w in weights if w.kind == "param"]
            held = step_peak(gradients(weights, cfg, recipe), params, saved, geometry, device, held_for_w,
                             gathered_units(params, stages, cfg, recipe))
            row[C.GRAD_BYTES], row[C.ACTIVATION_BYTES] = held.grad_bytes, held.activation_bytes
            row[C.GATHERED_BYTES] = held.gathered_bytes
        row[C.PEAK_BYTES] = sum(row[c] for c in MEMORY_CATEGORIES)
        by_device[device] = row
    rows = [{C.RANK: r, **by_device[cfg.device_of(r)]} for r in range(cfg.runtime_ngpus)]
    return pd.DataFrame(rows, columns=[str(c) for c in MEMORY_COLUMNS]).rename(columns=str)
