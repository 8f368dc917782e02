"""MemoryView: per-rank memory by kind, predicted beside measured, with the gap in percent.

The predicted bars are ``plan.memory(optimizer)``'s numbers, unchanged: parameters, gradients,
optimizer state, buffers and saved activations (``nbscaler.columns.MEMORY_CATEGORIES``). Measured
memory is a frame with the same columns, one row per rank (``nbscaler.runtime.memory.MemoryMeter``,
or the cluster's ``TrainResult.memory``, which has fewer of them: a kind it lacks is drawn as
missing, not as zero, and the gap is taken over the kinds both sides have).
"""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING, Any, List, Optional, Tuple, Type

import pandas as pd
import plotly.graph_objects as go
import torch

from nbscaler.columns import MEMORY_CATEGORIES, SummaryColumn as C
from nbscaler.widgets.base import Measured
from nbscaler.widgets.formats import fmt_bytes
from nbscaler.widgets.palette import MEMORY_COLOURS as COLOURS, MEMORY_LABELS as LABELS
from nbscaler.widgets.plotting import ChartView
from nbscaler.widgets.svgchart import Bar, BarGroup, Segment, stacked_bars_svg

if TYPE_CHECKING:
    from nbscaler.planning import Plan

PREDICTED, MEASURED = "predicted", "measured"


def memory_gap(predicted: pd.DataFrame, measured: pd.DataFrame) -> pd.DataFrame:
    """Per rank: predicted and measured totals over the kinds both frames have, and
    ``gap_pct = 100 * (measured - predicted) / predicted``."""
    kinds = [str(c) for c in MEMORY_CATEGORIES if str(c) in measured.columns]
    rank = str(C.RANK)
    both = predicted[[rank, *kinds]].merge(measured[[rank, *kinds]], on=rank, suffixes=("_p", "_m")).set_index(rank)
    pred = both[[f"{k}_p" for k in kinds]].sum(axis=1)
    meas = both[[f"{k}_m" for k in kinds]].sum(axis=1)
    gap = 100 * (meas - pred) / pred.where(pred != 0)
    return pd.DataFrame({"predicted_bytes": pred, "measured_bytes": meas, "gap_pct": gap,
                         "kinds": ", ".join(LABELS[k] for k in kinds)}).reset_index()


def memory_sides(predicted: pd.DataFrame, measured: Optional[pd.DataFrame]) -> List[Tuple[str, pd.DataFrame]]:
    """(side, frame): the prediction, and the measurement when there is one."""
    return [(PREDICTED, predicted)] + ([(MEASURED, measured)] if measured is not None else [])


def memory_figure(predicted: pd.DataFrame, measured: Optional[pd.DataFrame], title: str) -> go.Figure:
    """Stacked bars per rank: one bar of each kind for the prediction, one beside it measured."""
    fig = go.Figure()
    sides = memory_sides(predicted, measured)
    for kind in MEMORY_CATEGORIES:
        kind = str(kind)
        for side, frame in sides:
            if kind not in frame.columns:
                continue
            x = [[f"rank {r}" for r in frame[str(C.RANK)]], [side] * len(frame)]
            fig.add_trace(go.Bar(
                x=x, y=frame[kind], name=LABELS[kind], legendgroup=kind, showlegend=side == PREDICTED,
                marker=dict(color=COLOURS[kind], pattern_shape="/" if side == MEASURED else ""),
                customdata=[fmt_bytes(v) for v in frame[kind]],
                hovertemplate=f"{LABELS[kind]} ({side}): %{{customdata}}<extra></extra>"))
    fig.update_layout(barmode="stack", title=title, yaxis=dict(title="bytes", tickformat=".3s", ticksuffix="B"), height=420, template="plotly_white",
                      margin=dict(l=60, r=20, t=60, b=60), legend=dict(orientation="h", y=-0.2))
    return fig


