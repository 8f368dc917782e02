"""``Recipe``: how a run trains, as one frozen object that checks itself.

A recipe is the optimizer and its settings, the dtypes a run computes, keeps and sums gradients in,
fp16's loss scaling and gradient clipping. ``parallelize``, ``build_optimizer``, ``Plan.summary``,
``Plan.memory``, ``Plan.timeline``, ``sweep``, ``PlanSpace``, autodist on a target
(``pas_config["recipe"]``) and the Explorer all take one as ``recipe=``, and ``Recipe()`` is the
default of every one of them: AdamW, with fp32 master copies of parameters held in a lower precision.

>>> Recipe().reduce_dtype(torch.bfloat16), Recipe().master_of(torch.float32)
(torch.float32, None)
>>> Recipe.of(master_dtype=None).master_of(torch.bfloat16) is None
True
>>> Recipe(optimizer_kwargs={"lr": 3e-4}).describe(torch.bfloat16)
'AdamW(lr=0.0003), module bf16, masters fp32, gradients reduced in fp32, no loss scaling, no clipping'
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

import torch

from nbscaler.columns import StrEnum

class Float8Scaling(StrEnum):
    """How ``Recipe(float8=...)`` scales the tensors of a linear layer's fp8 products (torchao's
    float8 training recipes): ``tensorwise``, one scale per tensor, from its largest magnitude;
    ``rowwise``, one scale per row of each operand, which keeps outliers in one row from
    flattening the others."""

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"


class Unset(Enum):
    """The type of ``UNSET``."""

    UNSET = "unset"


#: "Not given", for a shorthand keyword whose ``None`` means something (``master_dtype=None``: no copies).
UNSET = Unset.UNSET

SHORTHANDS = ("optimizer", "optimizer_kwargs", "module_dtype", "master_dtype", "grad_reduce_dtype")
"""The keywords that build a recipe where one is not given (``Recipe.of``)."""


def _fail(field: str, value: Any, fix: str) -> None:
    raise ValueError(f"Recipe({field}={value!r}) is invalid: {fix}")


def _short(dtype: Optional[torch.dtype]) -> str:
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
    return names.get(dtype, str(dtype).replace("torch.", ""))


@dataclass(frozen=True)
class LossScaling:
    """fp16's dynamic loss scaler, as settings (``nbscaler.runtime.scaler.LossScaler`` runs them):
    the loss is multiplied by ``init_scale`` at first; an overflow skips the step and multiplies the
    scale by ``backoff_factor``; ``growth_interval`` steps in a row without one multiply it by
    ``growth_factor``."""

    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def __post_init__(self) -> None:
        if not (self.init_scale > 0 and self.growth_factor > 1 and 0 < self.backoff_factor < 1
                and isinstance(self.growth_interval, int) and self.growth_interval >= 1):
            raise ValueError(f"{self} is invalid: it needs init_scale > 0, growth_factor > 1, "
                             "0 < backoff_factor < 1 and a whole growth_interval >= 1.")


@dataclass(frozen=True)
class Recipe:
    """How a run trains; see the module docstring.

    - ``optimizer``: a torch optimizer class (or a callable ``(params, **kwargs)`` that builds one);
    - ``optimizer_kwargs``: its keywords, given as a dict and kept as sorted ``(name, value)`` pairs
      so that a recipe is hashable (``kwargs`` gives the dict back);
    - ``module_dtype``: the dtype the module is converted to and computes in; ``None``: its own;
    - ``master_dtype``: the dtype of the copies of the parameters the optimizer updates, and of its
      state, made only where the parameters are held in a narrower dtype (bf16 parameters, fp32
      masters); ``None``: no copies, the optimizer updates the parameters themselves;
    - ``grad_reduce_dtype``: the dtype gradients are summed in across ranks; ``None``: the master
      copies' where there are copies, else the parameters' own;
    - ``loss_scaling``: fp16's dynamic loss scaler (``LossScaling``; ``True``: its defaults;
      ``None``/``False``: none), which needs ``module_dtype=torch.float16``;
    - ``clip_grad_norm``: the most the global gradient norm may be before a step; ``None``: no clipping;
    - ``float8``: the linear layers' products are taken in fp8 with this scaling (``Float8Scaling``:
      ``"tensorwise"`` or ``"rowwise"``), the output in the module's dtype; ``None``: in the module's
      dtype. Weights, gradients, masters and optimizer state keep their dtypes: only the operands of
      each product are cast, with their scales, for the product;
    - ``float8_skip``: modules whose linear layers keep the module's dtype under ``float8``, each a
      qualified name or its last parts (``"lm_head"``, ``"output"``: a model's output layer, which
      torchtitan leaves in bf16);
    - ``expert_imbalance``: what a prediction assumes of a dropless routing under expert
      parallelism: the (token, expert) pairs the busiest device of the expert group gets over the
      mean (1.0, the default: every device alike, as Megatron-Bridge forces it in its benchmarks;
      ``RoutingLog.imbalance`` measures a real one). Each device is priced as that one: its
      experts' products, the rows it gets and keeps for the backward, and each exchange, which
      lasts until it has them. Only predictions read it; the runtime routes as the router says.

    Each field is checked when the recipe is made; a ``ValueError`` names the field and the fix.
    """

    optimizer: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW
    optimizer_kwargs: Tuple[Tuple[str, Any], ...] = ()
    module_dtype: Optional[torch.dtype] = None
    master_dtype: Optional[torch.dtype] = torch.float32
    grad_reduce_dtype: Optional[torch.dtype] = None
    loss_scaling: Optional[LossScaling] = None
    clip_grad_norm: Optional[float] = None
    float8: Optional[Float8Scaling] = None
    float8_skip: Tuple[str, ...] = ()
    expert_imbalance: float = 1.0

    def __post_init__(self) -> None:
        if not callable(self.optimizer):
            _fail("optimizer", self.optimizer, "give a torch optimizer class such as torch.optim.AdamW.")
        object.__setattr__(self, "optimizer_kwargs", _kwargs_items(self.optimizer_kwargs))
        for name in ("module_dtype", "master_dtype", "grad_reduce_dtype"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                _fail(name, value, "give a floating-point torch.dtype such as torch.float32 or torch.bfloat16, or None.")
        object.__setattr__(self, "loss_scaling", _loss_scaling(self.loss_scaling))
        if self.loss_scaling is not None and self.module_dtype not in (None, torch.float16):
            _fail("loss_scaling", self.loss_scaling, f"loss scaling is for fp16 training, and module_dtype is "
                  f"{self.module_dtype}; use module_dtype=torch.float16, or loss_scaling=None.")
        norm = self.clip_grad_norm
        if norm is not None and (isinstance(norm, bool) or not isinstance(norm, (int, float)) or not norm > 0):
            _fail("clip_grad_norm", norm, "give a positive maximum norm such as 1.0, or None for no clipping.")
        if self.float8 is not None:
            if self.float8 not in set(Float8Scaling):
                _fail("float8", self.float8, f"give one of {', '.join(k.value for k in Float8Scaling)}, or None "
                      "for products in the module's dtype.")
            object.__setattr__(self, "float8", Float8Scaling(self.float8))
        skip = (self.float8_skip,) if isinstance(self.float8_skip, str) else tuple(self.float8_skip or ())
        if not all(isinstance(name, str) and name for name in skip):
            _fail("float8_skip", self.float8_skip, "give module names such as ('lm_head',).")
        if skip and self.float8 is None:
            _fail("float8_skip", self.float8_skip, "it names modules to leave out of fp8 products, and float8 is "
                  "None; set float8='tensorwise' (or 'rowwise'), or leave float8_skip empty.")
        object.__setattr__(self, "float8_skip", skip)
        imbalance = self.expert_imbalance
        if isinstance(imbalance, bool) or not isinstance(imbalance, (int, float)) or not 1 <= imbalance < float("inf"):
            _fail("expert_imbalance", imbalance, "give the busiest expert-parallel device's (token, expert) pairs over "
                  "the mean, a number >= 1 (1.0: a balanced routing).")
        object.__setattr__(self, "expert_imbalance", float(imbalance))

    @classmethod
    def of(cls, recipe: Optional["Recipe"] = None, **shorthands: Any) -> "Recipe":
        """``recipe`` (default ``Recipe()``) with the shorthand keywords (``SHORTHANDS``) that were
        given: those left ``UNSET`` (or an empty ``optimizer_kwargs``) say nothing. With a
        ``recipe``, a shorthand that disagrees with it is a ``ValueError`` naming both (a
        ``module_dtype`` fills the recipe's ``None``, which leaves the dtype open)."""
        unknown = sorted(set(shorthands) - set(SHORTHANDS))
        if unknown:
            raise TypeError(f"Recipe.of: no shorthand {', '.join(unknown)}; they are {', '.join(SHORTHANDS)}.")
        given = {k: v for k, v in shorthands.items() if v is not UNSET and not (k == "optimizer_kwargs" and not v)}
        if recipe is None:
            return cls(**given)
        if not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be a nbscaler.Recipe, got {type(recipe).__name__}.")
        for name, value in given.items():
            mine = getattr(recipe, name)
            if name == "module_dtype" and mine is None:     # the recipe's None: the module's own, whichever
                recipe = dataclasses.replace(recipe, module_dtype=value)
            elif (_kwargs_items(value) if name == "optimizer_kwargs" else value) != mine:
                raise ValueError(f"recipe.{name}={mine!r} and {name}={value!r} disagree: give one of them "
                                 f"(e.g. recipe=dataclasses.replace(recipe, {name}=...)).")
        return recipe

    @property
    def kwargs(self) -> Dict[str, Any]:
        """``optimizer_kwargs`` as a dict, what the optimizer is called with."""
        return dict(self.optimizer_kwargs)

    def replace(self, **changes: Any) -> "Recipe":
        """This recipe with ``changes`` (``dataclasses.replace``, checked again)."""
        return dataclasses.replace(self, **changes)

    def master_of(self, param_dtype: torch.dtype) -> Optional[torch.dtype]:
        """The master copy's dtype for ``param_dtype`` parameters; ``None``: no copy is made (no
        master dtype, or one no wider than the parameters')."""
        master = self.master_dtype
        return master if master is not None and master.itemsize > param_dtype.itemsize else None

    def reduce_dtype(self, param_dtype: torch.dtype) -> torch.dtype:
        """The dtype gradients of ``param_dtype`` parameters are summed in."""
        return self.grad_reduce_dtype or self.master_of(param_dtype) or param_dtype

    def describe(self, param_dtype: Optional[torch.dtype] = None) -> str:
        """One line for people: ``'AdamW(lr=0.001), module bf16, masters fp32, gradients reduced in
        fp32, no loss scaling, no clipping'``, for parameters of ``param_dtype`` where it is known."""
        name = getattr(self.optimizer, "__name__", repr(self.optimizer))
        kwargs = ", ".join(f"{k}={v!r}" for k, v in self.optimizer_kwargs)
        dtype = self.module_dtype or param_dtype
        if dtype is None:
            masters = f"masters {_short(self.master_dtype)} where wider" if self.master_dtype else "no masters"
            reduced = _short(self.grad_reduce_dtype) if self.grad_reduce_dtype else "the masters' or parameters' dtype"
        else:
            masters = f"masters {_short(self.master_of(dtype))}" if self.master_of(dtype) else "no masters"
            reduced = _short(self.reduce_dtype(dtype))
        scaling = (f"loss scaling from {self.loss_scaling.init_scale:g}" if self.loss_scaling else "no loss scaling")
        clipping = f"clipping at {self.clip_grad_norm:g}" if self.clip_grad_norm is not None else "no clipping"
        module = f"module {_short(dtype)}" if dtype is not None else "module in its own dtype"
        but = f", but {', '.join(self.float8_skip)}" if self.float8_skip else ""
        products = f", fp8 products ({self.float8.value}{but})" if self.float8 else ""
        return f"{name}({kwargs}), {module}{products}, {masters}, gradients reduced in {reduced}, {scaling}, {clipping}"


def _kwargs_items(value: Union[Mapping[str, Any], Tuple, None]) -> Tuple[Tuple[str, Any], ...]:
    """Optimizer keywords as sorted ``(name, value)`` pairs, lists made tuples so that they hash."""
    try:
        items = dict(value or {})
    except (TypeError, ValueError):
        _fail("optimizer_kwargs", value, "give a dict of the optimizer's keywords, e.g. {'lr': 3e-4}.")
    if not all(isinstance(k, str) for k in items):
        _fail("optimizer_kwargs", value, "its keys must be the optimizer's keyword names.")
    pairs = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in items.items()))
    try:
        hash(pairs)
    except TypeError:
        _fail("optimizer_kwargs", value, "give hashable values (numbers, strings, tuples).")
    return pairs


def _loss_scaling(value: Any) -> Optional[LossScaling]:
    if value is None or value is False:
        return None
    if value is True:
        return LossScaling()
    if isinstance(value, Mapping):
        return LossScaling(**value)
    if not isinstance(value, LossScaling):
        _fail("loss_scaling", value, "give a LossScaling (or True for its defaults, a dict of its "
              "settings, or None).")
    return value


AS_HELD = Recipe(master_dtype=None)
"""No master copies, gradients summed in the parameters' dtype: what a reducer does before
``build_optimizer`` gives it a recipe, and what the cost model's parts assume when given none."""
