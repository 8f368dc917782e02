"""Compare: two runs side by side, in every view.

Each run gets fresh views of its own plan and measurements, laid out in two columns per view, with
the two rows of the runs table above them.
"""

from __future__ import annotations

from typing import Dict, List

import ipywidgets as w
import pandas as pd

from nbscaler.widgets.base import View
from nbscaler.recipe import Recipe
from nbscaler.widgets.explorer.panes import ViewName, build_views, view_options
from nbscaler.widgets.explorer.runs import Run, runs_frame


class Comparison:
    """Views of runs ``a`` and ``b`` side by side; ``views[run_id][name]`` are the views."""

    def __init__(self, a: Run, b: Run):
        self.runs = (a, b)
        self.views: Dict[int, Dict[ViewName, View]] = {
            run.id: build_views(run.plan, run.outcome.measured if run.outcome else None,
                                options=view_options(run.recipe or Recipe(optimizer=run.optimizer_fn))) for run in self.runs}
        self.table: pd.DataFrame = runs_frame(list(self.runs)).T
        tabs = w.Tab(children=[self._side_by_side(name) for name in ViewName],
                     titles=[str(name) for name in ViewName])
        self.widget = w.VBox([w.HTML(self.table.to_html(classes="nbscaler-compare-table")), tabs])
        self.widget.add_class("nbscaler-compare")

    def _side_by_side(self, name: ViewName) -> w.HBox:
        columns: List[w.Widget] = []
        for run in self.runs:
            header = w.HTML(f"<b>run {run.id}</b>: {run.knobs.policy_label}, "
                            f"{run.plan.config.plan_ngpus} x {run.plan.config.runtime_ngpus} devices")
            columns.append(w.VBox([header, self.views[run.id][name].widget], layout=w.Layout(width="50%")))
        return w.HBox(columns)
