"""The calls generated code makes where a plan splits the experts (``expert_parallel``): the
routed-experts op with this device's experts, from ``nbscaler.runtime.experts``, and the comment
that says which experts the device holds and what travels."""

from __future__ import annotations

from typing import Any, Dict, Tuple

from nbscaler.codegen.render import render_call
from nbscaler.ir.graph import IRGraph, IRNode
from nbscaler.ir.layer_rules import expert_count, expert_parallel, held_experts


def experts_call(node: IRNode, args: Tuple, kwargs: Dict[str, Any], group: str) -> str:
    """The expression generated code evaluates for expert-parallel ``node`` over rendered arguments."""
    call = render_call(node, args, kwargs)           # alias(arguments)
    return f"{expert_parallel(node)}({call[call.index('(') + 1:-1]}, group={group})"


def experts_comment(node: IRNode, device: int) -> str:
    """``# expert parallel: this device holds experts 2..3 of 4 ...``."""
    held = held_experts(node, device)
    return (f"# expert parallel: this device holds experts {held[0]}..{held[-1]} of {expert_count(node)} and "
            f"routes its share of the tokens; each (token, expert) pair goes to its expert's device and back, "
            f"one all-to-all each way (their gradients the same way back)")


def experts_imports(graphs: Dict[int, IRGraph]) -> str:
    """The import line of the expert-parallel functions ``graphs`` call ('' when none)."""
    used = sorted({fn for g in graphs.values() for n in g.nodes for fn in [expert_parallel(n)] if fn})
    return f"from nbscaler.runtime.experts import {', '.join(used)}" if used else ""
