"""ZeRO stage 3's units: which parameters are gathered, and freed, together.

Under ``ComputeConfig(use_zero=True, zero_stage=3)`` a rank stores ``1/N`` of each parameter and
all-gathers the whole of a *unit* just before the unit's forward runs (``nbscaler.runtime.fsdp``).
A unit is a module instance, named as ``pas_config['recompute_modules']`` names modules
(``nbscaler.policy.modules``): ``ComputeConfig.zero_units`` lists paths, patterns or class names,
and a container (``'layers'``, a ModuleList) stands for each of its children. By default the units
are the layers of the model's repeated layers (``recompute.stack_path``), as ``fully_shard`` is
applied to each transformer block; every parameter outside them (embeddings, final norm, head) is
one more unit, ``REST_UNIT``, gathered for the whole step.

The pass ``mark_shard_units`` writes ``graph.meta[SHARD_UNITS]``: each trained parameter's name ->
its unit, and ``graph.meta[SHARD_RESHARD]``: ``ComputeConfig.zero_reshard_after_forward``. Lowering reads it to put each unit's gather and release into the rank's program.

>>> mark_shard_units(graph, cfg)                               # doctest: +SKIP
>>> graph.meta["shard_units"]["blocks.0.attn.qkv.weight"]
'blocks.0'
"""

from __future__ import annotations

from typing import Dict, List

from nbscaler.config import ComputeConfig
from nbscaler.ir.graph import REST_UNIT, SHARD_RESHARD, SHARD_UNITS, IRGraph
from nbscaler.policy.modules import describe_modules, module_classes, unknown_names
from nbscaler.policy.primitives import PolicyError
from nbscaler.policy.recompute import region_module, stack_path


def unit_names(graph: IRGraph, cfg: ComputeConfig) -> List[str]:
    """The module names whose instances are units: ``cfg.zero_units``, or the repeated layers."""
    if cfg.zero_units:
        missing = unknown_names(graph, cfg.zero_units)
        if missing:
            raise PolicyError(f"ComputeConfig.zero_units names {missing}, which name no module the model runs; name "
                              "modules by path (e.g. 'layers', 'layers.3', 'layers.*.mlp') or by class name. The model "
                              f"has: {describe_modules(graph)}.")
        return list(cfg.zero_units)
    path = stack_path(graph)
    return [path] if path is not None else []


def mark_shard_units(graph: IRGraph, cfg: ComputeConfig) -> None:
    """The pass: ``graph.meta[SHARD_UNITS] = {parameter name: unit}`` under ZeRO stage 3 (see the
    module docstring); removed otherwise. Raises ``PolicyError`` when ``zero_units`` names no module."""
    graph.meta.pop(SHARD_UNITS, None)
    graph.meta.pop(SHARD_RESHARD, None)
    if not (cfg.use_zero and cfg.zero_stage == 3):
        return
    names = unit_names(graph, cfg)
    classes, containers = module_classes(graph), set(graph.meta.get("module_containers", ()))
    units: Dict[str, str] = {}
    for name, t in graph.weights.items():
        if t.kind != "param":
            continue
        module = name.rsplit(".", 1)[0] if "." in name else ""
        units[name] = (region_module(module, names, classes, containers) if names else None) or REST_UNIT
    graph.meta[SHARD_UNITS] = units
    graph.meta[SHARD_RESHARD] = cfg.zero_reshard_after_forward
