"""The live loss curve: one line per rank, drawn while the cluster trains.

The ranks report ``{'done': steps, 'loss': latest}`` about every 50 ms; ``on_report`` appends each
new step to its rank's line. Steps that finish between two reports are filled in by ``finish`` from
the full telemetry once training is over.

The figure is a plain plotly ``Figure`` shown in an ``Output`` widget (plotly's own mime renderer)
and shown again when it changes, at most every ``REDRAW_S`` seconds: several ``FigureWidget``s
that render at the same moment can come up empty in JupyterLab, and the Explorer shows three.
``svg()`` draws the same lines, in the same colours, for a notebook read without scripts.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List

import ipywidgets as w
import pandas as pd
import plotly.graph_objects as go

from nbscaler.widgets.palette import rank_colour
from nbscaler.widgets.plotting import show_figure
from nbscaler.widgets.svgchart import Series, lines_svg

REDRAW_S = 0.3


class LossCurve:
    """Loss by step, one line per rank; ``figure`` is the data, ``widget`` shows it."""

    def __init__(self) -> None:
        self.figure = go.Figure(layout=go.Layout(
            title="loss per rank (train on the cluster to see it)", height=300, width=520,
            margin=dict(l=50, r=20, t=40, b=40), xaxis_title="step", yaxis_title="loss", template="plotly_white"))
        self.widget = w.Output(layout=w.Layout(min_width="520px"))
        self.widget.add_class("nbscaler-losses")
        self._seen: List[int] = []
        self._drawn_at = 0.0
        self._draw()

    def start(self, nranks: int, title: str) -> None:
        """Empty lines for ``nranks`` ranks, ready for reports."""
        self._seen = [0] * nranks
        self.figure.data = []
        for rank in range(nranks):
            self.figure.add_scatter(x=[], y=[], mode="lines+markers", name=f"rank {rank}",
                                    line=dict(color=rank_colour(rank)))
        self.figure.layout.title = title
        self._draw()

    def on_report(self, reports: List[Dict[str, Any]]) -> None:
        """Append the steps each rank finished since the last report."""
        changed = False
        for rank, report in enumerate(reports):
            done = report.get("done", 0)
            if rank < len(self._seen) and done > self._seen[rank] and "loss" in report:
                trace = self.figure.data[rank]
                trace.x = tuple(trace.x or ()) + (done - 1,)
                trace.y = tuple(trace.y or ()) + (report["loss"],)
                self._seen[rank] = done
                changed = True
        if changed and time.monotonic() - self._drawn_at > REDRAW_S:
            self._draw()

    def finish(self, steps: pd.DataFrame, title: str) -> None:
        """Redraw from the run's full telemetry (``rank, step, loss`` rows)."""
        for rank, rows in steps.groupby("rank"):
            if rank < len(self.figure.data):
                self.figure.data[rank].x = rows["step"].tolist()
                self.figure.data[rank].y = rows["loss"].tolist()
        self.figure.layout.title = title
        self._draw()

    def svg(self) -> str:
        """The figure's lines as SVG (``nbscaler.widgets.svgchart``)."""
        series = [Series(trace.name, rank_colour(rank), list(zip(trace.x or (), trace.y or ())))
                  for rank, trace in enumerate(self.figure.data)]
        return lines_svg(self.figure.layout.title.text or "loss per rank", series, "step", "loss")

    def _draw(self) -> None:
        self._drawn_at = time.monotonic()
        show_figure(self.widget, self.figure)    # plotly's MIME type: never plotly.js itself
