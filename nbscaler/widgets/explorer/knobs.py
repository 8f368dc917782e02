"""The Explorer's knobs: one small, self-checking record of what the user chose.

``Knobs`` holds the policy and the ``ComputeConfig`` settings the controls expose, and turns them
into the ``ComputeConfig`` the planner takes. Nothing here knows about widgets, so the knobs can be
set from code and tested without a front end:

>>> Knobs(policy="pp", plan_ngpus=2, runtime_ngpus=2, nmicros=4).compute_config().use_pipeline
True
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple, Union

from nbscaler.config import RECOMPUTE, RECOMPUTE_MODULES, TRAIN_SCHEDULERS, ComputeConfig, RecomputeGranularity
from nbscaler.layouts import ContextKind
from nbscaler.policy.builtin import (PIPELINE_POLICIES, POLICY_KEYS, SEQUENCE_PARALLEL, SEQUENCE_PARALLEL_POLICIES,
                                     BuiltinPolicy)
from nbscaler.policy.context import CONTEXT_PARALLEL, CONTEXT_PARALLEL_KIND
from nbscaler.policy.experts import EXPERT_PARALLEL_KEY, EXPERT_TENSOR_PARALLEL_KEY

#: The policies that read ``pas_config['context_parallel']`` (``tp``, ``hybrid``).
CONTEXT_PARALLEL_POLICIES = tuple(p for p, keys in POLICY_KEYS.items() if CONTEXT_PARALLEL in keys)
#: The policies that read ``pas_config['expert_parallel']`` (``tp``, ``hybrid``).
EXPERT_PARALLEL_POLICIES = tuple(p for p, keys in POLICY_KEYS.items() if EXPERT_PARALLEL_KEY in keys)

Policy = Union[str, Callable[..., Any]]


@dataclass(frozen=True)
class Knobs:
    """What the Explorer's controls say: a policy and the compute settings it runs under.

    - ``stages``: pipeline stages; ``1`` means no pipeline unless the policy builds one, in which
      case it stages over every plan device.
    - ``nmicros``: micro-batches per training step (pipelines only).
    - ``use_zero`` / ``zero_ngroups`` / ``zero_stage``: ZeRO over the data-parallel units, and the
      context-parallel devices of each (stage 1 shards the optimizer state, 2 the gradients too,
      3 the parameters too).
    - ``zero_reshard_after_forward``: under stage 3, free each unit's gathered parameters after its
      forward (``False`` keeps them until the backward).
    - ``recompute``: how much of each layer is recomputed in the backward (``RecomputeGranularity``:
      ``'none'``, ``'selective'``, the attention cores, as ``pas_config['recompute']``, or ``'full'``,
      each repeated layer whole).
    - ``recompute_modules``: what ``'full'`` recomputes, named (``pas_config['recompute_modules']``;
      the Explorer gives the model's repeated layers, the stack a sweep reads); empty: the planner
      finds the stack itself (``pas_config['recompute'] = 'full'``). Ignored unless ``'full'``.
    - ``end2end``: the module takes the batch and returns its loss (the shipped GPT does);
      pipelines need it.
    - ``sequence_parallel``: norms, dropout and residual adds on a sequence slice between the
      tensor-parallel linears (``pas_config['sequence_parallel']``; policies that read it only).
    - ``context_parallel``: the devices each stage's sequence is split over
      (``pas_config['context_parallel']``, ``tp`` and ``hybrid`` only; 1: none). A size that divides
      the devices of a stage (``plan_ngpus`` over the pipeline stages) leaves the rest tensor parallel
      inside each context-parallel device; the policy refuses another size, or sequence parallelism
      beside it, with the fix, and the Explorer shows that refusal.
    - ``context_parallel_kind``: how attention reads the other devices' keys: ``'all_gather'`` or
      ``'ring'`` (``pas_config['context_parallel_kind']``; read only where ``context_parallel > 1``).
    - ``expert_parallel``: the devices each stage's routed experts are split over
      (``pas_config['expert_parallel']``, ``tp`` and ``hybrid`` only; 1: none). The policy takes
      only the devices of a stage and refuses another size, a model without routed experts, or
      sequence or context parallelism beside it, with the fix; the Explorer shows that refusal.
    - ``expert_tensor_parallel``: the devices of each expert group, which cut its experts by hidden
      unit (``pas_config['expert_tensor_parallel']``; read only where ``expert_parallel > 1``, whose
      product with it the policy checks against a stage's devices; 1: none).
    - ``torch_compile``: the ranks run their generated methods through ``torch.compile``
      (``ComputeConfig.compile``); the runs table then says how long that took (``torch_compile_s``).
    """

    policy: Policy = BuiltinPolicy.TP
    plan_ngpus: int = 2
    runtime_ngpus: int = 2
    stages: int = 1
    nmicros: int = 4
    scheduler: str = "1f1b"
    use_zero: bool = False
    zero_ngroups: int = 1
    zero_stage: int = 1
    zero_reshard_after_forward: bool = True
    recompute: str = RecomputeGranularity.NONE.value
    recompute_modules: Tuple[str, ...] = ()
    end2end: bool = True
    sequence_parallel: bool = False
    context_parallel: int = 1
    context_parallel_kind: str = ContextKind.ALL_GATHER.value
    torch_compile: bool = False
    expert_parallel: int = 1
    expert_tensor_parallel: int = 1

    def __post_init__(self) -> None:
        allowed = [g.value for g in RecomputeGranularity]
        if self.recompute not in allowed:
            raise ValueError(f"Knobs(recompute={self.recompute!r}) is invalid: use one of {', '.join(allowed)}.")
        kinds = [k.value for k in ContextKind]
        if self.context_parallel_kind not in kinds:
            raise ValueError(f"Knobs(context_parallel_kind={self.context_parallel_kind!r}) is invalid: use one of "
                             f"{', '.join(kinds)}.")
        object.__setattr__(self, "context_parallel_kind", ContextKind(self.context_parallel_kind).value)
        object.__setattr__(self, "recompute", RecomputeGranularity(self.recompute).value)   # a plain str

    @property
    def policy_label(self) -> str:
        """The policy as the runs table shows it: its name, or the function's name."""
        return str(self.policy) if isinstance(self.policy, str) else getattr(self.policy, "__name__", repr(self.policy))

    @property
    def stage3(self) -> bool:
        """Whether the knobs shard the parameters (ZeRO stage 3)."""
        return self.use_zero and self.zero_stage == 3

    @property
    def pipelined(self) -> bool:
        return self.stages > 1 or self.policy in PIPELINE_POLICIES

    @property
    def sequence_parallel_applies(self) -> bool:
        """Whether the policy reads ``sequence_parallel`` (``tp``, ``hybrid``, ``autodist``)."""
        return self.policy in SEQUENCE_PARALLEL_POLICIES

    @property
    def context_parallel_applies(self) -> bool:
        """Whether the policy reads ``context_parallel`` (``tp``, ``hybrid``)."""
        return self.policy in CONTEXT_PARALLEL_POLICIES

    @property
    def context_parallel_size(self) -> int:
        """The context-parallel size the plan is asked for: 1 where the policy does not read it."""
        return self.context_parallel if self.context_parallel_applies else 1

    @property
    def expert_parallel_applies(self) -> bool:
        """Whether the policy reads ``expert_parallel`` (``tp``, ``hybrid``)."""
        return self.policy in EXPERT_PARALLEL_POLICIES

    @property
    def expert_parallel_size(self) -> int:
        """The expert-parallel size the plan is asked for: 1 where the policy does not read it."""
        return self.expert_parallel if self.expert_parallel_applies else 1

    @property
    def expert_tensor_parallel_size(self) -> int:
        """The devices of each expert group the plan is asked for: 1 without expert parallelism."""
        return self.expert_tensor_parallel if self.expert_parallel_size > 1 else 1

    def replace(self, **changes: Any) -> "Knobs":
        return dataclasses.replace(self, **changes)

    def compute_config(self) -> ComputeConfig:
        """The ``ComputeConfig`` these knobs mean; raises ``ValueError`` naming a bad knob."""
        if self.scheduler not in TRAIN_SCHEDULERS:
            raise ValueError(f"scheduler {self.scheduler!r} is unknown: use one of {', '.join(TRAIN_SCHEDULERS)}.")
        if self.pipelined and not self.end2end:
            raise ValueError("a pipeline needs an end2end module (one forward argument, the batch, and the "
                             "loss as its output); pick a policy without stages for this model.")
        pipeline: Dict[str, Any] = {}
        if self.pipelined:
            pipeline = dict(use_pipeline=True, pipeline_nmicros=self.nmicros, pipeline_scheduler=self.scheduler,
                            pipeline_nstages=self.stages if self.stages > 1 else -1)
        pas_config: Dict[str, Any] = {SEQUENCE_PARALLEL: True} if self.sequence_parallel and \
            self.sequence_parallel_applies else {}
        if self.context_parallel_size > 1:        # the policy checks it against the stage's devices
            pas_config[CONTEXT_PARALLEL] = self.context_parallel_size
            pas_config[CONTEXT_PARALLEL_KIND] = self.context_parallel_kind
        if self.expert_parallel_size > 1:         # so is this
            pas_config[EXPERT_PARALLEL_KEY] = self.expert_parallel_size
        if self.expert_tensor_parallel_size > 1:
            pas_config[EXPERT_TENSOR_PARALLEL_KEY] = self.expert_tensor_parallel_size
        if self.recompute == RecomputeGranularity.FULL and self.recompute_modules:
            pas_config[RECOMPUTE_MODULES] = list(self.recompute_modules)
        elif self.recompute != RecomputeGranularity.NONE:
            pas_config[RECOMPUTE] = self.recompute
        return ComputeConfig(plan_ngpus=self.plan_ngpus, runtime_ngpus=self.runtime_ngpus, use_zero=self.use_zero,
                             zero_ngroups=self.zero_ngroups, zero_stage=self.zero_stage if self.use_zero else 1,
                             zero_reshard_after_forward=self.zero_reshard_after_forward or not self.stage3,
                             use_end2end=self.end2end, pas_config=pas_config, compile=self.torch_compile, **pipeline)

    def row(self) -> Dict[str, Any]:
        """The knobs as columns of the runs table."""
        return {"policy": self.policy_label, "plan_ngpus": self.plan_ngpus, "runtime_ngpus": self.runtime_ngpus,
                "stages": self.stages if self.pipelined else 1, "nmicros": self.nmicros if self.pipelined else 1,
                "scheduler": self.scheduler if self.pipelined else "",
                "zero": self.zero_stage if self.use_zero else 0,
                "sequence_parallel": self.sequence_parallel and self.sequence_parallel_applies,
                "context_parallel": context_label(self.context_parallel_size, self.context_parallel_kind),
                "expert_parallel": self.expert_parallel_size,
                "expert_tensor_parallel": self.expert_tensor_parallel_size,
                "recompute": self.recompute, "torch_compile": self.torch_compile}


def context_label(size: int, kind: str) -> str:
    """Context parallelism as the runs table shows it: ``''`` for none, else its size and kind.

    >>> context_label(2, "ring"), context_label(1, "ring")
    ('2 ring', '')
    """
    return f"{size} {ContextKind(kind).value}" if size > 1 else ""


def recompute_of(config: ComputeConfig) -> Tuple[str, Tuple[str, ...]]:
    """What a config recomputes, as the recompute knob reads it: its granularity and, for named
    modules (``recompute_modules``, which the knob shows as ``'full'``), their names.

    >>> recompute_of(ComputeConfig(2, 2, pas_config={"recompute": "selective"}))
    ('selective', ())
    >>> recompute_of(ComputeConfig(2, 2, pas_config={"recompute_modules": ["blocks"]}))
    ('full', ('blocks',))
    """
    names = tuple(config.pas_config.get(RECOMPUTE_MODULES) or ())
    if names:
        return RecomputeGranularity.FULL.value, names
    return RecomputeGranularity(config.pas_config.get(RECOMPUTE) or RecomputeGranularity.NONE).value, ()
