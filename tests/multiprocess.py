"""The one place where tests start several ranks, and the equivalence harness built on it.

Every multi-process test goes through ``run_ranks``, which always has a timeout: a hung collective
fails the test with the ranks that never finished instead of stalling the suite.

The equivalence harness trains a model from ``tests.models`` on every rank through ``parallelize``
and the same model in this process, and compares losses, gradients and clipped gradient norms step
by step, then the final parameters. Unit ``u`` of the parallel run gets the batch seeded
``step * 100 + u``; the single-process reference sums the losses of all units' batches, which is
what summed data-parallel gradients equal.
"""

from __future__ import annotations

import functools
import os
import tempfile
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from nbscaler import ComputeConfig, ParallelModule, build_optimizer, merge_state_dicts, parallelize
from nbscaler.config import PIPELINE_KEYS
from nbscaler.comm.placed import PlacedGraphs
from nbscaler.recipe import Recipe
from nbscaler.planning.planner import build_module, cast_floats
from nbscaler.reference import MATCH_RTOL, call_with_kwargs, reference_run
from nbscaler.runtime.checkpoint import local_pieces, merge_slices
from nbscaler.runtime.initialize import init_module
from nbscaler.runtime.launch import spawn
from tests.models import batch, build

DEFAULT_TIMEOUT = 240.0
RTOL = MATCH_RTOL
EVAL_SEED = 999
INIT = "init"           # Case.weights: the module's own initialisation, per rank, seeded with INIT_SEED
INIT_SEED = 7


def run_ranks(fn: Callable[..., Any], nranks: int, *args: Any, timeout: float = DEFAULT_TIMEOUT) -> List[Any]:
    """Run ``fn(*args)`` on ``nranks`` gloo ranks and return their results in rank order."""
    return spawn(fn, nranks, *args, timeout=timeout)


def run_cases(fn: Callable[..., List[Any]], nranks: int, cases: Sequence["Case"], gen_dir: str) -> Dict["Case", List[Any]]:
    """Run ``fn(cases, gen_dir)`` (one result per case) on ``nranks`` ranks in one spawn; returns
    each case's results in rank order."""
    per_rank = run_ranks(fn, nranks, cases, gen_dir)
    return {case: [res[i] for res in per_rank] for i, case in enumerate(cases)}


# Adam's eps is large on purpose: a gradient that is zero in exact arithmetic (an attention key bias)
# comes out as ~1e-9 of rounding noise whose sign depends on the order of the sums, and a small eps
# would turn that noise into full-size steps that differ between any two summation orders.
OPTIMIZERS: Dict[str, Tuple[type, Dict[str, Any]]] = {
    "sgd": (torch.optim.SGD, {"lr": 0.1}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "weight_decay": 0.1, "eps": 1e-4}),
    "momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adam_amsgrad": (torch.optim.Adam, {"lr": 0.01, "amsgrad": True, "eps": 1e-4}),
}


