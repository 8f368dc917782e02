"""The knobs of autodist, read from ``ComputeConfig.pas_config`` and checked on the spot.

==========================  ==================================================================
``memory_limit_bytes``      each device must fit in this many bytes (parameters, gradients,
                            optimizer state, buffers and saved activations); ``None``: no limit
``memory_optimizer``        the optimizer the limit is checked for: ``'sgd'``, ``'adam'`` or
                            ``'adamw'`` (the default)
``pipeline_pivots``         module paths where a pipeline may be cut (before each); ``None``:
                            at any layer boundary
``autodist_constraints``    ``{module pattern: 'replicate' | dim name}``: ops under a module
                            matching the pattern (``fnmatch``, e.g. ``'blocks.*.mlp'``) are kept
                            whole, or split along that annotated dim where they have it
``save_plan_path``          write the chosen plan there as readable JSON
``load_plan_path``          place the graph from such a file instead of searching
``autodist_nstages``        with a pipeline: the number of stages to search (overriding
                            ``pipeline_nstages``), or ``'auto'`` to try every count that divides
                            ``plan_ngpus`` and keep the fastest the simulator predicts
``autodist_max_states``     the most partial plans the search keeps per op (beyond it, the best
                            ones): exact below it
``autodist_plan_ngpus``     devices per unit to search: ``'auto'`` tries every count that divides
                            ``runtime_ngpus`` and keeps the fastest per sample; a number fixes
                            it; ``None`` (the default) keeps ``plan_ngpus``. A smaller unit means
                            more data-parallel units, each fed its own batch (see ``units``)
``autodist_scheduler``      with a pipeline: ``'auto'`` also tries ``1f1b``, ``1f1b_interleaved``,
                            ``zb_h1`` and ``zbv`` (a list: those schedulers) on the same pipeline
                            devices (``1f1b_interleaved`` with ``pipeline_virtual_stages=2`` where
                            they are fewer than the plan devices), and keeps the fastest the
                            simulator predicts
==========================  ==================================================================

The keys of a search on a target (``hardware``, ``global_batch``, ``autodist_space``,
``recipe``, ``master_dtype``) are read by the plan space (``nbscaler.space.autodist.TargetSearch``), since
``nbscaler.plan`` hands such a search to it before any policy runs; on a traced graph this policy
refuses them.

>>> AutodistOptions.from_config(ComputeConfig(2, 2, pas_config={"memory_limit_bytes": 2**30}))
AutodistOptions(memory_limit_bytes=1073741824, ...)
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Type, Union

import torch

from nbscaler.config import ComputeConfig
from nbscaler.policy.modules import prefixes
from nbscaler.recipe import Recipe

OPTIMIZERS: Dict[str, Type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
KEYS = ("memory_limit_bytes", "memory_optimizer", "pipeline_pivots", "autodist_constraints", "save_plan_path",
        "load_plan_path", "autodist_nstages", "autodist_max_states", "autodist_plan_ngpus", "autodist_scheduler")
TARGET_KEYS = ("hardware", "global_batch", "autodist_space", "recipe", "master_dtype")
"""The keys of a search on a target, which the plan space reads (``nbscaler.space.autodist``)."""
AUTO_SCHEDULERS = ("1f1b", "1f1b_interleaved", "zb_h1", "zbv")
"""The schedulers ``autodist_scheduler='auto'`` tries besides the config's own."""


