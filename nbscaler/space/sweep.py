"""``nbscaler.sweep``: every configuration of a training run on a target, priced, in one table.

The question before a real run is not one plan but which: tp 4 or 8, how many pipeline stages,
which micro-batch, what to recompute, sequence parallel or not, ZeRO 1, 2 or 3 (fully sharded
data parallelism, against tp x pp). ``sweep`` answers it
for every combination of the ranges given, with the predictions ``plan.summary(hardware=...)``
makes for each, in seconds:

>>> frame = nbscaler.sweep(model, {"input_ids": ids}, Hardware.named("H100-SXM-80GB", nodes=8),
...                        global_batch=256, tp=(2, 4, 8), pp=(1, 2, 4, 8))      # doctest: +SKIP
>>> frame[frame.fits].head()            # fastest first (``nbscaler.columns.SweepColumn``)

How it prices. Each configuration is the ``hybrid`` policy with its ``tp`` inside each of ``pp``
stages, ``dp = GPUs / (tp * pp)`` units, a pipeline (of one stage when ``pp`` is 1: gradient
accumulation; ``pp * virtual_stages`` stages under a scheduler that interleaves) over
``global_batch / (dp * micro_batch)`` micro-batches, recomputation (``recompute``: ``'none'``,
``'selective'``, the attention cores, or ``'full'``, each of the model's repeated layers), sequence parallelism or not where ``tp > 1`` (``pas_config={"sequence_parallel": True}``:
norms, dropout and residual adds on a slice of the sequence, Korthikanti et al. 2022; at
``tp == 1`` there is nothing to slice, so one row, without), and ZeRO's stage (under stage 3,
with each layer freed after its forward or kept until its backward: ``zero_reshard_after_forward``;
``config_of`` builds that ``ComputeConfig``). Stage 3's gathers and reduce-scatters are timed as
``plan.summary`` times them (``cost.fsdp``, per layer: ``fsdp_comm_share``); its memory is what
the memory model gives for stage 3. Planning each one whole (trace, place, replay every device on
fake tensors) takes tens of seconds per configuration at 70B (``benchmarks/results/sweep.md``);
instead:

1. the model's repeated layers are found (``planning.stack``: ``model.layers``, 80 of them), and a
   copy with two layers is traced once per micro-batch size and placed once per (tp, recompute,
   sequence parallelism), and again under ZeRO stage 2 where that changes how a weight's
   gradient is summed (a norm's, under sequence parallelism: ``row_config.CopyPlacementKey``): a
   handful of small plans;
2. each such plan's ops are priced once on the target (``LayerFacts``: every op's roofline time,
   its tensor-parallel collectives' NCCL time, saved bytes, FLOPs, per tensor-parallel index);
3. per configuration, the full model's stages are cut where ``stage_by_cost`` cuts them (on the
   full depth's op FLOPs, with the second layer standing for every layer after the first), each
   stage sums its ops' facts (plus what a stage's first layer saves of the tensors it receives,
   ``LayerFacts.stage_start``, and the collectives that make whole what a stage sends, such as
   sequence parallelism's all-gather, ``LayerFacts.stage_end``), and the pipeline, the gradient
   synchronisation, the optimizer step and the peak memory come from the very functions
   ``plan.summary`` calls (``space.pricing``).

So a row is what ``nbscaler.plan(module, ..., "hybrid", config_of(row, ...)).summary(recipe=recipe,
hardware=hardware)`` predicts, as long as every layer after the first
costs what the second does in the copy (one class, one shape, called in order) and the stages are
cut between layers (a cut inside a layer, for more stages than layers, is priced as if the layer's
recomputed region were whole); ``tests/space/test_sweep.py`` checks rows against full plans,
with and without sequence parallelism. The caches live in ``space.plan_space.PlanSpace``, which
keeps them to re-price the whole table when the target, the precision, the batch or the sequence
changes (the Explorer's space tab).

Bad input: a range value that cannot work on the target at all (a ``tp`` or ``pp`` that does not
divide its GPUs, more stages than the model has layers, a size below 1, a ``sequence_parallel``
that is not a bool) raises ``ValueError``; a combination that cannot run (``tp * pp`` not
dividing the GPUs, a global batch that ``dp * micro_batch`` does not divide, a scheduler's rule,
a placement the policy refuses, e.g. heads that ``tp`` does not divide, or experts that ``ep``
does not) is left out, with its
reason, in ``frame.attrs["excluded"]``.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

import pandas as pd
import torch

from nbscaler.cost.hardware import Hardware
from nbscaler.recipe import UNSET, Recipe
from nbscaler.space.plan_space import CONFIG_COLUMNS, PREDICTION_COLUMNS, PlanSpace, config_of
from nbscaler.space.ranges import CONTEXT_KIND_VALUES, RECOMPUTE_VALUES

__all__ = ["CONFIG_COLUMNS", "PREDICTION_COLUMNS", "config_of", "sweep"]


def sweep(module: torch.nn.Module, dummy_args: Dict[str, Any], hardware: Hardware, *, global_batch: int,
          tp: Optional[Sequence[int]] = None, pp: Optional[Sequence[int]] = None,
          micro_batch: Optional[Sequence[int]] = None, recompute: Sequence = RECOMPUTE_VALUES,
          sequence_parallel: Sequence[bool] = (False, True), zero_stage: Sequence[int] = (0, 1, 2),
          zero_reshard_after_forward: Sequence[bool] = (True,), recipe: Optional[Recipe] = None,
          optimizer: Any = UNSET, master_dtype: Any = UNSET, module_dtype: Any = UNSET, grad_reduce_dtype: Any = UNSET,
          scheduler: str = "1f1b", virtual_stages: Sequence[int] = (1,), progress: bool = True,
          prune: Optional[float] = None, cp: Sequence[int] = (1,),
          context_parallel_kind: Sequence[str] = CONTEXT_KIND_VALUES, float8: Optional[Sequence] = None,
          compiled: Optional[Sequence[bool]] = None, ep: Sequence[int] = (1,), **optimizer_kwargs: Any) -> pd.DataFrame:
    """Every configuration of ``module`` on ``hardware`` the ranges allow, priced (see the module
    docstring for how). ``dummy_args`` hold one sequence; ``global_batch`` counts sequences per step.

    ``tp``, ``pp``: sizes to try (``None``: every divisor of the target's GPUs, ``pp`` at most the
    model's layers); ``micro_batch``: sequences per micro-batch (``None``: every divisor of the
    global batch); ``recompute``: what to recompute in the backward, some of ``'none'``, ``'selective'``
    (each layer's attention core) and ``'full'`` (each layer of the stack), ``True`` and ``False``
    standing for ``'full'`` and ``'none'`` (the frame's ``recompute`` column reads the words);
    ``sequence_parallel``: sequence parallelism or not, tried only where ``tp > 1`` (at ``tp == 1``
    a configuration is priced once, without); ``zero_stage``: 0 (no ZeRO), 1, 2, 3 (FSDP: parameters
    gathered a layer at a time); ``zero_reshard_after_forward``: under stage 3, free each layer
    after its forward (``True``) and/or keep it gathered until its backward (``False``), tried at
    stage 3 only; ``cp``: context-parallel sizes (each stage's sequence over ``cp`` groups of ``tp``
    tensor-parallel devices; default ``(1,)``, none; rows whose sequence ``2 * cp`` does not divide
    are left out with their reason), with ``context_parallel_kind`` (``'all_gather'``, the default,
    and/or ``'ring'``) tried where ``cp > 1``; ``ep``: expert-parallel sizes (each stage's routed
    experts split over ``ep`` devices, every other op split by batch: ``pas_config={"expert_parallel":
    ep}``; default ``(1,)``, none; a row the policy refuses, with ``tp``, ``cp`` or sequence
    parallelism beside ``ep > 1``, on a model without routed experts, with experts that ``ep`` does
    not divide or a micro-batch it does not, is left out with the policy's reason); ``float8``: the
    linear layers' products, some of ``'none'``, ``'tensorwise'`` and ``'rowwise'`` (default: the
    recipe's; fp8 on a target without fp8 units is refused), and ``compiled``: the target's software compiling each layer of the stack on its
    own (as torchtitan compiles each transformer block) or nothing (default: the software's), each a
    row of its own, priced as ``plan.summary`` prices ``recipe.replace(float8=...)`` on
    ``hardware.running(software.replace(compiled=True, compiled_modules=(stack,)))``; ``scheduler``: the pipeline scheduler (``nbscaler.schedule``), with
    ``virtual_stages`` stages per pipeline device where it takes several (``1f1b_interleaved``, whose
    rows set ``pipeline_virtual_stages``, so each of its ``pp`` pipeline devices is ``tp`` wide;
    ``zbv`` always has two). Returns one row per configuration with the columns of
    ``nbscaler.columns.SweepColumn``, the fitting ones first, each group fastest first;
    ``frame.attrs`` holds ``"stack"`` (the layers recomputed) and ``"excluded"`` (a frame of the
    combinations left out and why).

    ``prune`` is for a search that wants the fastest fitting rows (autodist on a target): with
    ``prune=1.25``, the frame holds each tp x cp x ep x pp layout's fastest fitting row where that is within
    25% of the fastest of all (``prune=1``: that row alone), each as fast as the full sweep's, and
    only what was priced to find them. A combination is not priced when its pipeline's makespan
    alone (``pricing.pipeline_seconds``, never more than the step) is already too slow, or when
    what it saves for the backward alone cannot fit (``_pruned``); ``frame.attrs["pruned"]``
    counts them.

    Each configuration is priced for a run that trains with ``recipe`` (``nbscaler.Recipe``;
    default ``Recipe()``: AdamW, fp32 master copies, gradients summed in fp32), computing in the
    recipe's ``module_dtype``, or bf16 where it names none; ``optimizer``, ``master_dtype``,
    ``module_dtype`` (``None``: the module's own), ``grad_reduce_dtype`` and ``optimizer_kwargs``
    are shorthands for its fields."""
    return PlanSpace(module, dummy_args, hardware, global_batch=global_batch, tp=tp, pp=pp, micro_batch=micro_batch,
                     recompute=recompute, sequence_parallel=sequence_parallel, zero_stage=zero_stage,
                     zero_reshard_after_forward=zero_reshard_after_forward, recipe=recipe, optimizer=optimizer,
                     master_dtype=master_dtype, module_dtype=module_dtype, grad_reduce_dtype=grad_reduce_dtype, scheduler=scheduler, virtual_stages=virtual_stages,
                     progress=progress, prune=prune, settle=False, cp=cp, context_parallel_kind=context_parallel_kind,
                     float8=float8, compiled=compiled, ep=ep, **optimizer_kwargs).frame
