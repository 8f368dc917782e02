"""The calls generated code makes where a plan splits the experts (``expert_parallel``): the
routed-experts op with this device's experts, from ``nbscaler.runtime.experts``, and the comment
that says which experts the device holds and what travels."""

from __future__ import annotations

from typing import Any, Dict, Tuple

from nbscaler.codegen.render import render_call
from nbscaler.ir.graph import IRGraph, IRNode
from nbscaler.ir.expert_rules import (EXPERT_WEIGHTS, expert_count, expert_hidden_parts, expert_parallel,
                                      expert_tensor_parallel, held_experts, held_hidden_units)


def experts_call(node: IRNode, args: Tuple, kwargs: Dict[str, Any], group: str) -> str:
    """The expression generated code evaluates for expert-parallel ``node`` over rendered arguments."""
    call = render_call(node, args, kwargs)           # alias(arguments)
    parts = expert_hidden_parts(node)
    hidden = f", hidden_parts={parts}" if parts > 1 else ""
    return f"{expert_parallel(node)}({call[call.index('(') + 1:-1]}, group={group}{hidden})"


def experts_comment(node: IRNode, device: int) -> str:
    """``# expert parallel: this device holds experts 2..3 of 4 ...``."""
    held, parts = held_experts(node, device), expert_hidden_parts(node)
    if parts == 1:
        return (f"# expert parallel: this device holds experts {held[0]}..{held[-1]} of {expert_count(node)} and "
                f"routes its share of the tokens; each (token, expert) pair goes to its expert's device and back, "
                f"one all-to-all each way (their gradients the same way back)")
    units, hidden = held_hidden_units(node, device), node.inputs[EXPERT_WEIGHTS[0]].shape[-1]
    return (f"# expert parallel with tensor parallel inside the experts: this device holds hidden units "
            f"{units[0]}..{units[-1]} of {hidden} of experts {held[0]}..{held[-1]} of "
            f"{expert_count(node)}, and routes its share of the tokens; each (token, expert) pair goes to the "
            f"{parts} devices of its expert's group and their {parts} partial sums come back, one all-to-all each "
            "way (their gradients the same way back)")


def experts_tp_comment(node: IRNode, device: int) -> str:
    """``# tensor parallel inside the experts: this device holds hidden units 0..7 of 16 ...``, or '' for
    any other op."""
    if not expert_tensor_parallel(node):
        return ""
    units, hidden = held_hidden_units(node, device), node.inputs[EXPERT_WEIGHTS[0]].shape[-1]
    return (f"# tensor parallel inside the experts: this device holds hidden units {units[0]}..{units[-1]} "
            f"of each expert's {hidden} (w1, w3 by column, w2 by row), sees every token, and its output is a partial "
            "sum the next reader all-reduces")


def experts_imports(graphs: Dict[int, IRGraph]) -> str:
    """The import line of the expert-parallel functions ``graphs`` call ('' when none)."""
    used = sorted({fn for g in graphs.values() for n in g.nodes for fn in [expert_parallel(n)] if fn})
    return f"from nbscaler.runtime.experts import {', '.join(used)}" if used else ""