@dataclass(frozen=True)
class Case:
    """One training run to compare. ``config`` holds extra ComputeConfig keywords as pairs, e.g.
    ``(("use_end2end", True), ("use_pipeline", True), ("pipeline_nmicros", 4))``; ``clip`` is
    clip_gnorm's max_norm before every step. ``module_dtype`` compiles the model in that dtype and
    ``master_dtype``/``grad_reduce_dtype`` go to ``build_optimizer`` (mixed precision)."""

    model: str
    policy: Any
    plan_ngpus: int
    runtime_ngpus: int
    steps: int = 3
    config: tuple = ()
    optimizer: str = "sgd"
    clip: Optional[float] = None
    weights: str = ""       # built on meta and materialised per rank: from this checkpoint, or INIT
    module_dtype: Optional[torch.dtype] = None
    master_dtype: Optional[torch.dtype] = None
    grad_reduce_dtype: Optional[torch.dtype] = None
    float8: Optional[str] = None      # Recipe(float8=...): nn.Linear products in fp8, torchao's recipe of that name

    @property
    def recipe(self) -> Optional[Recipe]:
        """The recipe ``parallelize`` is given: one with ``float8`` where the case has it."""
        return Recipe(float8=self.float8, master_dtype=self.master_dtype) if self.float8 else None

    @property
    def on_meta(self) -> bool:
        return bool(self.weights)

    def __str__(self) -> str:
        clip = f"_clip{self.clip}" if self.clip is not None else ""
        return f"{self.instance_name}_{self.optimizer}_{self.steps}steps{clip}"

    @property
    def unit_ngpus(self) -> int:
        """Devices per unit the plan runs with: ``plan_ngpus``, or the unit size autodist is told
        to use (``autodist_plan_ngpus``)."""
        chosen = self.compute_config.pas_config.get("autodist_plan_ngpus")
        return chosen if isinstance(chosen, int) else self.plan_ngpus

    @property
    def units(self) -> int:
        return self.runtime_ngpus // self.unit_ngpus

    @property
    def compute_config(self) -> ComputeConfig:
        return ComputeConfig(plan_ngpus=self.plan_ngpus, runtime_ngpus=self.runtime_ngpus, **dict(self.config))

    @property
    def instance_name(self) -> str:
        cfg = self.compute_config
        name = f"{self.model}_{getattr(self.policy, '__name__', self.policy)}_{self.plan_ngpus}_{self.runtime_ngpus}"
        name += "_" + cfg.scheduler if cfg.use_pipeline else ""
        name += f"_v{cfg.virtual_stages}" if cfg.use_pipeline and cfg.virtual_stages else ""
        name += "".join(f"_{k}{v}" for k, v in sorted(cfg.pas_config.items()) if k not in PIPELINE_KEYS)
        name += "_init" if self.weights == INIT else ("_files" if self.weights else "")
        name += f"_{self.module_dtype}".replace("torch.", "") if self.module_dtype is not None else ""
        name += f"_fp8{self.float8}" if self.float8 else ""
        return name + (f"_zero{cfg.zero_ngroups}_stage{cfg.zero_stage}" if cfg.use_zero else "")

    def make_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer:
        """The case's optimizer: patched by ``build_optimizer`` when ``model`` has parallel parts."""
        cls, kwargs = OPTIMIZERS[self.optimizer]
        if any(isinstance(m, ParallelModule) for m in model.modules()):
            return build_optimizer(model, cls, master_dtype=self.master_dtype,
                                   grad_reduce_dtype=self.grad_reduce_dtype, **kwargs)
        return cls(model.parameters(), **kwargs)

    @property
    def micros(self) -> int:
        cfg = self.compute_config
        return cfg.pipeline_nmicros if cfg.use_pipeline else (2 if cfg.use_end2end else 1)


def pipeline(scheduler: str, nstages: int, nmicros: int, virtual_stages: Optional[int] = None) -> tuple:
    """The ``Case.config`` of an end2end pipeline (with ``virtual_stages`` stages on each pipeline
    device: ``pipeline_virtual_stages``)."""
    virtual = (("pipeline_virtual_stages", virtual_stages),) if virtual_stages is not None else ()
    return (("use_end2end", True), ("use_pipeline", True), ("pipeline_scheduler", scheduler),
            ("pipeline_nstages", nstages), ("pipeline_nmicros", nmicros)) + virtual


def zero(ngroups: int = 1, stage: int = 1) -> tuple:
    """The ``Case.config`` of ZeRO stage ``stage`` with ``ngroups`` groups."""
    return (("use_zero", True), ("zero_ngroups", ngroups), ("zero_stage", stage))


def buckets(nbytes: int) -> tuple:
    """The ``Case.config`` whose reducers sum gradients in buckets of at most ``nbytes``."""
    return (("reduce_bucket_bytes", nbytes),)


def recompute(*names: str) -> tuple:
    """The ``Case.config`` that recomputes the named modules in the backward."""
    return (("pas_config", (("recompute_modules", names),)),)


def granular(granularity: str, sequence_parallel: bool = False) -> tuple:
    """The ``Case.config`` of ``pas_config['recompute']`` (none, selective or full), with sequence
    parallelism too when asked."""
    return (("pas_config", (("recompute", granularity),) + ((("sequence_parallel", True),) if sequence_parallel
                                                             else ())),)


def sequence_parallel() -> tuple:
    """The ``Case.config`` of tensor parallelism with sequence parallelism."""
    return (("pas_config", (("sequence_parallel", True),)),)


