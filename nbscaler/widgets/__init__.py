"""Views over a ``Plan`` for Jupyter: each has a live widget and a self-contained HTML rendering.

Nothing else in ``nbscaler`` imports this package (``nbscaler.cli`` does, lazily, for ``report``).
"""

from nbscaler.widgets.base import Measured, View
from nbscaler.widgets.code import CodeView
from nbscaler.widgets.graph import GraphView
from nbscaler.widgets.memory import MemoryView
from nbscaler.widgets.plan_table import PlanView
from nbscaler.widgets.report import write_report
from nbscaler.widgets.routing import RoutingView
from nbscaler.widgets.timeline import TimelineView
from nbscaler.widgets.explorer import Explorer

__all__ = ["CodeView", "Explorer", "GraphView", "Measured", "MemoryView", "PlanView", "RoutingView", "TimelineView",
           "View", "write_report"]
