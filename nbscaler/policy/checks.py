"""Checks that a policy placed every node where the compute config allows.

Unplaced nodes are replicated on their unit's (or stage's) devices; anything else that breaks the
rules is a ``PolicyError`` that names the node and says how to fix the policy.
"""

from __future__ import annotations

from typing import Dict

from nbscaler.config import ComputeConfig
from nbscaler.ir.graph import IRGraph, tied_stages
from nbscaler.policy.primitives import PolicyError, replicate
from nbscaler.schedule import PipelineGeometry


def check_placements(graph: IRGraph, cfg: ComputeConfig) -> None:
    """Every node placed, on the unit's devices; unplaced nodes are replicated on all of them.

    In a pipeline, every node has a stage, runs on its stage's devices, and reads only tensors made
    in its own or earlier stages. A parameter may be read in several stages (tied weights): each
    keeps a copy, and code generation sums their gradients.
    """
    if cfg.use_pipeline:
        check_stages(graph, cfg.grid.pipeline)
        check_tied_under_zero(graph, cfg)
        return
    devices = cfg.grid.stage_group(None)
    for node in graph.nodes:
        if node.placement is None:
            replicate(node, devices)
        if any(d not in devices for d in node.placement.devices):
            raise PolicyError(f"{node.name} is placed on devices {list(node.placement.devices)}, but a unit has "
                              f"plan_ngpus={cfg.plan_ngpus} devices (0..{cfg.plan_ngpus - 1}).")
        if tuple(sorted(node.placement.devices)) != devices:
            raise PolicyError(
                f"{node.name} ({node.module_path or 'top level'}) runs on devices {list(node.placement.devices)}, "
                f"not on all {cfg.plan_ngpus} devices of the unit. Without a pipeline, every op is split or "
                "replicated across the whole unit; give ops their own devices by staging the graph into a pipeline.")


def check_stages(graph: IRGraph, geometry: PipelineGeometry) -> None:
    nstages = geometry.schedule.nstages
    stage_of: Dict[int, int] = {}
    for node in graph.nodes:
        where = f"{node.name} ({node.module_path or 'top level'})"
        if node.stage is None or not 0 <= node.stage < nstages:
            raise PolicyError(f"{where} has stage {node.stage}; the '{geometry.schedule.name}' schedule has stages "
                              f"0..{nstages - 1}: give every node a stage (nbscaler.policy.staging).")
        group = geometry.stage_group(node.stage)
        if node.placement is None:
            replicate(node, group)
        if tuple(sorted(node.placement.devices)) != group:
            raise PolicyError(f"{where} is in stage {node.stage}, which runs on devices {list(group)}, but is placed "
                              f"on {list(node.placement.devices)}.")
        for t in node.inputs:
            if stage_of.get(id(t), -1) > node.stage:
                raise PolicyError(f"{where} in stage {node.stage} reads {t.name} from the later stage "
                                  f"{stage_of[id(t)]}; data may only flow to the same or later stages.")
        for t in node.output_tensors:
            stage_of[id(t)] = node.stage


def check_tied_under_zero(graph: IRGraph, cfg: ComputeConfig) -> None:
    """A weight read in several stages (tied) keeps a copy in each, whose gradients are summed
    after the backward; ZeRO stages 2 and 3 reduce-scatter and free each gradient in the backward,
    before that sum, so the copies would train apart: refused, with the fix."""
    if not (cfg.use_zero and cfg.zero_stage >= 2) or cfg.inference_only:
        return
    tied = tied_stages({"train": graph})
    if tied:
        named = ", ".join(f"{name} (stages {', '.join(map(str, stages))})" for name, stages in sorted(tied.items()))
        raise PolicyError(f"{named} {'is' if len(tied) == 1 else 'are'} read in several pipeline stages: each keeps a "
                          "copy whose gradients are summed after the backward, which ZeRO stage "
                          f"{cfg.zero_stage} has already reduce-scattered and freed by then. Use zero_stage=1 (it "
                          "reduces at the step, after the copies are summed), or untie the weights.")
