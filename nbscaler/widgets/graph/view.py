"""``GraphView``: the IR graph of a plan, collapsed by module, one pane per rank, live in Jupyter.

>>> view = GraphView(plan)            # doctest: +SKIP
>>> view                              # a GPT opens as tok, pos, blocks.0 .. blocks.N, ln_f, head
>>> view.expand("blocks.3")           # or click blocks.3; click its frame's label to collapse
>>> view.select(17)                   # an op by its id in plan.ops; opens the modules around it
>>> view.search = "attn.qkv"          # boxes holding matching ops light up; view.matches lists them

The state lives in the widget's traitlets (``expanded``, ``selected``, ``search``, ``panes``), so
Python and the browser read and set the same values, and a test can check them without a browser.
Python draws each pane as SVG (``svg.py``) from a graphviz layout of what is visible; the browser
side (``widgets/graph.js``) only inserts it and turns clicks into changes of those traitlets.
"""

from __future__ import annotations

from html import escape
from typing import TYPE_CHECKING, Any, FrozenSet, List, Optional

import anywidget
import traitlets

from nbscaler.widgets.base import Measured, View
from nbscaler.widgets.frontend import frontend_text
from nbscaler.widgets.graph.model import LOGICAL, GraphModel
from nbscaler.widgets.graph.scene import Scene
from nbscaler.widgets.graph.svg import legend_html
from nbscaler.widgets.formats import fmt_bytes

if TYPE_CHECKING:
    from nbscaler.planning import Plan
    from nbscaler.planning.fingerprint import Fingerprint


class GraphWidget(anywidget.AnyWidget):
    """The live widget; ``GraphView`` keeps its traitlets in step with the plan."""

    _esm = traitlets.Unicode(frontend_text("graph.js")).tag(sync=True)
    _css = traitlets.Unicode(frontend_text("graph.css")).tag(sync=True)

    expanded = traitlets.List(traitlets.Unicode()).tag(sync=True)       # open modules
    selected = traitlets.Int(None, allow_none=True).tag(sync=True)      # IR node id (plan.ops.id)
    search = traitlets.Unicode("").tag(sync=True)
    matches = traitlets.List(traitlets.Int()).tag(sync=True)            # node ids the search found
    panes = traitlets.List(traitlets.Unicode()).tag(sync=True)          # panes shown
    pane_names = traitlets.List(traitlets.Unicode()).tag(sync=True)     # panes there are
    svgs = traitlets.Dict().tag(sync=True)                              # pane -> SVG
    marks = traitlets.Dict().tag(sync=True)                             # 'selected' / 'hits' -> box keys
    details = traitlets.Unicode("").tag(sync=True)
    legend = traitlets.Unicode("").tag(sync=True)
    info = traitlets.Unicode("").tag(sync=True)


