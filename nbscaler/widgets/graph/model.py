"""The graph view's state machine, without any widget: panes, expansion, search and selection.

``GraphModel`` answers the questions the widget (or a test) asks about one plan: which panes exist,
what each pane shows at an expansion (SVG), which boxes hold the selected op or the search hits, and
the details of an op. It keeps the per-plan facts and reuses ``layout``'s cache, so a change of
expansion only cuts new scenes and lays out what is visible.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Dict, FrozenSet, Iterable, List, Optional

from nbscaler.widgets.graph.details import details_html
from nbscaler.widgets.graph.facts import PlanFacts
from nbscaler.widgets.graph.layout import layout_scenes
from nbscaler.widgets.graph.scene import Scene, build_scene
from nbscaler.widgets.graph.svg import scene_svg
from nbscaler.widgets.graph.tree import ModuleTree, op_key

if TYPE_CHECKING:
    from nbscaler.planning import Plan

LOGICAL = "logical"
#: Panes shown side by side when a view opens: the logical graph and up to this many ranks.
DEFAULT_RANK_PANES = 4


def rank_pane(rank: int) -> str:
    return f"rank {rank}"


def pane_rank(pane: str) -> Optional[int]:
    """``'rank 3'`` -> 3, ``'logical'`` -> None."""
    if pane == LOGICAL:
        return None
    if not pane.startswith("rank ") or not pane[5:].isdigit():
        raise ValueError(f"unknown pane {pane!r}: use 'logical' or 'rank N'")
    return int(pane[5:])


class GraphModel:
    """One plan's graph, cut and drawn on demand (see the module docstring)."""

    def __init__(self, plan: "Plan"):
        self.plan = plan
        self.tree = ModuleTree.from_graph(plan.graph)
        self.facts = PlanFacts(plan)
        self.last_render_seconds = 0.0

    # -- panes ------------------------------------------------------------------------------------
    @property
    def pane_names(self) -> List[str]:
        return [LOGICAL] + [rank_pane(r) for r in range(self.plan.config.runtime_ngpus)]

    def default_panes(self) -> List[str]:
        return self.pane_names[:1 + DEFAULT_RANK_PANES]

    def check_panes(self, panes: Iterable[str]) -> List[str]:
        """The panes in their canonical order; an unknown one is a ``ValueError`` naming the choices."""
        panes = list(panes)
        unknown = [p for p in panes if p not in self.pane_names]
        if unknown:
            raise ValueError(f"unknown pane(s) {unknown}; this plan has {self.pane_names}")
        return [p for p in self.pane_names if p in panes]

    def scene(self, pane: str, expanded: FrozenSet[str]) -> Scene:
        return build_scene(self.facts, self.tree, expanded, pane_rank(pane))

    def render(self, panes: List[str], expanded: FrozenSet[str]) -> Dict[str, str]:
        """Pane -> SVG at this expansion. Edge widths share one scale: the logical pane's largest edge."""
        start = time.perf_counter()
        scenes = {p: self.scene(p, expanded) for p in panes}
        logical = scenes[LOGICAL] if LOGICAL in scenes else self.scene(LOGICAL, expanded)
        max_bytes = max([e.bytes for e in logical.edges] + [1])
        layouts = layout_scenes(list(scenes.values()))
        out = {p: scene_svg(s, lay, max_bytes, p) for (p, s), lay in zip(scenes.items(), layouts)}
        self.last_logical = logical
        self.last_render_seconds = time.perf_counter() - start
        return out

    # -- selection and search -----------------------------------------------------------------
    def boxes_holding(self, node_ids: Iterable[int], expanded: FrozenSet[str]) -> List[str]:
        """The keys of the boxes that show these ops at this expansion (a collapsed module shows all
        the ops below it)."""
        owner = self.tree.owners(expanded)
        return sorted({owner[i] for i in node_ids if i in owner})

    def search(self, text: str) -> List[int]:
        """Ops whose name, op, target or module path contains ``text`` (case-insensitive)."""
        needle = text.strip().lower()
        if not needle:
            return []
        columns = [self.facts.ops.column(k) for k in ("name", "op", "target", "module")]
        return [i for i, texts in enumerate(zip(*columns)) if any(needle in str(t or "").lower() for t in texts)]

    def reveal(self, node_id: int, expanded: FrozenSet[str]) -> FrozenSet[str]:
        """``expanded`` plus every module that must open for op ``node_id`` to show as its own box."""
        self.check_node(node_id)
        return expanded | frozenset(self.tree.ancestors(op_key(node_id)))

    def check_node(self, node_id: int) -> None:
        if not isinstance(node_id, int) or not 0 <= node_id < len(self.plan.graph):
            raise ValueError(f"node id {node_id!r} is not in this plan's graph (0 .. {len(self.plan.graph) - 1}; "
                             "see plan.ops.id)")

    def details(self, node_id: Optional[int]) -> str:
        if node_id is None:
            return "<div class='nbs-muted'>click an op to see its annotation, shapes, FLOPs and generated code</div>"
        return details_html(self.plan, node_id, self.facts.ops[node_id])
