"""Expert parallelism's all-to-alls on a timeline, where each expert-parallel op runs them.

An expert-parallel op (``nbscaler.experts.parallel``) runs its all-to-alls inside its own call: under
dropless routing first the per-expert counts, then every device's rows out to the devices that hold
their experts, the experts' products, and the rows back; the backward sends the rows' gradients the
other ways, back first. The cost model counts them in the op's section (``cost.local``'s
``EXPERT_COUNTS`` and ``EXPERT_EXCHANGE`` calls, the traffic table's rows of the same names), so the
block waits for each: they are drawn where they run in the block, the counts and the rows out
before the experts' products and the rows back after them (in the backward the reverse), each
lasting what the step model prices it at, for routing that loads every expert alike.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Set

from nbscaler.cost.context_calls import ContextCall, Item, forward_items, where
from nbscaler.cost.local import LocalRun
from nbscaler.ir.graph import IRNode
from nbscaler.ir.expert_rules import expert_parallel
from nbscaler.layouts import Collective

EXPERT_COLLECTIVES = (Collective.EXPERT_COUNTS, Collective.EXPERT_EXCHANGE)
"""The collectives an expert-parallel op runs inside its call."""


def expert_labels(node: IRNode) -> Dict[str, tuple]:
    """Each all-to-all of expert-parallel ``node`` -> its forward and backward labels: ``'counts'``,
    ``'out'`` (the rows to their experts' devices), ``'back'`` (the rows home)."""
    at = where(node)
    return {"counts": (f"{at}: pairs per expert, to every device", ""),
            "out": (f"{at}: rows out to their experts", f"{at}: rows' gradients back home"),
            "back": (f"{at}: rows back from the experts", f"{at}: rows' gradients out to the experts")}


def around_the_experts(items: List[Item]) -> List[Item]:
    """``forward_items`` with each expert-parallel op's second exchange (the rows back) after the op,
    where it runs; the counts and the first exchange stay before it."""
    out: List[Item] = []
    seen: Set[str] = set()
    back: Dict[str, Item] = {}
    for item in items:
        what, call = item[0], item[1]
        if what == "collective" and call.fn == Collective.EXPERT_EXCHANGE:
            if call.node in seen:
                back[call.node] = item
                continue
            seen.add(call.node)
        out.append(item)
        if what == "op" and call.node.name in back:
            out.append(back.pop(call.node.name))
    return out + list(back.values())


def expert_section_calls(run: LocalRun, time_op: Callable, comm) -> List[ContextCall]:
    """The expert-parallel all-to-alls of one section (``run``), each placed as a share of its
    forward or backward block (module docstring); ``time_op`` and ``comm`` as
    ``cost.context_calls.section_calls`` takes them. Empty where no op is expert-parallel."""
    nodes = {op.node.name: op.node for op in run.ops if expert_parallel(op.node)}
    if not nodes:
        return []
    items = around_the_experts(forward_items(run, time_op, comm))
    total_f = sum(f for _, _, f, _ in items) or 1.0
    total_b = sum(b for _, _, _, b in items) or 1.0
    out: List[ContextCall] = []
    done_f, seen = 0.0, set()
    for k, (what, item, f, b) in enumerate(items):
        if what == "collective" and item.fn in EXPERT_COLLECTIVES and item.node in nodes:
            role = "counts" if item.fn == Collective.EXPERT_COUNTS else ("back" if item.node in seen else "out")
            if role == "out":
                seen.add(item.node)
            forward, backward = expert_labels(nodes[item.node])[role]
            out.append(ContextCall("F", str(item.fn), forward, done_f / total_f, f, True, context=False))
            if b > 0:
                after_b = sum(x[3] for x in items[k + 1:])        # the backward reaches this item after those
                out.append(ContextCall("B", str(item.fn), backward, after_b / total_b, b, True, context=False))
        done_f += f
    return out