class GraphView(View):
    """The module-collapsed IR graph of ``plan.graph``: logical pane plus one pane per rank."""

    def __init__(self, plan: "Plan", *, measured: Optional[Measured] = None, panes: Optional[List[str]] = None,
                 **options: Any) -> None:
        super().__init__(plan, measured=measured, **options)
        self._quiet = False                  # set while an update changes several traitlets at once
        self._model = GraphModel(plan)
        self.widget = GraphWidget(pane_names=self._model.pane_names,
                                  panes=self._model.check_panes(panes) if panes else self._model.default_panes(),
                                  expanded=sorted(self._model.tree.default_expanded()))
        self.widget.observe(self._on_expanded, "expanded")
        self.widget.observe(self._on_panes, "panes")
        self.widget.observe(self._on_selected, "selected")
        self.widget.observe(self._on_search, "search")
        self.widget.on_msg(self._on_message)
        self._draw()
        self._on_selected()

    # -- state, readable and settable from Python --------------------------------------------------
    @property
    def expanded(self) -> FrozenSet[str]:
        return frozenset(self.widget.expanded)

    @expanded.setter
    def expanded(self, paths) -> None:
        self.widget.expanded = sorted(self._model.tree.normalise(paths))

    @property
    def selected(self) -> Optional[int]:
        return self.widget.selected

    @selected.setter
    def selected(self, node_id: Optional[int]) -> None:
        self.select(node_id, reveal=False)

    @property
    def search(self) -> str:
        return self.widget.search

    @search.setter
    def search(self, text: str) -> None:
        self.widget.search = text

    @property
    def matches(self) -> List[int]:
        return list(self.widget.matches)

    @property
    def panes(self) -> List[str]:
        return list(self.widget.panes)

    @panes.setter
    def panes(self, panes: List[str]) -> None:
        self.widget.panes = self._model.check_panes(panes)

    @property
    def last_render_seconds(self) -> float:
        """Seconds the last redraw took (cutting scenes, layout and SVG), for checking speed by hand."""
        return self._model.last_render_seconds

    # -- actions ------------------------------------------------------------------------------------
    def expand(self, path: str) -> None:
        """Open one module (its ancestors open too)."""
        self._check_module(path)
        self.expanded = self.expanded | {path} | set(self._model.tree.ancestors(path))

    def collapse(self, path: str) -> None:
        """Close one module and everything opened inside it."""
        self._check_module(path)
        self.expanded = {p for p in self.expanded if p != path and not p.startswith(path + ".")}

    def toggle(self, path: str) -> None:
        (self.collapse if path in self.expanded else self.expand)(path)

    def reset(self) -> None:
        """Back to the opening view: layers and wrappers open, everything else collapsed."""
        self.expanded = self._model.tree.default_expanded()

    def select(self, node_id: Optional[int], reveal: bool = True) -> None:
        """Select an op by its IR node id (``plan.ops.id``); ``reveal`` opens the modules around it."""
        if node_id is not None:
            self._model.check_node(node_id)
            if reveal:
                self.expanded = self._model.reveal(node_id, self.expanded)
        self.widget.selected = node_id

    def scene(self, pane: str = LOGICAL) -> Scene:
        """What ``pane`` shows now: boxes, frames, and edges with their bytes."""
        return self._model.scene(self._model.check_panes([pane])[0], self.expanded)

    def _check_module(self, path: str) -> None:
        if path not in self._model.tree.modules or not path:
            raise ValueError(f"no module {path!r} in this graph; modules: "
                             f"{', '.join(list(self._model.tree.modules)[1:8])}, ...")

    # -- redrawing ------------------------------------------------------------------------------------
    def _draw(self) -> None:
        w = self.widget
        w.svgs = self._model.render(list(w.panes), self.expanded)
        scene = self._model.last_logical
        total = scene.total_bytes()
        w.info = (f"{len(self.plan.graph)} ops · {len(scene.boxes)} boxes shown · "
                  f"{fmt_bytes(total)} per device through collectives per step · "
                  f"drawn in {self._model.last_render_seconds * 1000:.0f} ms")
        ops = self.plan.ops
        contexts = self._model.facts.contexts
        w.legend = legend_html(range(self.plan.config.plan_ngpus),
                               [(s, o, contexts.get(n)) for s, o, n in zip(ops.split, ops.op, ops.name)])
        self._mark()

    def _mark(self) -> None:
        w = self.widget
        selected = [w.selected] if w.selected is not None else []
        w.marks = {"selected": self._model.boxes_holding(selected, self.expanded),
                   "hits": self._model.boxes_holding(w.matches, self.expanded)}

    def _on_expanded(self, change=None) -> None:
        if self._quiet:
            return
        normal = sorted(self._model.tree.normalise(self.widget.expanded))
        if normal != list(self.widget.expanded):
            self.widget.expanded = normal             # observed again, then drawn
            return
        self._draw()

    def _on_panes(self, change=None) -> None:
        if not self._quiet:
            self._draw()

    def _on_selected(self, change=None) -> None:
        if self._quiet:
            return
        node = self.widget.selected
        if node is not None and not (isinstance(node, int) and 0 <= node < len(self.plan.graph)):
            self.widget.selected = None
            return
        self.widget.details = self._model.details(node)
        self._mark()

    def _on_search(self, change=None) -> None:
        self.widget.matches = self._model.search(self.widget.search)
        self._mark()

    def _on_message(self, widget, content, buffers) -> None:
        if isinstance(content, dict) and content.get("type") == "reset":
            self.reset()

    def _redraw(self) -> None:
        """A new plan: keep what is open, selected and searched where it still exists; draw once."""
        keep_open, keep_selected = self.expanded, self.widget.selected
        self._model = GraphModel(self.plan)
        w = self.widget
        self._quiet = True
        try:
            w.pane_names = self._model.pane_names
            w.panes = [p for p in w.panes if p in self._model.pane_names] or self._model.default_panes()
            w.expanded = sorted(self._model.tree.normalise(keep_open))
            if keep_selected is not None and keep_selected >= len(self.plan.graph):
                w.selected = None
        finally:
            self._quiet = False
        w.matches = self._model.search(w.search)
        self._draw()
        self._on_selected()

    # -- saved form -------------------------------------------------------------------------------------
    def fingerprint(self) -> Optional["Fingerprint"]:
        """The plan's ops and collectives, which this view shows."""
        from nbscaler.planning.fingerprint import of_frames
        return of_frames(self.plan.ops, self.plan.collectives)

    def to_html(self) -> str:
        """The logical pane at the current expansion as inline SVG, with its legend and stylesheet."""
        svg = self._model.render([LOGICAL], self.expanded)[LOGICAL]
        title = escape(repr(self.plan))
        return (f'<div class="nbs-graphview nbs-static"><style>{frontend_text("graph.css")}</style>'
                f'<div class="nbs-title">{title}</div>{self.widget.legend}'
                f'<div class="nbs-info">{escape(self.widget.info)}</div>'
                f'<div class="nbs-panes"><div class="nbs-pane"><div class="nbs-pane-title">logical</div>{svg}</div>'
                f"</div></div>").encode("ascii", "xmlcharrefreplace").decode("ascii")