def context_parallel(n: int, kind: str = "all_gather", **pas_config: Any) -> tuple:
    """The ``Case.config`` of context parallelism over ``n`` devices, keys and values read as
    ``kind`` (with further ``pas_config`` keys, such as ``recompute``)."""
    return (("pas_config", (("context_parallel", n), ("context_parallel_kind", kind)) + tuple(pas_config.items())),)


def expert_parallel(n: int, around: str = "data", hidden: int = 1) -> tuple:
    """The ``Case.config`` of expert parallelism over ``n`` devices (``n`` groups of ``hidden``, each
    cutting its experts by hidden unit, with ``hidden > 1``), the layers around the experts split by
    batch (``around='data'``) or tensor-parallel (``'tp'``)."""
    extra = (("around_experts", around),) if around != "data" else ()
    extra += (("expert_tensor_parallel", hidden),) if hidden > 1 else ()
    return (("pas_config", (("expert_parallel", n),) + extra),)


def data_seed(step: int, unit: int, micro: int = 0) -> int:
    return step * 100 + unit * 10 + micro


def samples(case: Case, step: int, unit: int) -> List[Dict[str, Any]]:
    """The forward arguments of each micro-batch unit ``unit`` trains on at ``step`` (floating-point
    ones in the case's ``module_dtype``)."""
    return [cast_floats(batch(case.model, data_seed(step, unit, m)), case.module_dtype) for m in range(case.micros)]


def step_losses(model: torch.nn.Module, case: Case, args: List[Dict[str, Any]]) -> List[Any]:
    """Forward (and, for end2end modules, backward) of one step; returns the loss tensors."""
    if case.compute_config.use_end2end:
        return model.train_step([first_arg(a) for a in args])
    return [model(**a) for a in args]


def first_arg(kwargs: Dict[str, Any]) -> Any:
    """An end2end module's sample: the value of forward's first argument."""
    return next(iter(kwargs.values()))


def parallel_model(case: Case, gen_dir: str) -> torch.nn.Module:
    """The case's model with ``parallelize`` applied: to the whole model, or, for ``with_trunk``,
    only to its ``trunk`` submodule (the rest stays plain torch)."""
    cfg, name = case.compute_config, case.instance_name
    if case.on_meta:
        with torch.device("meta"):
            model = build(case.model)
        weights = None if case.weights == INIT else case.weights
        return parallelize(model, batch(case.model, 12345), case.policy, cfg, gen_savedir=gen_dir,
                           instance_name=name, reuse="override", weights=weights, init_seed=INIT_SEED)
    model = build(case.model)
    if case.model == "with_trunk":
        model.trunk = parallelize(model.trunk, {"x": torch.randn(8, 16)}, case.policy, cfg, gen_savedir=gen_dir,
                                  instance_name=name, reuse="override", module_dtype=case.module_dtype)
        return model
    return parallelize(model, batch(case.model, 12345), case.policy, cfg, gen_savedir=gen_dir,
                       instance_name=name, reuse="override", module_dtype=case.module_dtype, recipe=case.recipe)


