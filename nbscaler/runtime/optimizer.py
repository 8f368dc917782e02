"""``build_optimizer``: a torch optimizer patched for parallel modules.

The patches, in the order a training step meets them:

1. construction: the optimizer gets ``parameters_for_optimizer()`` of each parallel module (its
   local parameters, or with ZeRO its flat shards of them), plus the ordinary parameters of any
   non-parallel part of the model;
2. ``step()``: a pre-step hook calls ``sync_shard_grad()`` (sum gradients across data-parallel
   units) unless it already ran, and a post-step hook calls ``gather_params()`` (ZeRO). With
   ``step(closure)`` the hook runs before the closure's backward, so it wraps the closure instead
   and syncs right after each call of it;
3. ``zero_grad()``: also resets each parallel module's gradient state;
4. ``state_dict()`` adds a record of what each optimizer parameter holds (which slices of which
   original parameters), and ``load_state_dict()`` refuses a state saved under another layout.

The training recipe (``nbscaler.Recipe``) says which optimizer and dtypes. With master copies
(``Recipe.master_dtype``) the optimizer's parameters are master copies of the module's (fp32 copies of
bf16 parameters, say): the summed gradients land on them, the step updates them and the post-step
hook copies them back, and ``state_dict()`` saves each as its parameter's state ``master``. With a
``scaler`` (``nbscaler.runtime.scaler.LossScaler``) ``step()`` skips the update when a gradient
overflowed. ``OptimizerPatch`` holds all of this; the optimizer carries its bound methods.

It also gains ``scale_grads``, ``clip_gnorm`` and reducer hooks. Gradients are sums over units and
micro-batches; ``optimizer.scale_grads(1 / n)`` turns a sum into a mean.

>>> opt = build_optimizer(pm, torch.optim.AdamW, lr=1e-3)         # doctest: +SKIP
>>> loss = pm(x).sum(); loss.backward(); opt.step(); opt.zero_grad()
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from nbscaler.config import ComputeConfig
from nbscaler.recipe import UNSET, Recipe
from nbscaler.runtime.groups import ensure_groups, get_group
from nbscaler.runtime.module import ParallelModule, runtime_device
from nbscaler.runtime.reducer import GradHook, Reducer
from nbscaler.runtime.scaler import LossScaler
from nbscaler.runtime.statecheck import OPTIMIZER_FORMAT, OPTIMIZER_KEY, check_optimizer_state
from nbscaler.schedule.grid import RankGrid

MASTER_KEY = "master"               # a master copy, saved as its optimizer parameter's state
SCALER_KEY = "nbscaler_loss_scale"


def _world() -> tuple:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def parallel_modules(module: torch.nn.Module) -> Dict[str, ParallelModule]:
    """Every parallel module inside ``module`` by its state-dict prefix ('' for ``module`` itself)."""
    return {(name + "." if name else ""): m for name, m in module.named_modules() if isinstance(m, ParallelModule)}


def build_optimizer(module: torch.nn.Module, optimizer_fn: Any = UNSET,
                    compute_config: Optional[ComputeConfig] = None, *, recipe: Optional[Recipe] = None,
                    master_dtype: Any = UNSET, grad_reduce_dtype: Any = UNSET,
                    scaler: Optional[LossScaler] = None, **kwargs: Any) -> torch.optim.Optimizer:
    """Create the recipe's optimizer (``optimizer_fn(params, **kwargs)``) for ``module`` and patch
    it for parallel training.

    ``module`` is a ``ParallelModule`` or any module containing some. Parameters outside parallel
    modules are replicated inside a unit and their gradients summed across units by
    ``optimizer._non_parallel_module_reducer``; ``compute_config`` tells the unit size when the
    module holds no parallel module to read it from.

    ``recipe`` (``nbscaler.Recipe``; default ``Recipe()``: AdamW with fp32 masters) says how to
    train; ``optimizer_fn``, ``master_dtype``, ``grad_reduce_dtype`` and ``kwargs`` are shorthands
    for its fields (``Recipe.of``). With master copies (``master_dtype`` wider than the
    parameters', e.g. ``torch.float32`` for a module compiled with ``module_dtype=torch.bfloat16``)
    the optimizer updates copies of this rank's parameters (with ZeRO, of its shards) and keeps its
    state in that dtype; the updated values are copied back into the parameters after each step
    (``master_dtype=None``: no copies). Gradients are summed across ranks in the recipe's
    ``reduce_dtype``. The recipe's ``loss_scaling`` (or ``scaler``, a ``LossScaler`` of one's own)
    unscales the gradients when they are summed and skips the steps in which one overflowed (fp16).
    The recipe's ``clip_grad_norm`` is the default of ``optimizer.clip_gnorm()``.
    """
    precision = Recipe.of(recipe, optimizer=optimizer_fn, optimizer_kwargs=kwargs, master_dtype=master_dtype,
                          grad_reduce_dtype=grad_reduce_dtype)
    if scaler is not None and precision.loss_scaling is not None:
        raise ValueError("build_optimizer got both scaler= and a recipe with loss_scaling: give one of them.")
    if scaler is None and precision.loss_scaling is not None:
        scaler = LossScaler(**dataclasses.asdict(precision.loss_scaling))
    parallel = parallel_modules(module)
    configs = {(m.compute_config.plan_ngpus, m.compute_config.runtime_ngpus) for m in parallel.values()}
    if len(configs) > 1:
        raise ValueError(f"the parallel modules disagree on (plan_ngpus, runtime_ngpus): {sorted(configs)}; "
                         "all parallel modules of one model need the same values.")
    owned = {id(p) for m in parallel.values() for p in m.parameters()}
    plain = {name: p for name, p in module.named_parameters() if id(p) not in owned and p.requires_grad}
    rank, world = _world()
    if configs:
        plan, runtime = configs.pop()
    elif compute_config is not None:
        plan, runtime = compute_config.plan_ngpus, compute_config.runtime_ngpus
    else:
        plan, runtime = 1, world
    grid = RankGrid(plan, runtime)
    ensure_groups(grid)
    non_parallel = Reducer(list(plain.values()), get_group(grid.dp_ranks(grid.device_of(rank))))
    for reducer in [*parallel.values(), non_parallel]:
        reducer.set_precision(precision)
    params = [p for m in parallel.values() for p in m.parameters_for_optimizer()]
    params += [p for p, _ in non_parallel.optimizer_slots()]
    optimizer = precision.optimizer(params, **precision.kwargs)
    patch = OptimizerPatch(optimizer, list(parallel.values()), non_parallel, plan,
                           state_layout(module, parallel, plain), scaler, precision)
    patch.attach()
    return optimizer


class OptimizerPatch:
    """What ``build_optimizer`` adds to a torch optimizer, as one object: the optimizer carries its
    bound methods (``optimizer.sync_shard_grad`` is ``patch.sync_shard_grad``) and stays an
    instance of the user's optimizer class.

    It holds the reducers that sum gradients across data-parallel units (one per parallel module,
    and ``non_parallel`` for the parameters outside them; they also keep the master copies the
    optimizer updates, ``masters``), whether this step's gradients have been summed yet
    (``synced``), and the loss ``scaler`` with whether this step's gradients overflowed.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, modules: List[ParallelModule], non_parallel: Reducer,
                 plan_ngpus: int, layout: Dict[str, Any], scaler: Optional[LossScaler] = None,
                 recipe: Optional[Recipe] = None):
        self.optimizer = optimizer
        self.modules = modules
        self.non_parallel = non_parallel
        self.reducers: List[Reducer] = [m.reducer for m in modules] + [non_parallel]
        self.plan_ngpus = plan_ngpus
        self.layout = layout
        self.synced = False
        self.scaler = scaler
        self.recipe = recipe or Recipe()
        self.overflowed = False
        self._zero_grad = optimizer.zero_grad           # the optimizer's own, before the patch
        self._step = optimizer.step
        self._loaded_masters: Dict[int, torch.Tensor] = {}

    @property
    def masters(self) -> List[torch.nn.Parameter]:
        """The master copies the optimizer updates in place of parameters (empty without them)."""
        return [m for r in self.reducers for m in r.masters.values()]

    def _params(self) -> List[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def attach(self) -> None:
        """Give the optimizer the patch's hooks and methods."""
        opt = self.optimizer
        opt.register_step_pre_hook(self._pre_step)
        opt.register_step_post_hook(self._post_step)
        opt.register_state_dict_post_hook(self._add_layout)
        opt.register_load_state_dict_pre_hook(self._check_layout)
        opt.register_load_state_dict_post_hook(self._load_masters)
        if self.scaler is not None:
            opt.step = self.scaled_step
            opt.scaler = self.scaler
        opt.zero_grad = self.zero_grad
        opt.sync_shard_grad = self.sync_shard_grad
        opt.scale_grads = self.scale_grads
        opt.clip_gnorm = self.clip_gnorm
        opt.register_reducer_pre_hook = self.register_reducer_pre_hook
        opt.register_reducer_post_hook = self.register_reducer_post_hook
        opt._non_parallel_module_reducer = self.non_parallel
        opt._parallel_modules = self.modules
        opt._state_layout = self.layout
        opt._nbscaler_patch = self

    # -- gradients ------------------------------------------------------------------------------
    def sync_shard_grad(self) -> None:
        """Sum gradients across data-parallel units, once per step."""
        if self.synced:
            return
        for m in self.modules:
            m.sync_grads()
        self.non_parallel.sync()
        self.synced = True
        if self.scaler is not None:
            grads = [p.grad for p in self._params() if p.grad is not None]
            self.overflowed = self.scaler.unscale(grads, runtime_device())

    def scale_grads(self, factor: float) -> None:
        """Multiply every gradient by ``factor`` (call after ``sync_shard_grad``)."""
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(factor)

    def clip_gnorm(self, max_norm: Any = UNSET) -> torch.Tensor:
        """The global gradient norm of the whole (unpartitioned) model, clipping to ``max_norm``
        (default: the recipe's ``clip_grad_norm``; ``None``: no clipping).

        Equal to ``torch.nn.utils.clip_grad_norm_`` on the single-process model: every rank adds
        its share (a slice counts once, a copy held by several devices or ranks a fraction), and
        the shares are summed over all ranks.
        """
        self.sync_shard_grad()
        plan = self.plan_ngpus
        sq = sum((m.grad_sq_sum() for m in self.modules), self.non_parallel.grad_sq_sum(lambda p: 1.0 / plan))
        if dist.is_initialized():
            sq = sq.to(runtime_device())
            dist.all_reduce(sq)
        total = sq.sqrt().float().cpu()
        max_norm = self.recipe.clip_grad_norm if max_norm is UNSET else max_norm
        if max_norm is not None:
            coef = max_norm / (float(total) + 1e-6)
            if coef < 1:
                self.scale_grads(coef)
        return total

    def register_reducer_pre_hook(self, fn: GradHook) -> None:
        """Run ``fn(reducer, flat)`` on each flat bucket of gradients before it is summed."""
        for r in self.reducers:
            r.pre_hooks.append(fn)

    def register_reducer_post_hook(self, fn: GradHook) -> None:
        """Run ``fn(reducer, flat)`` on each flat bucket of gradients after it is summed."""
        for r in self.reducers:
            r.post_hooks.append(fn)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's ``zero_grad``, and each parallel module's gradient state reset."""
        self._zero_grad(set_to_none)
        for m in self.modules:
            m.zero_grad(set_to_none)
        self.synced = False

    # -- stepping -------------------------------------------------------------------------------
    def scaled_step(self, closure: None = None) -> None:
        """``step()`` under a loss scaler: skipped on every rank when some gradient overflowed,
        and the scale updated either way."""
        if closure is not None:
            raise ValueError("step(closure) is not supported with a loss scaler: run the forward and backward "
                             "with scale_fn=optimizer.scaler.scale, then call step().")
        self.sync_shard_grad()
        if self.overflowed:
            self.synced = False
        else:
            self._step()
        self.scaler.update(self.overflowed)

    def _pre_step(self, opt, args, kwargs):            # args[0] is the optimizer itself
        """Sum the gradients before the update; with ``step(closure)``, after each call of it."""
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self.sync_shard_grad()
            return None

        def synced_closure():
            loss = closure()
            self.synced = False             # its backward made new local gradients
            self.sync_shard_grad()
            return loss

        if "closure" in kwargs:
            return args, {**kwargs, "closure": synced_closure}
        return (args[0], synced_closure, *args[2:]), kwargs

    def _post_step(self, opt, args, kwargs) -> None:
        """Bring every rank's parameters up to date (ZeRO, master copies) and expect new gradients."""
        for m in self.modules:
            m.gather_params()
        self.non_parallel.gather_params()
        self.synced = False

    # -- checkpoints ----------------------------------------------------------------------------
    def _add_layout(self, opt, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """The layout record, each master copy as its parameter's state ``master`` (merged and
        moved between plans like any per-element state), and the loss scale."""
        state_dict[OPTIMIZER_KEY] = copy.deepcopy(self.layout)
        masters = {id(m) for m in self.masters}
        for index, p in enumerate(self._params()):
            if id(p) in masters:        # a new dict: the optimizer's own per-parameter state stays as it is
                state_dict["state"][index] = {**state_dict["state"].get(index, {}), MASTER_KEY: p.detach().clone()}
        if self.scaler is not None:
            state_dict[SCALER_KEY] = self.scaler.state_dict()
        return state_dict

    def _check_layout(self, opt, state_dict: Dict[str, Any]) -> Dict[str, Any]:
        """Check the layout, and set the master weights aside until the state has loaded."""
        check_optimizer_state(self.layout, state_dict)
        state = {index: dict(values) for index, values in state_dict.get("state", {}).items()}
        self._loaded_masters = {index: values.pop(MASTER_KEY) for index, values in state.items()
                                if MASTER_KEY in values}
        if self.scaler is not None and SCALER_KEY in state_dict:
            self.scaler.load_state_dict(state_dict[SCALER_KEY])
        return {**{k: v for k, v in state_dict.items() if k not in (OPTIMIZER_KEY, SCALER_KEY)}, "state": state}

    @torch.no_grad()
    def _load_masters(self, opt) -> None:
        """Saved master weights go into the optimizer's parameters (master copies, or the parameters
        themselves in a plan without copies), and from there into the module's parameters."""
        if not self._loaded_masters:        # the same on all ranks of a ZeRO group: they hold the same slices
            return
        params = self._params()
        for index, value in self._loaded_masters.items():
            params[index].copy_(value)
        self._loaded_masters = {}
        for m in self.modules:
            m.gather_params()
        self.non_parallel.gather_params()


def layout_of(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
    """The layout record of an optimizer made by ``build_optimizer`` (see ``state_layout``)."""
    layout = getattr(optimizer, "_state_layout", None)
    if layout is None:
        raise TypeError(f"this {type(optimizer).__name__} was not made by build_optimizer, so nothing says which "
                        "slices its parameters hold; create it with nbscaler.build_optimizer.")
    return layout


def state_layout(module: torch.nn.Module, parallel: Dict[str, ParallelModule],
                 plain: Dict[str, torch.nn.Parameter]) -> Dict[str, Any]:
    """What each optimizer parameter holds, in plain values (saved with the optimizer's state).

    ``slots[i]`` describes optimizer parameter ``i``: a plain parameter by name, or the segments of
    a parallel module's local parameters, each naming the original parameter and slice it comes
    from. ``original_params`` lists the original model's parameters in ``model.parameters()``
    order, which is how a merged optimizer state is indexed.
    """
    slots: List[Dict[str, Any]] = []
    for prefix, m in parallel.items():
        attr_of = {id(getattr(m, attr)): attr for attr in m.weight_specs}
        for param, segments in m.optimizer_slots():
            described = []
            for s in segments:
                attr = attr_of[id(s.param)]
                spec = m.weight_specs[attr]
                described.append({"attr": attr, "param": spec.name, "slice": [spec.split_dim, spec.parts, spec.index],
                                  "start": s.start, "length": s.length, "offset": s.offset})
            slots.append({"module": prefix, "shape": list(param.shape), "segments": described})
    slots += [{"module": None, "param": name, "shape": list(p.shape)} for name, p in plain.items()]
    return {"format": OPTIMIZER_FORMAT, "slots": slots, "original_params": _original_order(module, parallel)}


def _original_order(module: torch.nn.Module, parallel: Dict[str, ParallelModule]) -> List[str]:
    """The original model's parameter names in order: a parallel module stands where the module it
    was made from stood, so its original parameters take the place of its local ones."""
    owner = {id(p): (prefix, m) for prefix, m in parallel.items() for p in m.parameters()}
    order: List[str] = []
    expanded = set()
    for name, p in module.named_parameters():
        if id(p) not in owner:
            order.append(name)
            continue
        prefix, m = owner[id(p)]
        if prefix not in expanded:
            expanded.add(prefix)
            order += [prefix + n for n in m.original_params]
    return order
