"""Which reducers a parallel module's gradients go through, built from its weight table and the grid.

A rank's gradients are summed in two rounds (``ParallelModule.sync_grads``):

1. inside the unit (``replica_reducers``): over the devices of ops that split the batch or the
   sequence (``WeightSpec.partial_grads``), then over copies of a pipeline stage (chimera) or of a
   tied weight (``WeightSpec.replicas``);
2. across the units (``module_reducer``): an all-reduce (``Reducer``) or ZeRO (``ZeroReducer``;
   ``ShardedUnits`` under stage 3, which stores the parameters as shards of its units).

Where ZeRO spans a stage's devices too (``RankGrid.zero_over_stage``: context parallelism), its
reduce-scatter makes the first of the inside sums (``zero_over_stage_shares``).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from nbscaler.runtime.fsdp import ShardedUnits
from nbscaler.runtime.groups import get_group
from nbscaler.runtime.reducer import Reducer
from nbscaler.runtime.sources import WeightSource
from nbscaler.runtime.zero import ZeroReducer

#: What these functions take: a ``nbscaler.runtime.module.ParallelModule`` (its weight table, its
#: grid and its groups), named by its base class so that this module does not import that one.
Module = torch.nn.Module


def replica_reducers(module: Module) -> List[Reducer]:
    """The reducers that sum partial gradients inside ``module``'s unit, bucketed, before the sum
    across units (round 1 of the module docstring)."""
    partial: Dict[Tuple[int, ...], List[torch.nn.Parameter]] = {}
    copies: Dict[Tuple[int, ...], List[torch.nn.Parameter]] = {}
    over_stage = module.compute_config.grid.zero_over_stage
    for attr, spec in module.weight_specs.items():
        if spec.kind != "param":
            continue
        if spec.partial_grads and not over_stage:
            partial.setdefault(spec.partial_group, []).append(getattr(module, attr))
        if spec.replicas:
            copies.setdefault(spec.replicas, []).append(getattr(module, attr))
    bucket_bytes = module.compute_config.reduce_bucket_bytes
    return [Reducer(params, module.group(*devices), bucket_bytes) for sums in (partial, copies)
            for devices, params in sorted(sums.items())]


def sharded_attrs(module: Module) -> set:
    """The parameters ZeRO stage 3 stores as shards of units (none otherwise)."""
    cfg = module.compute_config
    if not (cfg.use_zero and cfg.zero_stage == 3):
        return set()
    return {a for attrs in module.shard_units.values() for a in attrs}


def zero_over_stage_shares(module: Module) -> Dict[int, float]:
    """Under ``RankGrid.zero_over_stage``: ``id(param) -> share`` for the parameters every device of
    the stage holds whole with its whole gradient (an op run on the gathered sequence, which
    ``plan.explain()`` names): each device sends ``1/n`` of it, so the reduce-scatter over the
    ``n`` devices sums it once. The others must be held by all of the stage's devices, each with a
    part of its gradient, which the reduce-scatter sums as it stands. A tied weight's copies in
    other stages (``WeightSpec.replicas``) are summed first, part by part: in either order the
    same sum. Raises for a parameter split over the devices (its slices are different weights)."""
    stage = module.compute_config.grid.same_weight_devices(module.plan_device)
    shares, wrong = {}, []
    for attr, spec in module.weight_specs.items():
        if spec.kind != "param" or spec.partial_grads and tuple(spec.partial_group) == stage:
            continue
        if tuple(spec.devices) == stage and spec.parts == 1:
            shares[id(getattr(module, attr))] = 1.0 / len(stage)
        else:
            wrong.append(spec.name)
    if wrong:
        raise RuntimeError(
            f"ZeRO splits this context-parallel plan's state over the devices {stage} of each stage too, which "
            f"needs each of them to hold every parameter whole, but {len(wrong)} are split over them "
            f"({', '.join(wrong[:3])}{', ...' if len(wrong) > 3 else ''}); plan.explain() says how. Make those ops "
            "take the sequence split, or train without use_zero.")
    return shares


def module_reducer(module: Module, source: Optional[WeightSource] = None) -> Reducer:
    """The reducer that sums ``module``'s gradients across units (round 2 of the module docstring).
    Under ZeRO stage 3 it reads each unit's parameters from ``source`` as it shards them."""
    cfg, grid = module.compute_config, module.compute_config.grid
    shares = zero_over_stage_shares(module) if grid.zero_over_stage else {}
    dp_group = get_group(grid.dp_ranks(module.plan_device))
    if not cfg.use_zero:
        return Reducer(list(module.parameters()), dp_group, cfg.reduce_bucket_bytes)
    rank = module.world_rank
    zero_group, replica_group = get_group(grid.zero_ranks(rank)), get_group(grid.zero_replica_ranks(rank))
    if cfg.zero_stage == 3:
        units = {unit: [getattr(module, attr) for attr in attrs] for unit, attrs in module.shard_units.items()}
        attr_of = {id(getattr(module, attr)): attr for attrs in module.shard_units.values() for attr in attrs}
        fill = None if source is None else (lambda params: module._copy_from(source, [attr_of[id(p)] for p in params]))
        return ShardedUnits(units, dp_group, zero_group, replica_group, fill, shares=shares)
    return ZeroReducer(list(module.parameters()), dp_group, zero_group, replica_group, cfg.reduce_bucket_bytes,
                       stage=cfg.zero_stage, shares=shares)