def plain_grads(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Gradients of the parameters outside parallel modules, by their names in ``model``."""
    inside = {id(p) for m in model.modules() if isinstance(m, ParallelModule) for p in m.parameters()}
    return {n: p.grad.clone() for n, p in model.named_parameters() if id(p) not in inside and p.grad is not None}


def parallel_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, case: Case, steps: Iterable[int],
                   unit: int) -> Dict[str, list]:
    """Train ``steps`` on this rank; returns its losses (one per micro-batch), its gradient slices
    (not with ZeRO, where a rank keeps only its shard of the summed gradient) and clipped norms."""
    out: Dict[str, list] = {"losses": [], "grads": [], "norms": []}
    for step in steps:
        losses = step_losses(model, case, samples(case, step, unit))
        if not case.compute_config.use_end2end:
            sum(losses).backward()
        opt.sync_shard_grad()
        out["losses"].append([float(l) for l in losses])
        if not case.compute_config.use_zero:
            out["grads"].append((local_pieces(model, grads=True), plain_grads(model)))
        if case.clip is not None:
            out["norms"].append(opt.clip_gnorm(case.clip).item())
        opt.step()
        opt.zero_grad()
    return out


def single_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, case: Case, steps: Iterable[int],
                 units: int) -> Dict[str, list]:
    """The reference for ``parallel_steps`` (``nbscaler.reference.reference_run``): one process,
    the losses of ``units`` units summed; what ``parallel_steps`` records, per unit."""
    run = reference_run(model, opt, functools.partial(samples, case), steps=steps, units=units,
                        loss_of=call_with_kwargs, clip=case.clip, keep_grads=True)
    return {"losses": run.losses, "grads": run.grads, "norms": run.norms}


def load_state_of_kind(model: torch.nn.Module, opt: torch.optim.Optimizer, kind: str, sd: Dict[str, Any],
                       osd: Dict[str, Any]) -> None:
    """Load a checkpoint of ``kind`` ('full': per rank, 'deduped' or 'merged') into a model and its
    optimizer, the way that kind loads."""
    from nbscaler import load_deduped_state_dict, load_merged_state_dicts
    if kind == "full":
        model.load_state_dict(sd)
        opt.load_state_dict(osd)
    elif kind == "deduped":
        load_deduped_state_dict(model, sd, opt, osd)
    else:
        load_merged_state_dicts(model, sd, opt, osd)


def eval_losses(model: torch.nn.Module, case: Case) -> List[float]:
    """Eval-mode losses: of each micro-batch for end2end modules, else of one batch."""
    end2end = case.compute_config.use_end2end
    args = [batch(case.model, EVAL_SEED + m) for m in range(case.micros if end2end else 1)]
    model.eval()
    with torch.no_grad():
        if end2end and isinstance(model, ParallelModule):
            out = model.infer_step([first_arg(a) for a in args])
        else:
            out = [model(**a) for a in args]
    return [float(o[0] if isinstance(o, (tuple, list)) else o) for o in out]


def optimizer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of tensors in the optimizer's state (Adam: exp_avg, exp_avg_sq and step)."""
    return sum(v.numel() * v.element_size() for state in opt.state.values() for v in state.values()
               if isinstance(v, torch.Tensor))


def train_parallel(cases: Sequence[Case], gen_dir: str) -> List[Dict[str, Any]]:
    """On every rank: compile and train each case; returns what ``parallel_steps`` records, the
    eval losses, the final per-rank state dict and the optimizer state's size."""
    return [train_case(case, parallel_model(case, gen_dir)) for case in cases]


def train_case(case: Case, model: torch.nn.Module) -> Dict[str, Any]:
    """Train the parallelized ``model`` of ``case`` on this rank (see ``train_parallel``)."""
    opt = case.make_optimizer(model)
    compiled = next(m for m in model.modules() if isinstance(m, ParallelModule))
    assert compiled.compute_config.plan_ngpus == case.unit_ngpus, (case, compiled.compute_config)
    out = parallel_steps(model, opt, case, range(case.steps), compiled.compute_config.unit_of(dist.get_rank()))
    return {**out, "eval_loss": eval_losses(model, case), "state": model.state_dict(),
            "optimizer_bytes": optimizer_state_bytes(opt)}


def train_materialised(cases: Sequence[Case], gen_dir: str) -> List[Dict[str, Any]]:
    """``train_parallel`` for cases built on meta, adding each rank's slices as materialised
    (``initial``), the bytes it read from the checkpoint (``read_bytes``) and the bytes of the
    slices of checkpointed tensors it holds (``share_bytes``)."""
    from nbscaler.runtime.sources import Safetensors
    read, counted = Safetensors.read, [0]

    def counting(self, spec):
        out = read(self, spec)
        counted[0] += out.numel() * out.element_size()
        return out

    Safetensors.read = counting
    try:
        results = []
        for case in cases:
            before = counted[0]
            model = parallel_model(case, gen_dir)
            initial = local_pieces(model)
            share = sum(t.numel() * t.element_size() for spec, t in initial if spec.saved)
            results.append({**train_case(case, model), "initial": initial, "read_bytes": counted[0] - before,
                            "share_bytes": share})
        return results
    finally:
        Safetensors.read = read


def train_single(case: Case) -> Dict[str, Any]:
    """The reference: one process, the losses of all units summed before backward. A case built on
    meta starts from its checkpoint, or from the whole module's seeded initialisation."""
    model = reference_model(case)
    out = single_steps(model, case.make_optimizer(model), case, range(case.steps), case.units)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {**out, "eval_loss": eval_losses(model, case), "params": params}


def reference_loss_scaled(case: Case, init_scale: float, backoff: float, interval: int,
                          growth: float = 2.0) -> Dict[str, Any]:
    """fp16 with fp32 masters and dynamic loss scaling in one process, written out plainly: each
    unit's loss times the scale backward on its own; the units' fp16 gradients summed in fp32 and
    divided by the scale; a step whose gradients are not all finite is skipped and lowers the scale
    by ``backoff``, and ``interval`` good steps in a row raise it by ``growth``."""
    model = build(case.model).to(case.module_dtype)
    params = list(model.parameters())
    masters = [p.detach().to(case.master_dtype).requires_grad_() for p in params]
    cls, kwargs = OPTIMIZERS[case.optimizer]
    opt = cls(masters, **kwargs)
    scale, good = init_scale, 0
    out: Dict[str, List[Any]] = {"losses": [], "scales": [], "skipped": []}
    for step in range(case.steps):
        sums = [torch.zeros_like(m) for m in masters]
        unit_losses = []
        for unit in range(case.units):
            loss = model(**samples(case, step, unit)[0])
            (loss * scale).backward()
            for total, p in zip(sums, params):
                total += p.grad
                p.grad = None
            unit_losses.append(loss.item())
        for master, total in zip(masters, sums):
            master.grad = total / scale
        overflowed = not all(torch.isfinite(m.grad).all() for m in masters)
        out["losses"].append(unit_losses)
        out["scales"].append(scale)
        out["skipped"].append(overflowed)
        if overflowed:
            scale, good = scale * backoff, 0
            continue
        opt.step()
        with torch.no_grad():
            for p, master in zip(params, masters):
                p.copy_(master)
        good += 1
        if good == interval:
            scale, good = scale * growth, 0
    return {**out, "scale": scale, "params": [p.detach() for p in params]}


def reference_model(case: Case) -> torch.nn.Module:
    """The case's model in one process, with the values its parallel run starts from."""
    if case.weights == INIT:
        with torch.device("meta"):
            model = build(case.model)
        return init_module(model, INIT_SEED)
    model = build(case.model)
    if case.weights:
        load_checkpoint(model, case.weights)
    if case.float8:                   # the one-process fp8 recipe: torchao's own float8 training
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        model = convert_to_float8_training(model.to(case.module_dtype or torch.float32),
                                           config=Float8LinearConfig.from_recipe_name(case.float8))
    return model


def save_checkpoint(name: str, folder: str) -> str:
    """Write model ``name`` (built with the harness's seed) into ``folder`` as safetensors: a
    transformers model with ``save_pretrained`` in shards with an index, the others in one file."""
    from safetensors.torch import save_file
    model = build(name)
    os.makedirs(folder, exist_ok=True)
    if hasattr(getattr(model, "model", None), "save_pretrained"):
        model.model.save_pretrained(folder, safe_serialization=True, max_shard_size="40KB")
    else:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(folder, "model.safetensors"))
    return folder


