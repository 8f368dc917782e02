"""The plan tables each view shows, as the fingerprint its output carries beside the HTML.

``View._repr_mimebundle_`` adds ``view_bundle(view)``; a saved notebook's outputs are checked against
a fresh run by these fingerprints (``nbscaler.planning.fingerprint``). The timeline view draws
seconds only, so it carries none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

if TYPE_CHECKING:                      # views import the planner lazily: types only
    from nbscaler.planning.fingerprint import Fingerprint
    from nbscaler.widgets.base import View


def view_fingerprint(view: "View") -> Optional["Fingerprint"]:
    """What ``view`` shows of its plan: ops and collectives (plan and graph views), the predicted
    memory with the view's optimizer (memory view), the shown rank's file (code view)."""
    from nbscaler.planning.fingerprint import code_fingerprint, of_frames
    from nbscaler.widgets.code import CodeView           # the views import this module's caller
    from nbscaler.widgets.graph import GraphView
    from nbscaler.widgets.memory import MemoryView
    from nbscaler.widgets.plan_table import PlanView

    plan = view.plan
    if isinstance(view, (PlanView, GraphView)):
        return of_frames(plan.ops, plan.collectives)
    if isinstance(view, MemoryView):
        return of_frames(view.predicted)
    if isinstance(view, CodeView):
        return code_fingerprint(plan, view.rank)
    return None


def view_bundle(view: "View") -> Dict[str, Any]:
    """The MIME bundle entry with ``view``'s fingerprint (empty for a view that shows no plan table)."""
    from nbscaler.planning.fingerprint import bundle
    return bundle(view_fingerprint(view))
