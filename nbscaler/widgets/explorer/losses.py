"""The live loss curve: one line per rank, drawn while the cluster trains.

The ranks report ``{'done': steps, 'loss': latest}`` about every 50 ms; ``on_report`` appends each
new step to its rank's line. Steps that finish between two reports are filled in by ``finish`` from
the full telemetry once training is over.
"""

from __future__ import annotations

from typing import Any, Dict, List

import ipywidgets as w
import pandas as pd
import plotly.graph_objects as go


class LossCurve:
    """A plotly ``FigureWidget`` of loss by step, one line per rank (``widget`` is its box)."""

    def __init__(self) -> None:
        self.figure = go.FigureWidget(layout=go.Layout(
            title="loss per rank (train on the cluster to see it)", height=300, margin=dict(l=50, r=20, t=40, b=40),
            xaxis_title="step", yaxis_title="loss", template="plotly_white"))
        self.widget = w.VBox([self.figure])
        self.widget.add_class("nbscaler-losses")
        self._seen: List[int] = []

    def start(self, nranks: int, title: str) -> None:
        """Empty lines for ``nranks`` ranks, ready for reports."""
        self._seen = [0] * nranks
        with self.figure.batch_update():
            self.figure.data = []
            for rank in range(nranks):
                self.figure.add_scatter(x=[], y=[], mode="lines+markers", name=f"rank {rank}")
            self.figure.layout.title = title

    def on_report(self, reports: List[Dict[str, Any]]) -> None:
        """Append the steps each rank finished since the last report."""
        for rank, report in enumerate(reports):
            done = report.get("done", 0)
            if rank < len(self._seen) and done > self._seen[rank] and "loss" in report:
                trace = self.figure.data[rank]
                trace.x = tuple(trace.x or ()) + (done - 1,)
                trace.y = tuple(trace.y or ()) + (report["loss"],)
                self._seen[rank] = done

    def finish(self, steps: pd.DataFrame, title: str) -> None:
        """Redraw from the run's full telemetry (``rank, step, loss`` rows)."""
        with self.figure.batch_update():
            for rank, rows in steps.groupby("rank"):
                if rank < len(self.figure.data):
                    self.figure.data[rank].x = rows["step"].tolist()
                    self.figure.data[rank].y = rows["loss"].tolist()
            self.figure.layout.title = title
