"""ExplanationView: why the plan is what it is, in words, with the table behind them (``plan.explain()``).

For ``autodist`` it is the search's own account: how long it searched and whether exactly, the unit
size and the pipeline stages it chose against the others it tried, the predicted step time and
memory per device, the ops that cost most in compute and in communication, and, for the heaviest
layers, the choice against the runner-up. For the other policies it says what was split and what
crosses between devices. The table holds one row per op (autodist: the choice, its time, its
communication, the runner-up and the margin); the view shows its costliest rows.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any, Optional

import ipywidgets as widgets
import pandas as pd

from nbscaler.widgets.base import Measured, View

if TYPE_CHECKING:
    from nbscaler.planning import Plan

#: Rows of the table drawn: the costliest ops (autodist) or the heaviest (the other policies).
ROWS = 15


class ExplanationView(View):
    """``plan.explain()`` as a panel: the text, then its table's costliest rows.

    >>> ExplanationView(nbscaler.plan(model, args, "autodist", cfg))     # doctest: +SKIP
    """

    def __init__(self, plan: "Plan", *, measured: Optional[Measured] = None, rows: int = ROWS, **options: Any):
        super().__init__(plan, measured=measured, **options)
        self.rows = rows
        self.widget = widgets.HTML(layout=widgets.Layout(width="100%", max_height="520px", overflow="auto"))
        self.widget.add_class("nbscaler-explanation")
        self._redraw()

    @property
    def text(self) -> str:
        """The explanation's words, as ``print(plan.explain())`` gives them."""
        return str(self.plan.explain())

    @property
    def table(self) -> pd.DataFrame:
        """The rows drawn: the costliest ops first when the policy costed each choice."""
        table = self.plan.explain().table
        if {"op_s", "comm_s"} <= set(table.columns):
            table = table.assign(cost_s=table.op_s + table.comm_s).sort_values("cost_s", ascending=False)
            table = table.drop(columns="cost_s")
        return table.head(self.rows).reset_index(drop=True)

    def _redraw(self) -> None:
        self.widget.value = self.to_html()

    def to_html(self) -> str:
        text = html.escape(self.text)
        table = self.table.to_html(classes="nbscaler-explanation-table", index=False, float_format=lambda v: f"{v:.3g}",
                                   na_rep="")
        return (f"<pre style='font-size:12px;line-height:1.35;margin:0;white-space:pre-wrap'>{text}</pre>"
                f"<div style='margin-top:6px;font-size:12px'>{table}</div>")
