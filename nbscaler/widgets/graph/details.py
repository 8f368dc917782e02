"""What the graph shows about one op when it is selected: the plan's facts about it, as HTML.

Everything comes from the plan: the row of ``plan.ops`` (annotation, placement, global and local
shapes, FLOPs), the user's source line it records, and the lines of each rank's generated file that
run it (``plan.source_lines``) with the collectives its inputs needed.
"""

from __future__ import annotations

import linecache
import os
from html import escape
from typing import TYPE_CHECKING, Dict, List, Optional

from nbscaler.glossary import split_name
from nbscaler.ir.layer_rules import parallel_splits
from nbscaler.widgets.formats import fmt_flops

if TYPE_CHECKING:
    from nbscaler.planning import Plan


def op_facts(plan: "Plan", node_id: int, op: dict) -> Dict[str, str]:
    """Label -> text for one op (the rows of the details table)."""
    devices = list(op["devices"])
    split = op["split"] if isinstance(op["split"], str) else None
    facts = {
        "op": f"{op['name']} = {op['target']}  [{op['op']}]",
        "module": op["module"] or "(top level)",
        "annotation": op["annotation"] or "(none: opaque, replicated)",
        "placement": (f"split {split!r} ({split_name(split, op['op'], parallel_splits(plan.graph).get(op['name']))}) "
                      f"over devices {devices}" if split
                      else f"replicated on devices {devices}"),
        "input shapes": ", ".join(map(_shape, op["in_shapes"])) or "-",
        "output shapes": ", ".join(map(_shape, op["out_shapes"])) or "-",
        "local output shapes": ", ".join(map(_shape, op["local_out_shapes"])) or "-",
        "FLOPs": f"{fmt_flops(op['flops_fwd'] or 0)} forward, {fmt_flops(op['flops_bwd'] or 0)} backward; "
                 f"{fmt_flops(op['local_flops_fwd'] or 0)} forward per device",
    }
    if plan.geometry is not None and op["stage"] is not None:
        facts["stage"] = str(op["stage"])
    facts["source"] = user_source(op.get("source_file"), op.get("source_line")) or "(not recorded)"
    return facts


def user_source(path: Optional[str], line) -> str:
    """``file.py:42  the line's text`` for a recorded source location."""
    if not path or line is None or line != line:          # None or NaN
        return ""
    line = int(line)
    text = linecache.getline(path, line).strip()
    return f"{os.path.basename(path)}:{line}  {text}"


def generated_lines(plan: "Plan", node_id: int) -> Dict[int, List[str]]:
    """Rank -> ``'  123  text'`` for each generated line that runs ``node_id`` on that rank."""
    out = {}
    for rank, per_node in plan.source_lines.items():
        lines = per_node.get(node_id)
        if lines:
            text = plan.sources[rank].splitlines()
            out[rank] = [f"{n:>5}  {text[n - 1].strip()}" for n in lines]
    return out


def details_html(plan: "Plan", node_id: int, op: dict) -> str:
    """The details panel of a selected op."""
    rows = "".join(f"<tr><th>{escape(k)}</th><td><code>{escape(v)}</code></td></tr>"
                   for k, v in op_facts(plan, node_id, op).items())
    code = generated_lines(plan, node_id)
    ranks = "".join(f'<div class="nbs-genline"><b>rank {r}</b><pre>{escape(chr(10).join(lines))}</pre></div>'
                    for r, lines in code.items())
    absent = [r for r in plan.source_lines if r not in code]
    if absent:
        ranks += f"<div class='nbs-muted'>not run on rank(s) {', '.join(map(str, absent))}</div>"
    return (f'<div class="nbs-details" data-node="{node_id}"><table>{rows}</table>'
            f"<div class='nbs-genlines'><b>generated code</b>{ranks}</div></div>")


def _shape(shape) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"
