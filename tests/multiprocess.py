"""The one place where tests start several ranks, and the equivalence harness built on it.

Every multi-process test goes through ``run_ranks``, which always has a timeout: a hung collective
fails the test with the ranks that never finished instead of stalling the suite.

The equivalence harness trains a model from ``tests.models`` on every rank through ``parallelize``
and the same model in this process, and compares losses and gradients step by step. Unit ``u`` of
the parallel run gets the batch seeded ``step * 100 + u``; the single-process reference sums the
losses of all units' batches, which is what summed data-parallel gradients equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Sequence

import torch
import torch.distributed as dist

from nbscaler import ComputeConfig, build_optimizer, parallelize
from nbscaler.runtime.checkpoint import local_pieces, merge_slices
from nbscaler.runtime.launch import spawn
from tests.models import batch, build

DEFAULT_TIMEOUT = 240.0
RTOL = 1e-5
EVAL_SEED = 999


def run_ranks(fn: Callable[..., Any], nranks: int, *args: Any, timeout: float = DEFAULT_TIMEOUT) -> List[Any]:
    """Run ``fn(*args)`` on ``nranks`` gloo ranks and return their results in rank order."""
    return spawn(fn, nranks, *args, timeout=timeout)


@dataclass(frozen=True)
class Case:
    """One training run to compare. ``config`` holds extra ComputeConfig keywords as pairs, e.g.
    ``(("use_end2end", True), ("use_pipeline", True), ("pipeline_nmicros", 4))``."""

    model: str
    policy: Any
    plan_ngpus: int
    runtime_ngpus: int
    steps: int = 3
    config: tuple = ()

    @property
    def units(self) -> int:
        return self.runtime_ngpus // self.plan_ngpus

    @property
    def compute_config(self) -> ComputeConfig:
        return ComputeConfig(plan_ngpus=self.plan_ngpus, runtime_ngpus=self.runtime_ngpus, **dict(self.config))

    @property
    def micros(self) -> int:
        cfg = self.compute_config
        return cfg.pipeline_nmicros if cfg.use_pipeline else (2 if cfg.use_end2end else 1)


def pipeline(scheduler: str, nstages: int, nmicros: int) -> tuple:
    """The ``Case.config`` of an end2end pipeline."""
    return (("use_end2end", True), ("use_pipeline", True), ("pipeline_scheduler", scheduler),
            ("pipeline_nstages", nstages), ("pipeline_nmicros", nmicros))


def data_seed(step: int, unit: int, micro: int = 0) -> int:
    return step * 100 + unit * 10 + micro


def samples(case: Case, step: int, unit: int) -> List[Dict[str, Any]]:
    """The forward arguments of each micro-batch unit ``unit`` trains on at ``step``."""
    return [batch(case.model, data_seed(step, unit, m)) for m in range(case.micros)]


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
    cfg = case.compute_config
    name = f"{case.model}_{getattr(case.policy, '__name__', case.policy)}_{case.plan_ngpus}_{case.runtime_ngpus}"
    name += "_" + cfg.scheduler if cfg.use_pipeline else ""
    model = build(case.model)
    if case.model == "with_trunk":
        model.trunk = parallelize(model.trunk, {"x": torch.randn(8, 16)}, case.policy, cfg,
                                  gen_savedir=gen_dir, instance_name=name, reuse="override")
        return model
    return parallelize(model, batch(case.model, 12345), case.policy, cfg,
                       gen_savedir=gen_dir, instance_name=name, reuse="override")


def plain_grads(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    """Gradients of the parameters outside parallel modules, by their names in ``model``."""
    from nbscaler import ParallelModule
    inside = {id(p) for m in model.modules() if isinstance(m, ParallelModule) for p in m.parameters()}
    return {n: p.grad.clone() for n, p in model.named_parameters() if id(p) not in inside and p.grad is not None}


def train_parallel(cases: Sequence[Case], gen_dir: str) -> List[Dict[str, Any]]:
    """On every rank: compile and train each case; returns losses and gradient slices per step."""
    rank = dist.get_rank()
    results = []
    for case in cases:
        unit = rank // case.plan_ngpus
        pm = parallel_model(case, gen_dir)
        opt = build_optimizer(pm, torch.optim.SGD, lr=0.1)
        losses, grads = [], []
        for step in range(case.steps):
            out = step_losses(pm, case, samples(case, step, unit))
            if not case.compute_config.use_end2end:
                sum(out).backward()
            opt.sync_shard_grad()
            losses.append([float(l) for l in out])
            grads.append((local_pieces(pm, grads=True), plain_grads(pm)))
            opt.step()
            opt.zero_grad()
        pm.eval()
        with torch.no_grad():
            eval_args = [batch(case.model, EVAL_SEED + m) for m in range(case.micros)]
            eval_out = (pm.infer_step([first_arg(a) for a in eval_args]) if case.compute_config.use_end2end
                        else [pm(**eval_args[0])])
            eval_loss = [float(o[0] if isinstance(o, (tuple, list)) else o) for o in eval_out]
        results.append({"losses": losses, "grads": grads, "eval_loss": eval_loss})
    return results


def train_single(case: Case) -> Dict[str, Any]:
    """The reference: one process, the losses of all units summed before backward."""
    model = build(case.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(case.steps):
        per_unit = [[model(**a) for a in samples(case, step, u)] for u in range(case.units)]
        sum(l for unit in per_unit for l in unit).backward()
        losses.append([[l.item() for l in unit] for unit in per_unit])
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
    model.eval()
    with torch.no_grad():
        eval_loss = [model(**batch(case.model, EVAL_SEED + m)).item()
                     for m in range(case.micros if case.compute_config.use_end2end else 1)]
    return {"losses": losses, "grads": grads, "eval_loss": eval_loss}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, rtol: float = RTOL) -> None:
    """Norm-wise relative error ``|a - e| <= rtol * |e|`` (plus a hair for all-zero tensors)."""
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual.double() - expected.double()).norm().item()
    scale = expected.double().norm().item()
    assert err <= rtol * scale + 1e-9, f"{what}: relative error {err / max(scale, 1e-30):.2e} > {rtol}"


def check_equivalence(case: Case, per_rank: List[Dict[str, Any]]) -> None:
    """Losses of every rank and merged gradients equal the single-process run at every step, and so
    does the eval-mode loss afterwards (with one unit: BatchNorm statistics are per unit, as in DDP)."""
    ref = train_single(case)
    for step in range(case.steps):
        for rank, res in enumerate(per_rank):
            unit = rank // case.plan_ngpus
            expected = torch.tensor(ref["losses"][step][unit])
            assert_close(torch.tensor(res["losses"][step]), expected, f"{case} step {step} rank {rank} loss")
        merged = merge_slices(p for res in per_rank for p in res["grads"][step][0])
        prefix = "trunk." if case.model == "with_trunk" else ""
        merged = {prefix + name: t for name, t in merged.items()}
        for res in per_rank:
            merged.update(res["grads"][step][1])
        for name, expected in ref["grads"][step].items():
            assert name in merged, f"{case}: no gradient for {name} at step {step}"
            assert_close(merged[name], expected, f"{case} step {step} grad {name}")
    if case.units == 1:
        for rank, res in enumerate(per_rank):
            assert_close(torch.tensor(res["eval_loss"]), torch.tensor(ref["eval_loss"]), f"{case} rank {rank} eval loss")