def load_checkpoint(model: torch.nn.Module, folder: str) -> None:
    """Load every ``*.safetensors`` file in ``folder`` into ``model`` (strictly; names saved from a
    transformers model inside its wrapper get the wrapper's ``model.`` prefix)."""
    from safetensors.torch import load_file
    state: Dict[str, torch.Tensor] = {}
    for file in sorted(os.listdir(folder)):
        if file.endswith(".safetensors"):
            state.update(load_file(os.path.join(folder, file)))
    prefix = "model." if hasattr(getattr(model, "model", None), "save_pretrained") else ""
    model.load_state_dict({prefix + k: v for k, v in state.items()}, strict=True)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = RTOL) -> None:
    """Norm-wise relative error ``|a - e| <= rtol * |e|`` (plus a hair for all-zero tensors)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual.double() - expected.double()).norm().item()
    scale = expected.double().norm().item()
    assert err <= rtol * scale + 1e-9, f"{what}: relative error {err / max(scale, 1e-30):.2e} > {rtol}"


def check_equivalence(case: Case, per_rank: List[Dict[str, Any]], rtol: float = RTOL,
                      loss_rtol: Optional[float] = None) -> None:
    """Losses of every rank, merged gradients (not with ZeRO) and clipped norms equal the
    single-process run at every step, and so do the final parameters and the eval-mode loss
    afterwards (with one unit: BatchNorm statistics are per unit, as in DDP): within ``rtol``
    (norm-wise), losses within ``loss_rtol`` (default ``rtol``)."""
    loss_rtol = rtol if loss_rtol is None else loss_rtol
    close = functools.partial(assert_close, rtol=rtol)
    ref = train_single(case)
    for step in range(case.steps):
        for rank, res in enumerate(per_rank):
            unit = rank // case.unit_ngpus
            expected = torch.tensor(ref["losses"][step][unit])
            close(torch.tensor(res["losses"][step]), expected, f"{case} step {step} rank {rank} loss",
              rtol=loss_rtol)
        if case.clip is not None:
            for rank, res in enumerate(per_rank):
                close(torch.tensor(res["norms"][step]), torch.tensor(ref["norms"][step]),
                      f"{case} step {step} rank {rank} clipped norm")
        if case.compute_config.use_zero:
            continue
        merged = merge_slices(p for res in per_rank for p in res["grads"][step][0])
        prefix = "trunk." if case.model == "with_trunk" else ""
        merged = {prefix + name: t for name, t in merged.items()}
        for res in per_rank:
            merged.update(res["grads"][step][1])
        for name, expected in ref["grads"][step].items():
            assert name in merged, f"{case}: no gradient for {name} at step {step}"
            close(merged[name], expected, f"{case} step {step} grad {name}")
    if all("state" in res for res in per_rank):        # runs that return their final state dicts
        final, _ = merge_state_dicts([res["state"] for res in per_rank])
        for name, expected in ref["params"].items():
            close(final[name], expected, f"{case} final {name}")
    if case.units == 1:
        for rank, res in enumerate(per_rank):
            close(torch.tensor(res["eval_loss"]), torch.tensor(ref["eval_loss"]), f"{case} rank {rank} eval loss",
              rtol=loss_rtol)


def measure_memory(cases: Sequence[Case], gen_dir: str, steps: int = 2) -> List[Dict[str, int]]:
    """On every rank: compile each case and train ``steps`` steps; returns, per case, the memory the
    last step measured (``nbscaler.runtime.memory.MemoryMeter`` from the forward to after
    ``optimizer.step()``: what is held at the step's peak moment)."""
    from nbscaler.runtime.memory import MemoryMeter
    rank = dist.get_rank() if dist.is_initialized() else 0
    results = []
    for case in cases:
        model = parallel_model(case, gen_dir)
        opt = case.make_optimizer(model)
        for step in range(steps):
            opt.zero_grad()
            with MemoryMeter(model, opt) as meter:
                losses = step_losses(model, case, samples(case, step, rank // case.plan_ngpus))
                if not case.compute_config.use_end2end:
                    sum(losses).backward()
                opt.step()
        results.append(meter.stats())
    return results


def plan_inputs(case: Case) -> Tuple[Dict[str, Any], Dict[str, Any], ComputeConfig, Any]:
    """``(graphs, storage, compute_config, geometry)`` of the case's plan, as the cost model takes them."""
    from nbscaler.comm.layout import storage_layouts
    from nbscaler.policy.builtin import get_policy
    from nbscaler.policy.checks import check_placements
    from nbscaler.policy.recompute import mark_recompute
    from nbscaler.policy.shard_units import mark_shard_units
    from nbscaler.schedule import PipelineGeometry
    from nbscaler.trace.modes import trace_modes
    cfg = case.compute_config
    module = build_module(build(case.model), None, case.module_dtype)
    graphs = trace_modes(module, cast_floats(batch(case.model, 12345), case.module_dtype), cfg)
    for mode in graphs:
        graphs[mode] = get_policy(case.policy)(graphs[mode], cfg)
        check_placements(graphs[mode], cfg)
        mark_shard_units(graphs[mode], cfg)
        if mode != "eval":
            mark_recompute(graphs[mode], cfg)
    geometry = PipelineGeometry.from_config(cfg) if cfg.use_pipeline else None
    return graphs, storage_layouts(graphs.values(), cfg.sums_partial_grads_after_backward), cfg, geometry


def predicted_memory(case: Case) -> List[Dict[str, int]]:
    """The memory model's rows for the case, with the case's optimizer and master copies."""
    from nbscaler.cost.memory import memory_per_rank
    cls, kwargs = OPTIMIZERS[case.optimizer]
    recipe = Recipe(cls, kwargs, master_dtype=case.master_dtype, grad_reduce_dtype=case.grad_reduce_dtype,
                    float8=case.float8)
    return memory_per_rank(PlacedGraphs(*plan_inputs(case)), recipe).to_dict("records")


# -- the same checks through a notebook cluster ------------------------------------------------------

def case_batch(case: Case, step: int, unit: int) -> Any:
    """What ``RemoteModule.train`` feeds the ranks: the harness's batch, or its micro-batches for
    end2end modules."""
    micro_batches = samples(case, step, unit)
    if case.compute_config.use_end2end:
        return [first_arg(kwargs) for kwargs in micro_batches]
    return micro_batches[0]


def grad_pieces(module: ParallelModule, optimizer: torch.optim.Optimizer, step: int) -> tuple:
    """``after_backward`` that brings back this rank's gradient slices, as ``parallel_steps`` records them."""
    return local_pieces(module, grads=True), {}


def parallelize_on(cluster: Any, case: Case, gen_dir: str) -> Any:
    """``cluster.parallelize`` the case's model with the case's policy and config (built on meta,
    and sent to the engines so, for a case with ``weights``)."""
    kwargs: Dict[str, Any] = {}
    if case.on_meta:
        with torch.device("meta"):
            model = build(case.model)
        kwargs = {"weights": None if case.weights == INIT else case.weights, "init_seed": INIT_SEED}
    else:
        model = build(case.model)
    return cluster.parallelize(model, batch(case.model, 12345), case.policy, case.compute_config,
                               gen_savedir=gen_dir, reuse="override",
                               instance_name=f"{case.policy}_{case.plan_ngpus}_{case.runtime_ngpus}", **kwargs)


def check_on_cluster(cluster: Any, case: Case, gen_dir: str) -> None:
    """Compile and train ``case`` on ``cluster`` and compare with one process: every rank's loss at
    every step (summed over micro-batches for end2end modules), and the merged gradients."""
    remote = parallelize_on(cluster, case, gen_dir)
    result = remote.train(functools.partial(case_batch, case), case.steps, torch.optim.SGD, lr=0.1,
                          after_backward=grad_pieces, progress=False)
    ref = train_single(case)
    for rank in range(case.runtime_ngpus):
        losses = result.steps[result.steps["rank"] == rank]["loss"].tolist()
        expected = [sum(ref["losses"][step][rank // case.plan_ngpus]) for step in range(case.steps)]
        assert_close(torch.tensor(losses), torch.tensor(expected), f"{case} rank {rank} losses on the cluster")
    for step in range(case.steps):
        merged = merge_slices(p for probes in result.probes for p in probes[step][0])
        for name, expected in ref["grads"][step].items():
            assert name in merged, f"{case}: no gradient for {name} at step {step} on the cluster"
            assert_close(merged[name], expected, f"{case} step {step} grad {name} on the cluster")


class RankSignal:
    """A one-shot event from a rank (another process on this host) to the test: a named pipe.

    The test calls ``then(action)``, which runs ``action`` in a thread as soon as some rank calls
    ``fire()``. Nothing waits for a guessed time: the thread blocks on the pipe until the rank
    writes to it.
    """

    def __init__(self, path: Optional[str] = None) -> None:
        """A new pipe in a folder of its own, or (``path`` given) the pipe of a signal made elsewhere."""
        self._dir = None
        if path is None:
            self._dir = tempfile.TemporaryDirectory(prefix="nbscaler-signal-")
            path = os.path.join(self._dir.name, "fifo")
            os.mkfifo(path)
        self.path = path

    def then(self, action: Callable[[], None]) -> threading.Thread:
        def wait_and_act() -> None:
            with open(self.path, "rb") as pipe:  # blocks until a rank opens the other end
                pipe.read(1)
            action()

        thread = threading.Thread(target=wait_and_act, daemon=True)
        thread.start()
        return thread

    def fire(self) -> None:
        """On a rank: wake the test's thread."""
        with open(self.path, "wb") as pipe:
            pipe.write(b"!")

    def __getstate__(self) -> dict:  # ranks get the path only
        return {"path": self.path, "_dir": None}

    def close(self) -> None:
        if self._dir is not None:
            self._dir.cleanup()