@dataclass(frozen=True)
class AutodistOptions:
    memory_limit_bytes: Optional[int] = None
    memory_optimizer: str = "adamw"
    pipeline_pivots: Optional[List[str]] = None
    autodist_constraints: Dict[str, str] = field(default_factory=dict)
    save_plan_path: Optional[str] = None
    load_plan_path: Optional[str] = None
    autodist_nstages: Optional[Union[int, str]] = None
    autodist_max_states: int = 4096
    autodist_plan_ngpus: Optional[Union[int, str]] = None
    autodist_scheduler: Optional[Union[str, List[str]]] = None

    @classmethod
    def from_config(cls, cfg: ComputeConfig) -> "AutodistOptions":
        """The options in ``cfg.pas_config`` (other keys there belong to other policies). A key of
        a search on a target given without its target (``TARGET_KEYS``) is refused: nothing would read it."""
        pas = cfg.pas_config or {}
        if pas.get("hardware") is None:
            for key in TARGET_KEYS[1:]:
                value = pas.get(key)
                if value is not None and not (key == "master_dtype" and value is torch.float32):
                    raise ValueError(f"pas_config[{key!r}]={value!r} is not valid for autodist: it is read only with "
                                     "a target; add pas_config['hardware'] (e.g. 'H100-SXM-80GB') or leave it out.")
        return cls(**{k: v for k, v in pas.items() if k in KEYS})

    def __post_init__(self) -> None:
        def fail(key: str, value, fix: str) -> None:
            raise ValueError(f"pas_config[{key!r}]={value!r} is not valid for autodist: {fix}")

        limit = self.memory_limit_bytes
        if limit is not None and (not isinstance(limit, int) or limit <= 0):
            fail("memory_limit_bytes", limit, "give a positive number of bytes per device, e.g. 2 * 2**30.")
        if self.memory_optimizer not in OPTIMIZERS:
            fail("memory_optimizer", self.memory_optimizer, f"use one of {', '.join(OPTIMIZERS)}.")
        pivots = self.pipeline_pivots
        if pivots is not None and (not isinstance(pivots, (list, tuple)) or not all(isinstance(p, str) for p in pivots)):
            fail("pipeline_pivots", pivots, "give a list of module paths, e.g. ['blocks.4', 'blocks.8'].")
        for pattern, pin in self.autodist_constraints.items():
            if not isinstance(pattern, str) or not isinstance(pin, str) or not pin:
                fail("autodist_constraints", {pattern: pin},
                     "map module patterns to 'replicate' or a dim name, e.g. {'blocks.*.mlp': 'replicate'}.")
        nstages = self.autodist_nstages
        if nstages is not None and nstages != "auto" and (not isinstance(nstages, int) or nstages < 1):
            fail("autodist_nstages", nstages, "give a number of pipeline stages, or 'auto'.")
        if nstages is not None and self.load_plan_path:
            fail("autodist_nstages", nstages, "a loaded plan keeps its own stages; leave autodist_nstages out.")
        unit = self.autodist_plan_ngpus
        if unit is not None and unit != "auto" and (not isinstance(unit, int) or isinstance(unit, bool) or unit < 1):
            fail("autodist_plan_ngpus", unit, "give a number of devices per unit that divides runtime_ngpus, or 'auto'.")
        schedulers = self.autodist_scheduler
        if schedulers is not None and schedulers != "auto" and (
                not isinstance(schedulers, (list, tuple)) or not all(_trains(x) for x in schedulers)):
            fail("autodist_scheduler", schedulers, f"give 'auto' or a list of training schedulers, e.g. {list(AUTO_SCHEDULERS)}.")
        if not isinstance(self.autodist_max_states, int) or self.autodist_max_states < 1:
            fail("autodist_max_states", self.autodist_max_states, "give a positive whole number.")

    @property
    def schedulers(self) -> List[str]:
        """The schedulers ``autodist_scheduler`` names (none when it is unset)."""
        named = self.autodist_scheduler
        return [] if named is None else list(AUTO_SCHEDULERS if named == "auto" else named)

    @property
    def optimizer(self) -> Type[torch.optim.Optimizer]:
        return OPTIMIZERS[self.memory_optimizer]

    @property
    def recipe(self) -> Recipe:
        """What the search prices a step and its memory with: ``memory_optimizer`` with no master
        copies (its scores compare placements; the recipe's dtypes move them alike)."""
        return Recipe(self.optimizer, master_dtype=None)

    def pin_of(self, module_path: str) -> Optional[str]:
        """The constraint on ops under ``module_path`` ('replicate', a dim name), if any."""
        for pattern, pin in self.autodist_constraints.items():
            if any(fnmatch.fnmatchcase(prefix, pattern) for prefix in prefixes(module_path)):
                return pin
        return None



def _trains(name: object) -> bool:
    """Whether ``name`` is a registered training scheduler."""
    from nbscaler.schedule import SCHEDULERS
    return isinstance(name, str) and name in SCHEDULERS and SCHEDULERS[name].training
