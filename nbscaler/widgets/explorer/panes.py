"""The six views of the current plan, each in a fixed slot of the Explorer's layout.

A view is built the first time there is a plan to show and updated in place afterwards
(``View.update``), so the front end keeps its state (zoom, expanded blocks, scroll position) across
knob changes. ``ViewName`` lists the views in the order the Explorer lays them out.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Type

import ipywidgets as w

from nbscaler.columns import StrEnum
from nbscaler.cost.hardware import Hardware
from nbscaler.planning import Plan
from nbscaler.recipe import Recipe
from nbscaler.widgets.base import Measured, View


class ViewName(StrEnum):
    GRAPH = "graph"
    PLAN = "plan"
    CODE = "code"
    TIMELINE = "timeline"
    MEMORY = "memory"
    WHY = "why"


PLACEMENT_VIEWS = (ViewName.TIMELINE, ViewName.MEMORY, ViewName.WHY)
"""The views a knob change redraws at once (re-placing costs milliseconds, laying out a graph more)."""


def view_classes() -> Dict[ViewName, Type[View]]:
    """The class behind each view name."""
    from nbscaler.widgets.code import CodeView
    from nbscaler.widgets.explanation import ExplanationView
    from nbscaler.widgets.graph import GraphView
    from nbscaler.widgets.memory import MemoryView
    from nbscaler.widgets.plan_table import PlanView
    from nbscaler.widgets.timeline import TimelineView

    return {ViewName.GRAPH: GraphView, ViewName.PLAN: PlanView, ViewName.CODE: CodeView,
            ViewName.TIMELINE: TimelineView, ViewName.MEMORY: MemoryView, ViewName.WHY: ExplanationView}


ViewOptions = Dict[ViewName, Dict[str, Any]]


def view_options(recipe: Recipe, hardware: Optional[Hardware] = None) -> ViewOptions:
    """The options views take beyond the plan: the training recipe the memory prediction assumes
    (``nbscaler.Recipe``, as ``plan.memory`` and ``plan.summary`` take it) and, on a target, the
    hardware the timeline and memory views draw. The timeline's step on a target is priced with the
    same recipe as the memory, so the two panes agree."""
    optimizer = {"recipe": recipe}
    if hardware is None:
        return {ViewName.MEMORY: optimizer}
    on_target = {**optimizer, "hardware": hardware}
    return {ViewName.MEMORY: on_target, ViewName.TIMELINE: dict(on_target)}


def build_views(plan: Plan, measured: Optional[Measured] = None, names: Iterable[ViewName] = tuple(ViewName),
                options: Optional[ViewOptions] = None) -> Dict[ViewName, View]:
    """Fresh views of ``plan`` (the Compare tab builds its own pair this way)."""
    classes, options = view_classes(), options or {}
    views = {name: classes[name](plan, measured=measured, **options.get(name, {})) for name in names}
    link_views(views)
    return views


def link_views(views: Dict[ViewName, View]) -> None:
    """Selecting an op in the graph scrolls the code to its generated line."""
    if ViewName.GRAPH in views and ViewName.CODE in views:
        views[ViewName.CODE].link(views[ViewName.GRAPH])


class Panes:
    """One slot (an ipywidgets ``Box``) per view; ``show`` fills or updates them."""

    def __init__(self, options: Optional[ViewOptions] = None,
                 placeholder: str = "Press <b>Compile</b> to see this view."):
        self.options = options or {}
        self.views: Dict[ViewName, View] = {}
        self.slots: Dict[ViewName, w.Box] = {}
        for name in ViewName:
            slot = w.VBox([w.HTML(f"<i>{name}: {placeholder}</i>")], layout=w.Layout(width="100%"))
            slot.add_class(f"nbscaler-pane-{name}")
            self.slots[name] = slot

    def retarget(self, options: ViewOptions) -> None:
        """Draw with ``options`` from now on: a view whose options change is built afresh on its
        next ``show`` (a view keeps the options it was built with)."""
        for name in [n for n in self.views if self.options.get(n) != options.get(n)]:
            del self.views[name]
        self.options = options

    def show(self, plan: Plan, names: Iterable[ViewName] = tuple(ViewName), measured: Optional[Measured] = None,
             on_each=None) -> None:
        """Draw ``plan`` (and ``measured``) in the named views; ``on_each(name)`` after each one."""
        new = {}
        for name in names:
            view = self.views.get(name)
            if view is None:
                view = self.views[name] = new[name] = build_views(plan, measured, [name], self.options)[name]
                self.slots[name].children = [view.widget]
            else:
                view.update(plan, measured=measured)
            if on_each is not None:
                on_each(name)
        if new.keys() & {ViewName.GRAPH, ViewName.CODE}:
            link_views(self.views)
