"""A sweep row's configuration as nbscaler plans it: its ``ComputeConfig`` (``config_of``), the
``hybrid`` options it sets (``pas_config``) and the placement of the two-layer copy its row is
priced from (``CopyPlacementKey``)."""

from __future__ import annotations

from typing import Any, Dict, NamedTuple

from nbscaler.columns import SweepColumn as S
from nbscaler.config import RECOMPUTE, RECOMPUTE_MODULES, ComputeConfig, RecomputeGranularity
from nbscaler.policy.builtin import SEQUENCE_PARALLEL
from nbscaler.policy.context import CONTEXT_PARALLEL, CONTEXT_PARALLEL_KIND
from nbscaler.policy.experts import EXPERT_PARALLEL_KEY
from nbscaler.schedule.schedulers import scheduler_spec
from nbscaler.space.ranges import CONTEXT_KIND_VALUES


def config_of(row, ngpus: int, stack_path: str) -> ComputeConfig:
    """The ``ComputeConfig`` of a sweep row (a mapping with the configuration columns) on
    ``ngpus`` GPUs, recomputing the layers at ``stack_path`` (``frame.attrs["stack"]``). A row
    without ``zero_reshard_after_forward`` (from before it was a column) frees after the forward; one
    without ``cp`` splits no sequence, one without ``ep`` no experts. Each of the ``pp`` pipeline
    devices is ``tp * cp * ep`` devices wide (the policy says which of them combine), so ``plan_ngpus`` is
    ``tp * cp * ep * pp``."""
    tp, pp, zero = int(row[S.TP]), int(row[S.PP]), int(row[S.ZERO_STAGE])
    cp = int(row[S.CP]) if S.CP in row else 1
    ep = int(row[S.EP]) if S.EP in row else 1
    kind = str(row[S.CONTEXT_PARALLEL_KIND]) if S.CONTEXT_PARALLEL_KIND in row else CONTEXT_KIND_VALUES[0]
    reshard = bool(row[S.ZERO_RESHARD_AFTER_FORWARD]) if S.ZERO_RESHARD_AFTER_FORWARD in row else True
    virtual_stages, scheduler = int(row[S.VIRTUAL_STAGES]), str(row[S.SCHEDULER])
    pas = pas_config(str(row[S.RECOMPUTE]), bool(row[S.SEQUENCE_PARALLEL]), stack_path, cp, kind, ep)
    # a scheduler that takes any number of stages per device is told it: pp pipeline devices, each tp x cp x ep wide
    free = scheduler_spec(scheduler).stages_per_device is None
    return ComputeConfig(tp * cp * ep * pp, ngpus, use_end2end=True, use_pipeline=True, pipeline_nstages=pp * virtual_stages,
                         pipeline_nmicros=int(row[S.MICRO_BATCHES]), pipeline_scheduler=scheduler,
                         pipeline_virtual_stages=virtual_stages if free else -1,
                         use_zero=zero > 0, zero_stage=max(zero, 1), zero_reshard_after_forward=reshard or zero != 3,
                         pas_config=pas)


def pas_config(recompute: str, sequence_parallel: bool, stack_path: str, cp: int = 1,
               kind: str = CONTEXT_KIND_VALUES[0], ep: int = 1) -> Dict[str, Any]:
    """``hybrid``'s options of a configuration: what is recomputed (``'full'``: each layer of the stack
    at ``stack_path``; ``'selective'``: the attention cores), sequence parallelism, context
    parallelism over ``cp`` devices with attention of ``kind`` (where ``cp > 1``), expert
    parallelism over ``ep`` devices (where ``ep > 1``)."""
    pas: Dict[str, Any] = {}
    if recompute == RecomputeGranularity.FULL:
        pas[RECOMPUTE_MODULES] = [stack_path]
    elif recompute == RecomputeGranularity.SELECTIVE:
        pas[RECOMPUTE] = RecomputeGranularity.SELECTIVE.value
    if sequence_parallel:
        pas[SEQUENCE_PARALLEL] = True
    if cp > 1:
        pas[CONTEXT_PARALLEL], pas[CONTEXT_PARALLEL_KIND] = cp, kind
    if ep > 1:
        pas[EXPERT_PARALLEL_KEY] = ep
    return pas


class CopyPlacementKey(NamedTuple):
    """The key of one placement of the two-layer copy in the space: what places the copy
    differently, one placement (and its facts) per value.

    ``zero_stage_2``: ZeRO stage 2 or 3, under which a weight whose ops each see a slice of the batch
    or the sequence (a norm's, under sequence parallelism) sums its gradient over the devices in
    the backward rather than in the reducer (``ComputeConfig.sums_partial_grads_after_backward``).
    It places the copy again only where the copy has such a weight (``PlanSpace._canonical``).
    Stage 3's units are not marked on the copy: ``space.pricing`` lays them out from its facts.

    ``cp``, ``kind``: context parallelism over ``cp`` devices with attention of that kind: the copy is
    placed over ``tp x cp`` devices, each group of ``tp`` neighbours on its chunks of the sequence, so
    a row's facts are those of the context-parallel plan.

    ``ep``: expert parallelism over ``ep`` devices: the copy is placed over them, each holding
    ``1/ep`` of every routed-experts op's experts and its share of the micro-batch for every other
    op (``policy.experts``), so a row's facts hold the experts' all-to-alls. Whether ``ep`` runs
    beside ``tp``, ``cp`` or sequence parallelism is the policy's word, given as it places the copy."""

    micro: int
    tp: int
    recompute: str
    sequence_parallel: bool
    zero_stage_2: bool
    cp: int = 1
    kind: str = CONTEXT_KIND_VALUES[0]
    ep: int = 1

    @property
    def devices(self) -> int:
        """The devices of one stage the copy is placed over."""
        return self.tp * self.cp * self.ep


def placement_of(config: Dict) -> CopyPlacementKey:
    """The placement of the two-layer copy a row of configuration ``config`` is priced from."""
    cp = config[S.CP]
    return CopyPlacementKey(config[S.MICRO_BATCH], config[S.TP], config[S.RECOMPUTE], config[S.SEQUENCE_PARALLEL],
                            config[S.ZERO_STAGE] in (2, 3), cp,
                            config[S.CONTEXT_PARALLEL_KIND] if cp > 1 else CONTEXT_KIND_VALUES[0], config[S.EP])