def memory_svg(predicted: pd.DataFrame, measured: Optional[pd.DataFrame], title: str) -> str:
    """The figure's bars as SVG: per rank a stacked bar predicted and, beside it, one measured
    (dashed edge); a kind the measurement lacks is left out of its bar, not drawn as zero."""
    groups = []
    for rank in predicted[str(C.RANK)]:
        bars = []
        for side, frame in memory_sides(predicted, measured):
            rows = frame[frame[str(C.RANK)] == rank]
            if not len(rows):
                continue
            row = rows.iloc[0]
            segments = [Segment(float(row[k]), COLOURS[k], f"rank {rank}, {LABELS[k]} ({side}): {fmt_bytes(row[k])}")
                        for k in map(str, MEMORY_CATEGORIES) if k in frame.columns and pd.notna(row[k])]
            bars.append(Bar(side, segments, outlined=side == MEASURED))
        groups.append(BarGroup(f"rank {rank}", bars))
    legend = [(LABELS[str(k)], COLOURS[str(k)]) for k in MEMORY_CATEGORIES]
    tallest = max((bar.total for g in groups for bar in g.bars), default=0.0)
    unit = 1024.0 ** max(0, int(math.log(tallest, 1024))) if tallest >= 1 else 1.0    # ticks round in KiB, MiB, ...
    return stacked_bars_svg(title, groups, legend, "bytes", fmt_bytes, unit)


class MemoryView(ChartView):
    """Per-rank memory, predicted by the cost model and, after a run, measured.

    >>> view = MemoryView(plan, optimizer=torch.optim.AdamW)          # doctest: +SKIP
    >>> view.update(measured=Measured(memory=meter_rows))              # doctest: +SKIP
    >>> view.gap                                                       # doctest: +SKIP
    """

    css_class = "nbs-memory"

    def __init__(self, plan: "Plan", measured: Optional[Measured] = None, *,
                 optimizer: Type[torch.optim.Optimizer] = torch.optim.SGD, **optimizer_kwargs: Any) -> None:
        super().__init__(plan, measured=measured)
        self.optimizer, self.optimizer_kwargs = optimizer, optimizer_kwargs
        self._redraw()

    # -- state --------------------------------------------------------------------------------
    def _redraw(self) -> None:
        self.predicted = self.plan.memory(self.optimizer, **self.optimizer_kwargs)
        measured = self.measured.memory
        self.gap = memory_gap(self.predicted, measured) if measured is not None else None
        self.figure = memory_figure(self.predicted, measured, self._title())
        self.gap_table = self._gap_table()
        self._shown()

    def _title(self) -> str:
        opt = self.optimizer.__name__
        return f"Memory per rank: {self.plan.policy_name}, {opt}" + ("" if self.measured.memory is None
                                                                      else " (predicted | measured)")

    def _gap_table(self) -> str:
        """The totals per rank as a small table: always readable, even where scripts do not run."""
        rows: List[str] = []
        if self.gap is None:
            for _, r in self.predicted.iterrows():
                rows.append(f"<tr><td>{int(r[str(C.RANK)])}</td><td>{fmt_bytes(r[str(C.PEAK_BYTES)])}</td></tr>")
            head = "<tr><th>rank</th><th>predicted peak</th></tr>"
        else:
            for _, r in self.gap.iterrows():
                rows.append(f"<tr><td>{int(r[str(C.RANK)])}</td><td>{fmt_bytes(r.predicted_bytes)}</td>"
                            f"<td>{fmt_bytes(r.measured_bytes)}</td><td>{r.gap_pct:+.1f}%</td></tr>")
            head = "<tr><th>rank</th><th>predicted</th><th>measured</th><th>gap</th></tr>"
            kinds = html.escape(self.gap.kinds.iloc[0]) if len(self.gap) else ""
            rows.append(f"<tr><td colspan=4 style='font-size:smaller'>over: {kinds}</td></tr>")
        return (f"<table class='nbs-memory-gap' style='border-collapse:collapse;font-size:13px'>"
                f"{head}{''.join(rows)}</table>")

    # -- rendering --------------------------------------------------------------------------------
    def svg(self) -> str:
        return memory_svg(self.predicted, self.measured.memory, self._title())

    def table_html(self) -> str:
        return self.gap_table
