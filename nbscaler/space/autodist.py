"""autodist on a target: the configuration ``nbscaler.sweep`` prices fastest, planned whole, and why.

>>> cfg = ComputeConfig(8, 64, pas_config={"hardware": "H100-SXM-80GB", "global_batch": 128,   # doctest: +SKIP
...                                        "autodist_space": {"tp": (1, 2, 4, 8), "pp": (1, 2, 4, 8)}})
>>> p = nbscaler.plan(model, {"input_ids": ids}, "autodist", cfg, module_dtype=torch.bfloat16)  # doctest: +SKIP
>>> print(p.explain())                              # the choice against the runners-up

On this machine autodist profiles each op and searches its placement op by op (``policy.autodist``).
For a target the job may have thousands of GPUs that are not here, so the question is first which
configuration: tp, pp, micro-batch, recomputation, sequence parallelism, ZeRO (and context
parallelism, ``cp``, or expert parallelism, ``ep``, where ``autodist_space`` asks for them). ``nbscaler.sweep``
prices every one the ranges allow from one trace of a two-layer copy, on the target's roofline and
NCCL models; autodist takes its fastest row that fits the target's memory, plans the model whole
under that row's config (``space.sweep.config_of``: ``hybrid``'s tensor-parallel placement
inside each stage) and keeps the rows it beat for ``plan.explain()``: what each would cost and
what binds it. ``pas_config['sequence_parallel']``, where given, is the only value searched.

The plan's ``summary(hardware=target, recipe=...)`` predicts what the chosen row
says (the sweep's own contract, ``tests/space/test_sweep.py``); ``graph.meta['autodist']``
records the target, the ranges, the rows and the seconds the search took.

The op-by-op search is not run on a target: its costs are this machine's profiled op times, and
inside a stage of a transformer the tensor-parallel placement it competes with (``tp``, kept
whenever it is predicted faster, ``_keep_faster_builtin``) is the one ``hybrid`` uses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Union

import pandas as pd
import torch

from nbscaler.config import ComputeConfig
from nbscaler.cost.hardware import Hardware
from nbscaler.planning.planner import Plan, trace_and_place
from nbscaler.planning.stack import one_sequence
from nbscaler.recipe import UNSET, Recipe
from nbscaler.planning.target_explanation import describe, gigabytes
from nbscaler.policy.autodist.options import OPTIMIZERS, TARGET_KEYS
from nbscaler.config import RECOMPUTE
from nbscaler.policy.builtin import SEQUENCE_PARALLEL, BuiltinPolicy, sequence_parallel
from nbscaler.policy.primitives import PolicyError
from nbscaler.space.plan_space import PlanSpace
from nbscaler.space.sweep import config_of

#: How many configurations ``plan.explain()`` sets against the choice.
RUNNERS_UP = 4

#: The runners-up are the fastest fitting configurations of other layouts within this factor of
#: the choice's step; slower ones are not priced (``sweep``'s ``prune``).
WITHIN = 1.25

#: The ranges ``autodist_space`` may give: ``nbscaler.sweep``'s keywords of the same names.
SPACE_KEYS = ("tp", "pp", "micro_batch", "recompute", "sequence_parallel", "zero_stage", "zero_reshard_after_forward",
              "cp", "context_parallel_kind", "ep", "float8", "compiled")


@dataclass(frozen=True)
class TargetSearch:
    """What a search on a target reads from ``pas_config`` (``policy.autodist.options.TARGET_KEYS``),
    checked on the spot:

    ==================  ==========================================================================
    ``hardware``        a ``Hardware`` with ``runtime_ngpus`` GPUs, or a catalogue name
                        (``Hardware.catalogue()``) whose nodes ``runtime_ngpus`` fills
    ``global_batch``    the sequences one training step trains on
    ``autodist_space``  the ranges to search, as ``nbscaler.sweep``'s keywords ``tp``, ``pp``,
                        ``micro_batch``, ``recompute``, ``sequence_parallel``, ``zero_stage``,
                        ``zero_reshard_after_forward``, ``cp``, ``context_parallel_kind``,
                        ``ep``, ``float8``, ``compiled`` (the chosen row says which products and
                        software it was priced with; a
                        missing one: the sweep's default, none, selective and full for
                        ``recompute``; ``sequence_parallel`` or ``recompute`` missing and
                        ``pas_config['sequence_parallel']`` or ``['recompute']`` given: that
                        value alone)
    ``recipe``          the training recipe priced (``nbscaler.Recipe``; default ``Recipe()``:
                        AdamW, fp32 master copies)
    ``master_dtype``    shorthand for the recipe's master copies' dtype (``build_optimizer``'s)
    ==================  ==========================================================================

    autodist's ``memory_optimizer`` (``'adam'``, ``'adamw'``, ``'sgd'``) is a shorthand for the
    recipe's optimizer; a shorthand that disagrees with the recipe is refused. ``priced`` is the
    recipe the search prices.
    """

    hardware: Union[str, Hardware]
    global_batch: Optional[int] = None
    autodist_space: Dict[str, Any] = field(default_factory=dict)
    recipe: Optional[Recipe] = None
    master_dtype: Any = UNSET
    memory_optimizer: Any = UNSET
    priced: Recipe = field(init=False, repr=False)

    @classmethod
    def from_config(cls, cfg: ComputeConfig, recipe: Optional[Recipe] = None) -> "TargetSearch":
        """The search ``cfg.pas_config`` asks for (it must name ``hardware``); ``recipe``, that of
        ``nbscaler.plan(recipe=)``, where ``pas_config`` gives none (else the two must be equal)."""
        pas = cfg.pas_config or {}
        keys = (*TARGET_KEYS, "memory_optimizer")
        given = {k: v for k, v in pas.items() if k in keys}
        if recipe is not None and given.get("recipe", recipe) != recipe:
            raise ValueError(f"pas_config['recipe']={given['recipe']!r} and recipe={recipe!r} disagree: give one of them.")
        return cls(**{**({"recipe": recipe} if recipe is not None else {}), **given})

    def __post_init__(self) -> None:
        def fail(key: str, value, fix: str) -> None:
            raise ValueError(f"pas_config[{key!r}]={value!r} is not valid for autodist on a target: {fix}")

        if not isinstance(self.hardware, (str, Hardware)):
            fail("hardware", self.hardware, "give a Hardware or a catalogue name such as 'H100-SXM-80GB'.")
        if isinstance(self.hardware, str):
            try:
                Hardware.named(self.hardware)
            except ValueError as err:                   # it names the known ones
                fail("hardware", self.hardware, str(err))
        batch = self.global_batch
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            fail("global_batch", batch, "a search on a target needs the sequences one step trains on, e.g. 128.")
        space = self.autodist_space
        if not isinstance(space, dict) or set(space) - set(SPACE_KEYS):
            fail("autodist_space", space, f"give a dict with some of {', '.join(SPACE_KEYS)}, "
                                          "e.g. {'tp': (2, 4, 8), 'pp': (1, 2, 4)}.")
        if self.recipe is not None and not isinstance(self.recipe, Recipe):
            fail("recipe", self.recipe, "give a nbscaler.Recipe, e.g. Recipe(master_dtype=torch.float32).")
        if self.master_dtype not in (UNSET, None) and not isinstance(self.master_dtype, torch.dtype):
            fail("master_dtype", self.master_dtype, "give a torch dtype such as torch.float32, or None.")
        if self.memory_optimizer is not UNSET and self.memory_optimizer not in OPTIMIZERS:
            fail("memory_optimizer", self.memory_optimizer, f"use one of {', '.join(OPTIMIZERS)}.")
        named = OPTIMIZERS[self.memory_optimizer] if self.memory_optimizer is not UNSET else UNSET
        try:
            priced = Recipe.of(self.recipe, optimizer=named, master_dtype=self.master_dtype)
        except ValueError as err:
            fail("recipe", self.recipe, f"{err} (memory_optimizer and master_dtype are shorthands for its fields)")
        object.__setattr__(self, "priced", priced)

    def target(self, cfg: ComputeConfig) -> Hardware:
        """The target with the config's ``runtime_ngpus`` GPUs (``Hardware.resolve``)."""
        try:
            return Hardware.resolve(self.hardware, ngpus=cfg.runtime_ngpus)
        except ValueError as err:
            raise ValueError(f"pas_config['hardware'] with runtime_ngpus={cfg.runtime_ngpus}: {err}") from None

    @property
    def optimizer(self) -> Any:
        """The optimizer priced (the recipe's)."""
        return self.priced.optimizer


def searches_on_target(policy: Any, cfg: ComputeConfig) -> bool:
    """Whether ``policy`` is autodist asked to plan for a target (``pas_config['hardware']``)."""
    return policy == BuiltinPolicy.AUTODIST and (cfg.pas_config or {}).get("hardware") is not None


def plan_on_target(module: torch.nn.Module, dummy_args: Dict[str, Any], cfg: ComputeConfig,
                   module_dtype: Optional[torch.dtype], recipe: Optional[Recipe] = None) -> Plan:
    """The plan of the fastest configuration that fits the target (see the module docstring).
    ``dummy_args`` hold one sequence, as ``nbscaler.sweep``'s do; ``module``, already in
    ``module_dtype`` (``target_module_dtype``); ``recipe``: ``nbscaler.plan``'s, if any."""
    search = TargetSearch.from_config(cfg, recipe)
    hardware = search.target(cfg)
    ranges = dict(search.autodist_space)
    if SEQUENCE_PARALLEL in cfg.pas_config:          # the user's word on it: search that alone
        ranges.setdefault(SEQUENCE_PARALLEL, (sequence_parallel(cfg),))
    if RECOMPUTE in cfg.pas_config:                  # so on what to recompute
        ranges.setdefault("recompute", (cfg.pas_config[RECOMPUTE],))
    start, cpu = time.perf_counter(), time.process_time()
    space = PlanSpace(module, dummy_args, hardware, global_batch=search.global_batch,
                      recipe=search.priced.replace(module_dtype=module_dtype), module_dtype=module_dtype,
                      prune=WITHIN, settle=False, **ranges)
    frame = space.frame
    fitting = frame[frame.fits]
    if fitting.empty:
        leanest = frame.loc[frame.peak_bytes.idxmin()]
        raise PolicyError(f"no configuration of the space fits {hardware.name}'s {gigabytes(hardware.memory_bytes)}: "
                          f"the leanest ({describe(leanest)}) needs {gigabytes(leanest.peak_bytes)} a GPU; "
                          "allow recompute='selective' or 'full', ZeRO 2, more pipeline stages or more nodes.")
    best = fitting.iloc[0]
    chosen = config_of(best, hardware.ngpus, frame.attrs["stack"])
    searched = {"search_s": time.perf_counter() - start, "search_cpu_s": time.process_time() - cpu}
    # the copy showed whether training and eval mode trace alike: the 80 layers are traced once
    placed = trace_and_place(module, one_sequence(dummy_args, int(best.micro_batch)), BuiltinPolicy.HYBRID, chosen,
                             module_dtype, modes_agree=space.modes_agree)
    placed.policy_name = str(BuiltinPolicy.AUTODIST)
    placed.compile_seconds = time.perf_counter() - start            # the search, then the whole trace
    placed.graph.meta["autodist"] = {"target": {
        **searched, "hardware": hardware, "global_batch": search.global_batch, "optimizer": search.optimizer,
        "master_dtype": search.priced.master_dtype, "recipe": space.recipe, "priced": len(frame), "excluded": len(frame.attrs["excluded"]),
        "pruned": frame.attrs["pruned"], "within": WITHIN, "chosen": best.to_dict(),
        "runners_up": [r.to_dict() for _, r in runners_up(frame, best).iterrows()],
        "fitting": len(fitting)}}
    return placed


def target_module_dtype(cfg: ComputeConfig, module_dtype: Optional[torch.dtype]) -> Optional[torch.dtype]:
    """The dtype a search on a target builds the module in: ``module_dtype``, or where that is
    ``None`` the one ``pas_config['recipe']`` names (``Recipe.of``: the two must agree where both
    are given)."""
    named = (cfg.pas_config or {}).get("recipe")
    if not isinstance(named, Recipe):
        return module_dtype
    return Recipe.of(named, module_dtype=UNSET if module_dtype is None else module_dtype).module_dtype


def runners_up(frame: pd.DataFrame, best: pd.Series, most: int = RUNNERS_UP) -> pd.DataFrame:
    """The configurations set against ``best``, fastest first: the fastest of all when it does not
    fit (memory rules it out), then the fastest fitting row of each other tp x cp x ep x pp layout and
    of ``best``'s own layout with the other recomputation (a frame without ``cp`` or ``ep``, from
    before they were columns, has layouts of the columns it has)."""
    frame = frame.copy(deep=False)
    frame.attrs = {}                    # its frame of exclusions would be compared at each concat
    fastest = frame.sort_values("step_time_s", kind="stable").head(1)
    faster = fastest[~fastest.fits & (fastest.step_time_s < best.step_time_s)]
    fitting = frame[frame.fits]
    layout = [c for c in ("tp", "cp", "ep", "pp") if c in frame.columns]
    mine = (fitting[layout] == best[layout]).all(axis=1)
    others = fitting[~mine].groupby(layout, sort=False).head(1)
    same = fitting[mine & (fitting.recompute != best.recompute)].head(1)
    rows = pd.concat([same, others]).sort_values("step_time_s", kind="stable")
    return pd.concat([faster, rows]).head(most)


