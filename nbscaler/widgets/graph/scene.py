"""What one pane of the graph shows at one expansion: boxes, frames, and edges with their bytes.

A *scene* is the graph cut by ``ModuleTree`` at the expanded set, for the logical pane (every op)
or for one runtime rank (the ops that rank runs, ``plan.rank_nodes``). It holds
no positions; ``layout`` adds those. Its numbers are the plan's own:

- a box's colours are the devices its ops are placed on (a module: each device's share of the
  module's forward FLOPs, ``local_flops_fwd``);
- an edge's bytes are the ``bytes_per_device`` of the rows of ``plan.collectives`` whose tensor
  goes from one box to the other. A row whose tensor stays inside a box (two ops of one collapsed
  module, or a weight its reader needs in another layout) counts on that box instead, so edges
  and boxes together always add up to ``plan.collectives``. A rank's pane counts the rows its
  device takes part in.

>>> scene = build_scene(facts, tree, tree.default_expanded(), rank=None)     # doctest: +SKIP
>>> sum(e.bytes for e in scene.edges) + sum(b.inside_bytes for b in scene.boxes.values())
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Dict, FrozenSet, List, Optional, Tuple

from nbscaler.widgets.graph.box import Box, BoxKind  # noqa: F401  (BoxKind: part of the scene's vocabulary, imported from here)
from nbscaler.widgets.graph.facts import INPUTS, OUTPUTS, PlanFacts
from nbscaler.widgets.graph.tree import ModuleTree, is_op_key, node_of


@dataclass
class Edge:
    """Data flowing from one box to another; ``collectives`` maps a collective to its bytes."""

    src: str
    dst: str
    tensors: int = 0
    bytes: int = 0
    collectives: Dict[str, int] = field(default_factory=dict)


@dataclass
class Scene:
    boxes: Dict[str, Box]                            # in forward order
    edges: List[Edge]
    frames: Dict[str, List[str]]                     # open module -> its members (boxes and frames)
    top: List[str]                                   # members of the root

    def total_bytes(self) -> int:
        return sum(e.bytes for e in self.edges) + sum(b.inside_bytes for b in self.boxes.values())


def build_scene(facts: PlanFacts, tree: ModuleTree, expanded: FrozenSet[str], rank: Optional[int]) -> Scene:
    """The scene of the logical pane (``rank=None``) or of one runtime rank's pane."""
    runs = facts.runs(rank)
    owner = {i: key for i, key in tree.owners(expanded).items() if runs is None or i in runs}
    shown = set(owner.values())
    leaves = [k for k in tree.leaves(expanded) if k in shown]
    boxes = {k: _box(facts, tree, k, rank) for k in leaves}
    edges: Dict[Tuple[str, str], Edge] = {}
    for src_node, dst_node in facts.data_edges:
        src, dst = _end(owner, src_node, INPUTS), _end(owner, dst_node, OUTPUTS)
        if src != dst and not (src in (INPUTS,) and dst == OUTPUTS):
            edges.setdefault((src, dst), Edge(src, dst)).tensors += 1
    device = facts.device_of(rank)
    for row in facts.comm_rows:
        if device is not None and device not in row.devices:
            continue
        dst = _end(owner, row.dst, OUTPUTS)
        src = dst if row.src is None else _end(owner, row.src, INPUTS)
        if src == dst:
            box = boxes[src] if src in boxes else boxes.setdefault(src, facts.io_box(src, rank))
            box.inside_bytes += row.bytes
            box.inside_collectives[row.collective] = box.inside_collectives.get(row.collective, 0) + row.bytes
        else:
            edge = edges.setdefault((src, dst), Edge(src, dst))
            edge.bytes += row.bytes
            edge.collectives[row.collective] = edge.collectives.get(row.collective, 0) + row.bytes
    for io in (INPUTS, OUTPUTS):
        if io not in boxes and any(io in pair for pair in edges):
            boxes[io] = facts.io_box(io, rank)
    frames, top = _frames(tree, expanded, set(boxes))
    ordered = {k: boxes[k] for k in ([INPUTS] if INPUTS in boxes else []) + leaves + ([OUTPUTS] if OUTPUTS in boxes else [])}
    return Scene(ordered, list(edges.values()), frames, ([INPUTS] if INPUTS in boxes else []) + top
                 + ([OUTPUTS] if OUTPUTS in boxes else []))


def _end(owner: Dict[int, str], node: Optional[int], outside: str) -> str:
    """The box showing ``node``; ``outside`` for the model's inputs/outputs and for ops this pane
    does not show (another pipeline stage's)."""
    if node is None or node < 0:
        return outside
    return owner.get(node, outside)


def _box(facts: PlanFacts, tree: ModuleTree, key: str, rank: Optional[int]) -> Box:
    """A fresh box (scenes add their bytes to it) from the facts' cached drawing of ``key``."""
    if is_op_key(key):
        drawn = facts.op_box(node_of(key), rank)
    else:
        drawn = facts.module_box(key, tree.modules[key].ops, rank)
    return replace(drawn, inside_collectives={})


def _frames(tree: ModuleTree, expanded: FrozenSet[str], shown: set) -> Tuple[Dict[str, List[str]], List[str]]:
    """Members of each open module that has something to show, and the members of the root."""
    members: Dict[str, List[str]] = defaultdict(list)

    def visit(path: str) -> bool:
        found = False
        for child in tree.modules[path].children:
            if not is_op_key(child) and child in expanded:
                if visit(child):
                    members[path].append(child)
                    found = True
            elif child in shown:
                members[path].append(child)
                found = True
        return found

    visit("")
    top = members.pop("", [])
    return dict(members), top
