"""The experts of a plan as the plan views show them: one row per routed-experts op and device, the
experts that device holds and how their weights are stored (``plan.storage``).

Every fact is asked of ``nbscaler.ir.layer_rules`` (how many experts, top-k, routing, which a device
holds) and worded by ``nbscaler.glossary`` (``experts_text``, ``layout_text``).
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, List, Optional

import pandas as pd

from nbscaler.glossary import experts_text, layout_text
from nbscaler.ir.graph import IRNode
from nbscaler.ir.expert_rules import (EXPERT_OPS, EXPERT_WEIGHTS, expert_count, expert_groups, expert_hidden_parts,
                                      expert_parallel, expert_routing, expert_tensor_parallel, expert_top_k,
                                      expert_weight_sources, held_experts, held_hidden_units)
from nbscaler.units import fmt_bytes

if TYPE_CHECKING:
    from nbscaler.planning.planner import Plan

EXPERT_COLUMNS = ["op", "module", "device", "experts", "weights", "layout", "held_bytes"]
"""The columns of ``expert_rows``."""


def expert_nodes(plan: "Plan") -> List[IRNode]:
    """The plan's routed-experts ops, in forward order."""
    return [node for node in plan.graph.nodes if node.target in EXPERT_OPS]


def weights_layout(plan: "Plan", node: IRNode) -> str:
    """How ``node``'s expert weights are stored, in words: under expert parallelism split by experts
    over the expert group (``'experts split over the expert group [0, 1]: split on dim 0 (S(0))'``)."""
    layouts = sorted({str(plan.storage[t.name]) for t in expert_weight_sources(plan.graph, node)
                      if t.name in plan.storage})
    text = ", ".join(layout_text(x) for x in layouts) or "not stored (an input)"
    if expert_parallel(node) and expert_hidden_parts(node) > 1:
        devices, parts = list(node.placement.devices), expert_hidden_parts(node)
        groups = [devices[i:i + parts] for i in range(0, len(devices), parts)]
        return (f"experts split over {expert_groups(node)} expert groups {groups}, each group's experts cut by hidden "
                f"unit over its devices: {text}")
    if expert_parallel(node):
        return f"experts split over the expert group {list(node.placement.devices)}: {text}"
    if expert_tensor_parallel(node):
        return f"every expert split by its hidden width over {list(node.placement.devices)}: {text}"
    return text


def held_text(node: IRNode, device: Optional[int]) -> str:
    """What plan ``device`` holds of expert op ``node``, in words (all of it for ``device=None``):
    ``'experts 4..7 of 8, top-2, dropless'``, and ``', hidden units 0..7 of 16'`` where the experts
    are cut by hidden unit inside expert groups."""
    text = experts_text(held_experts(node, device), expert_count(node), expert_top_k(node), expert_routing(node))
    units, hidden = held_hidden_units(node, device), node.inputs[EXPERT_WEIGHTS[0]].shape[-1]
    if expert_parallel(node) and len(units) < hidden:
        text += f", hidden units {units[0]}..{units[-1]} of {hidden}"
    return text


def expert_rows(plan: "Plan") -> pd.DataFrame:
    """One row per routed-experts op and plan device that runs it (``EXPERT_COLUMNS``): its module,
    the experts the device holds (``'experts 4..7 of 8, top-2, dropless'``), the weights' names, how
    they are stored and the bytes of them the device holds. Empty for a plan without experts."""
    rows = []
    for node in expert_nodes(plan):
        weights = expert_weight_sources(plan.graph, node)
        names = ", ".join(t.name.rsplit(".", 1)[-1] for t in weights)
        layout, total = weights_layout(plan, node), expert_count(node)
        devices = node.placement.devices if node.placement is not None else (0,)
        parts = expert_hidden_parts(node)
        for device in devices:
            held = held_experts(node, device)
            rows.append({"op": node.name, "module": node.module_path, "device": device,
                         "experts": held_text(node, device), "weights": names, "layout": layout,
                         "held_bytes": sum(t.nbytes for t in weights) * len(held) // total // parts})
    return pd.DataFrame(rows, columns=EXPERT_COLUMNS)


def experts_html(plan: "Plan") -> str:
    """The plan card's experts: which each device holds and how their weights are stored, or nothing
    for a plan without routed experts."""
    rows = expert_rows(plan)
    if rows.empty:
        return ""
    split = any(expert_parallel(node) for node in expert_nodes(plan))
    head = ("expert parallel: each device holds its share of every routed-experts op's experts and their "
            "weights; every (token, expert) pair goes to its expert's device and back" if split
            else "every device holds every expert")
    shown = rows.assign(held_bytes=rows.held_bytes.map(fmt_bytes))
    page = (f"<div class='nbs-experts'><p><b>Experts</b>: {html.escape(head)}</p>"
            f"{shown.to_html(border=0, index=False)}</div>")
    return page.encode("ascii", "xmlcharrefreplace").decode("ascii")          # right under any charset
