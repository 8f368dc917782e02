"""``build_optimizer``: a torch optimizer patched for parallel modules.

The patches, in the order a training step meets them:

1. construction: the optimizer gets ``parameters_for_optimizer()`` of each parallel module (its
   local shard), plus the ordinary parameters of any non-parallel part of the model;
2. ``step()``: a pre-step hook calls ``sync_shard_grad()`` (sum gradients across data-parallel
   units) unless it already ran, and a post-step hook calls ``gather_params()`` (ZeRO);
3. ``zero_grad()``: also resets each parallel module's gradient state.

It also gains ``scale_grads``, ``clip_gnorm`` and reducer hooks. Gradients are sums over units and
micro-batches; ``optimizer.scale_grads(1 / n)`` turns a sum into a mean.

>>> opt = build_optimizer(pm, torch.optim.AdamW, lr=1e-3)         # doctest: +SKIP
>>> loss = pm(x).sum(); loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, TypeVar

import torch
import torch.distributed as dist

from nbscaler.config import ComputeConfig
from nbscaler.runtime.groups import dp_ranks, ensure_groups, get_group, unit_ranks
from nbscaler.runtime.module import ParallelModule
from nbscaler.runtime.reducer import GradHook, Reducer

OptimizerT = TypeVar("OptimizerT", bound=torch.optim.Optimizer)


def _world() -> tuple:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def build_optimizer(module: torch.nn.Module, optimizer_fn: Callable[..., OptimizerT],
                    compute_config: Optional[ComputeConfig] = None, **kwargs: Any) -> OptimizerT:
    """Create ``optimizer_fn(params, **kwargs)`` for ``module`` and patch it for parallel training.

    ``module`` is a ``ParallelModule`` or any module containing some. Parameters outside parallel
    modules are replicated inside a unit and their gradients summed across units by
    ``optimizer._non_parallel_module_reducer``; ``compute_config`` tells the unit size when the
    module holds no parallel module to read it from.
    """
    parallel = [m for m in module.modules() if isinstance(m, ParallelModule)]
    configs = {(m.compute_config.plan_ngpus, m.compute_config.runtime_ngpus) for m in parallel}
    if len(configs) > 1:
        raise ValueError(f"the parallel modules disagree on (plan_ngpus, runtime_ngpus): {sorted(configs)}; "
                         "all parallel modules of one model need the same values.")
    owned = {id(p) for m in parallel for p in m.parameters()}
    plain = [p for p in module.parameters() if id(p) not in owned and p.requires_grad]
    rank, world = _world()
    if configs:
        plan, runtime = configs.pop()
    elif compute_config is not None:
        plan, runtime = compute_config.plan_ngpus, compute_config.runtime_ngpus
    else:
        plan, runtime = 1, world
    params = [p for m in parallel for p in m.parameters_for_optimizer()] + plain
    optimizer = optimizer_fn(params, **kwargs)

    ensure_groups(plan, runtime)
    plain_group = get_group(dp_ranks(rank % plan, plan, runtime))
    non_parallel = Reducer(plain, plain_group)
    reducers: List[Reducer] = [m.reducer for m in parallel] + [non_parallel]
    unit_group = get_group(unit_ranks(rank // plan, range(plan), plan))
    state = {"synced": False}

    def sync_shard_grad() -> None:
        """Sum gradients across data-parallel units, once per step."""
        if state["synced"]:
            return
        for m in parallel:
            m.sync_grads()
        non_parallel.sync()
        state["synced"] = True

    def scale_grads(factor: float) -> None:
        """Multiply every gradient by ``factor`` (call after ``sync_shard_grad``)."""
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(factor)

    def clip_gnorm(max_norm: Optional[float] = None) -> torch.Tensor:
        """The global gradient norm of the whole (unpartitioned) model, clipping to ``max_norm``.

        Equal to ``torch.nn.utils.clip_grad_norm_`` on the single-process model: a sharded gradient
        counts each shard once, a replicated one once per unit.
        """
        sync_shard_grad()
        sq = torch.zeros((), dtype=torch.float64)
        for m in parallel:
            for attr, spec in m.weight_specs.items():
                p = getattr(m, attr)
                if isinstance(p, torch.nn.Parameter) and p.grad is not None:
                    copies = 1 if spec.split_dim is not None else len(spec.devices)
                    sq += p.grad.detach().double().pow(2).sum().cpu() / copies
        for p in plain:
            if p.grad is not None:
                sq += p.grad.detach().double().pow(2).sum().cpu() / plan
        if unit_group is not None:
            dist.all_reduce(sq, group=unit_group)
        total = sq.sqrt().float()
        if max_norm is not None:
            coef = max_norm / (float(total) + 1e-6)
            if coef < 1:
                scale_grads(coef)
        return total

    def register_reducer_pre_hook(fn: GradHook) -> None:
        for r in reducers:
            r.pre_hooks.append(fn)

    def register_reducer_post_hook(fn: GradHook) -> None:
        for r in reducers:
            r.post_hooks.append(fn)

    def pre_step(opt, args, kwargs):
        sync_shard_grad()

    def post_step(opt, args, kwargs):
        for m in parallel:
            m.gather_params()
        state["synced"] = False

    original_zero_grad = optimizer.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        original_zero_grad(set_to_none)
        for m in parallel:
            m.zero_grad(set_to_none)
        state["synced"] = False

    optimizer.register_step_pre_hook(pre_step)
    optimizer.register_step_post_hook(post_step)
    optimizer.zero_grad = zero_grad
    optimizer.sync_shard_grad = sync_shard_grad
    optimizer.scale_grads = scale_grads
    optimizer.clip_gnorm = clip_gnorm
    optimizer.register_reducer_pre_hook = register_reducer_pre_hook
    optimizer.register_reducer_post_hook = register_reducer_post_hook
    optimizer._non_parallel_module_reducer = non_parallel
    optimizer._parallel_modules = parallel
    return optimizer
