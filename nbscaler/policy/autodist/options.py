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
                            devices, and keeps the fastest the simulator predicts
``hardware``                plan for a target instead of this machine: a ``Hardware`` with
                            ``runtime_ngpus`` GPUs, or a catalogue name (``Hardware.catalogue()``)
                            whose nodes ``runtime_ngpus`` fills; autodist then chooses tp, pp,
                            micro-batch, recomputation, sequence parallelism and ZeRO as
                            ``nbscaler.sweep`` prices them
                            (``nbscaler.planning.autodist_on_target``)
``global_batch``            with ``hardware``: the sequences one training step trains on
``autodist_space``          with ``hardware``: the ranges to search, as ``nbscaler.sweep``'s
                            keywords ``tp``, ``pp``, ``micro_batch``, ``recompute``,
                            ``sequence_parallel``, ``zero_stage`` (a missing one: the
                            sweep's default; ``sequence_parallel`` missing and
                            ``pas_config['sequence_parallel']`` given: that value alone)
``master_dtype``            with ``hardware``: the optimizer's master copies' dtype
                            (``build_optimizer``'s; default ``torch.float32``)
==========================  ==================================================================

>>> AutodistOptions.from_config(ComputeConfig(2, 2, pas_config={"memory_limit_bytes": 2**30}))
AutodistOptions(memory_limit_bytes=1073741824, ...)
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Type, Union

import torch

from nbscaler.config import ComputeConfig
from nbscaler.cost.hardware import Hardware
from nbscaler.policy.modules import prefixes

OPTIMIZERS: Dict[str, Type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
KEYS = ("memory_limit_bytes", "memory_optimizer", "pipeline_pivots", "autodist_constraints", "save_plan_path",
        "load_plan_path", "autodist_nstages", "autodist_max_states", "autodist_plan_ngpus", "autodist_scheduler",
        "hardware", "global_batch", "autodist_space", "master_dtype")
SPACE_KEYS = ("tp", "pp", "micro_batch", "recompute", "sequence_parallel", "zero_stage")
"""The ranges ``autodist_space`` may give: ``nbscaler.sweep``'s keywords of the same names."""
TARGET_KEYS = ("global_batch", "autodist_space", "master_dtype")
"""The keys that only a search on a target (``hardware``) reads."""
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
    hardware: Optional[Union[str, Hardware]] = None
    global_batch: Optional[int] = None
    autodist_space: Dict[str, Any] = field(default_factory=dict)
    master_dtype: Optional[torch.dtype] = torch.float32

    @classmethod
    def from_config(cls, cfg: ComputeConfig) -> "AutodistOptions":
        """The options in ``cfg.pas_config`` (other keys there belong to other policies)."""
        return cls(**{k: v for k, v in (cfg.pas_config or {}).items() if k in KEYS})

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
        self._check_target(fail)

    def _check_target(self, fail) -> None:
        """The keys of a search on a target: a known target, a batch, ranges the sweep takes."""
        hardware = self.hardware
        if hardware is None:
            given = {"global_batch": self.global_batch, "autodist_space": self.autodist_space or None,
                     "master_dtype": self.master_dtype if self.master_dtype is not torch.float32 else None}
            for key, value in given.items():
                if value is not None:
                    fail(key, value, "it is read only with a target; add pas_config['hardware'] "
                                     "(e.g. 'H100-SXM-80GB') or leave it out.")
            return
        if isinstance(hardware, str) and hardware not in Hardware.catalogue():
            fail("hardware", hardware, f"no such target; the catalogue has {', '.join(Hardware.catalogue())} "
                                       "(or pass a Hardware object).")
        if not isinstance(hardware, (str, Hardware)):
            fail("hardware", hardware, "give a Hardware or a catalogue name such as 'H100-SXM-80GB'.")
        batch = self.global_batch
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            fail("global_batch", batch, "a search on a target needs the sequences one step trains on, e.g. 128.")
        space = self.autodist_space
        if not isinstance(space, dict) or set(space) - set(SPACE_KEYS):
            fail("autodist_space", space, f"give a dict with some of {', '.join(SPACE_KEYS)}, "
                                          "e.g. {'tp': (2, 4, 8), 'pp': (1, 2, 4)}.")
        if self.master_dtype is not None and not isinstance(self.master_dtype, torch.dtype):
            fail("master_dtype", self.master_dtype, "give a torch dtype such as torch.float32, or None.")

    def target(self, cfg: ComputeConfig) -> Hardware:
        """The target of ``hardware`` with the config's ``runtime_ngpus`` GPUs: a catalogue name
        gets as many nodes as they fill; a ``Hardware`` must have exactly that many."""
        hardware, gpus = self.hardware, cfg.runtime_ngpus
        if isinstance(hardware, str):
            per_node = Hardware.catalogue()[hardware].gpus_per_node
            if gpus % per_node:
                raise ValueError(f"pas_config['hardware']={hardware!r} has {per_node} GPUs a node, and "
                                 f"runtime_ngpus={gpus} is not a whole number of nodes; use a multiple of "
                                 f"{per_node}, or pass Hardware.named({hardware!r}) with gpus_per_node changed.")
            return Hardware.named(hardware, nodes=gpus // per_node)
        if hardware.ngpus != gpus:
            raise ValueError(f"pas_config['hardware'] ({hardware.name}) has {hardware.ngpus} GPUs but the config "
                             f"runs runtime_ngpus={gpus}; make them equal (Hardware.named(..., nodes=...)).")
        return hardware

    @property
    def schedulers(self) -> List[str]:
        """The schedulers ``autodist_scheduler`` names (none when it is unset)."""
        named = self.autodist_scheduler
        return [] if named is None else list(AUTO_SCHEDULERS if named == "auto" else named)

    @property
    def optimizer(self) -> Type[torch.optim.Optimizer]:
        return OPTIMIZERS[self.memory_optimizer]

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
