"""Why autodist chose what it chose: per op, the choice against the runner-up, in seconds and bytes.

For every op the search placed, the *local cost* of a choice is its own time plus the collectives
on its edges (in from its producers and out to its readers, with their choices as searched) plus
the memory weight times the bytes it keeps. The runner-up is the cheapest other choice with every
neighbour left as it is. The rows are written to ``graph.meta['autodist']`` for ``Plan.explain()``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from nbscaler.ir.graph import IRNode
from nbscaler.policy.autodist.costs import Choice, ChoiceCosts


def _local_cost(node: IRNode, choice: Choice, chosen: Dict[int, Choice], costs: ChoiceCosts,
                readers: List[IRNode], bytes_weight: float) -> Dict[str, float]:
    """The terms of the search's cost that ``node``'s choice touches, with its neighbours fixed."""
    comm = 0.0
    for index, t in enumerate(node.inputs):
        if not t.is_weight:
            have = costs.source_layout(t, chosen.get(id(t.producer)) if t.producer is not None else None)
            comm += costs.edge_seconds(have, node, index, choice)
    for reader in readers:
        for index, t in enumerate(reader.inputs):
            if t.producer is node:
                comm += costs.edge_seconds(costs.source_layout(t, choice), reader, index, chosen.get(id(reader)))
    op, mem = costs.op_seconds(node, choice), costs.op_bytes(node, choice)
    return {"op_s": op, "comm_s": comm, "bytes": mem, "total": op + comm + bytes_weight * mem}


def explain_rows(nodes: List[IRNode], chosen: Dict[int, Choice], costs: ChoiceCosts, options: Dict[int, List[Choice]],
                 bytes_weight: float, stage: Optional[int] = None) -> List[Dict[str, Any]]:
    """One row per op: the choice, its costs, the runner-up and how much worse it is."""
    readers: Dict[int, List[IRNode]] = {}
    for n in nodes:
        for t in n.inputs:
            if t.producer is not None:
                readers.setdefault(id(t.producer), [])
                if n not in readers[id(t.producer)]:
                    readers[id(t.producer)].append(n)
    rows = []
    for node in nodes:
        mine = chosen[id(node)]
        here = _local_cost(node, mine, chosen, costs, readers.get(id(node), []), bytes_weight)
        others = [(c, _local_cost(node, c, chosen, costs, readers.get(id(node), []), bytes_weight))
                  for c in options[id(node)] if c != mine]
        runner = min(others, key=lambda oc: oc[1]["total"]) if others else None
        rows.append({
            "name": node.name, "module": node.module_path, "op": node.op, "stage": stage,
            "choice": mine or "replicate", "op_s": here["op_s"], "comm_s": here["comm_s"], "bytes": here["bytes"],
            "runner_up": (runner[0] or "replicate") if runner else None,
            "runner_up_op_s": runner[1]["op_s"] if runner else None,
            "runner_up_comm_s": runner[1]["comm_s"] if runner else None,
            "runner_up_bytes": runner[1]["bytes"] if runner else None,
            "margin_s": (runner[1]["total"] - here["total"]) if runner else None,
        })
    return rows


def reason(row: Dict[str, Any]) -> str:
    """One sentence: the choice against the runner-up, in the terms that decided it."""
    if not isinstance(row["runner_up"], str):             # None, or NaN once in a DataFrame
        return f"{row['choice']}: the only choice (nothing splits evenly, or a constraint pins it)"
    d_op = row["runner_up_op_s"] - row["op_s"]
    d_comm = row["runner_up_comm_s"] - row["comm_s"]
    d_bytes = row["runner_up_bytes"] - row["bytes"]
    parts = []
    if abs(d_op) > 1e-9:
        parts.append(f"{abs(d_op) * 1e3:.3g} ms {'less' if d_op > 0 else 'more'} compute")
    if abs(d_comm) > 1e-9:
        parts.append(f"{abs(d_comm) * 1e3:.3g} ms {'less' if d_comm > 0 else 'more'} communication")
    if abs(d_bytes) >= 1:
        parts.append(f"{abs(d_bytes) / 2**20:.3g} MiB {'less' if d_bytes > 0 else 'more'} memory")
    return f"{row['choice']} over {row['runner_up']}: " + (", ".join(parts) or "a tie, the earlier choice kept")
