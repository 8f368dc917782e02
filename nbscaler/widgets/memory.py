"""MemoryView: per-rank memory by kind, predicted beside measured, with the gap in percent.

The predicted bars are ``plan.memory(optimizer)``'s numbers, unchanged: parameters, gradients,
optimizer state, buffers and saved activations (``nbscaler.columns.MEMORY_CATEGORIES``). Measured
memory is a frame with the same columns, one row per rank (``nbscaler.runtime.memory.MemoryMeter``,
or the cluster's ``TrainResult.memory``, which has fewer of them: a kind it lacks is drawn as
missing, not as zero, and the gap is taken over the kinds both sides have).

On a target (``hardware=``, ``nbscaler.Hardware``) the chart adds the GPU's capacity as a dashed line,
edges in red each predicted bar that does not fit (``Hardware.fits``, the test the summary's ``fits``
column makes) and says in a line how many ranks fit and by how much the largest exceeds.

A model with routed experts has the experts' part of the predicted parameters, gradients and
optimizer state drawn at the bottom of each, in a darker shade (``nbscaler.cost.expert_memory``):
under expert parallelism each rank's share of the experts alone.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any, List, Optional, Set, Tuple

import pandas as pd
import plotly.graph_objects as go

from nbscaler.columns import MEMORY_CATEGORIES, SummaryColumn as C
from nbscaler.cost.hardware import Hardware
from nbscaler.recipe import UNSET, Recipe
from nbscaler.widgets.base import Measured
from nbscaler.widgets.formats import BINARY_BYTES, binary_unit, fmt_bytes
from nbscaler.cost.expert_memory import expert_memory_per_rank
from nbscaler.widgets.palette import (CAPACITY_COLOUR, EXPERT_MEMORY_COLOURS as EXPERT_COLOURS,
                                      EXPERT_MEMORY_LABELS as EXPERT_LABELS, MEMORY_COLOURS as COLOURS,
                                      MEMORY_LABELS as LABELS, OVER_CAPACITY_COLOUR)
from nbscaler.widgets.plotting import ChartView
from nbscaler.widgets.svgchart import Bar, BarGroup, Limit, Segment, nice_ticks, stacked_bars_svg

if TYPE_CHECKING:
    from nbscaler.planning import Plan
    from nbscaler.planning.fingerprint import Fingerprint

PREDICTED, MEASURED = "predicted", "measured"
EXPERT_NOTE = ("Routed experts: the darker part of the parameters, gradients and optimizer state is the experts' "
               "weights each rank holds (nbscaler.cost.expert_memory); a dropless step's activations are predicted "
               "for routing that loads every expert alike (nbscaler.experts.RoutingLog measures a real one).")
MEMORY_AXIS = f"memory per rank ({BINARY_BYTES})"


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


def over_capacity(predicted: pd.DataFrame, hardware: Optional[Hardware]) -> Set[int]:
    """The ranks whose predicted peak does not fit in one of ``hardware``'s GPUs (none without one)."""
    if hardware is None:
        return set()
    fits = hardware.fits(predicted[str(C.PEAK_BYTES)])
    return {int(r) for r, ok in zip(predicted[str(C.RANK)], fits) if not ok}


def capacity_line(hardware: Hardware) -> str:
    return f"{hardware.name} capacity {fmt_bytes(hardware.memory_bytes)}"


def capacity_note(predicted: pd.DataFrame, hardware: Hardware) -> str:
    """One line: how many ranks fit in ``hardware``'s memory, and the largest rank against it."""
    peak, cap = predicted[str(C.PEAK_BYTES)], hardware.memory_bytes
    largest = predicted.loc[peak.idxmax()]
    rank, most = int(largest[str(C.RANK)]), float(largest[str(C.PEAK_BYTES)])
    nfit = len(predicted) - len(over_capacity(predicted, hardware))
    head = f"{nfit} of {len(predicted)} ranks fit in {fmt_bytes(cap)} ({hardware.name})"
    if hardware.fits(most):
        return f"{head}; the largest, rank {rank}, uses {fmt_bytes(most)} ({most / cap:.0%} of it)."
    return f"{head}; the largest, rank {rank}, exceeds it by {fmt_bytes(most - cap)} ({most / cap - 1:+.0%})."


Stack = List[Tuple[str, str, str, pd.Series]]
"""The segments of one side's bars, bottom up: (key, legend name, colour, bytes per row)."""


def stacked_kinds(frame: pd.DataFrame, experts: Optional[pd.DataFrame] = None) -> Stack:
    """Each memory category ``frame`` has, bottom up; where ``experts`` (``cost.expert_memory``'s
    rows) gives a category an experts' part, that part first, in a darker shade, and the category's
    own segment the rest, so the bar's total is unchanged."""
    out: Stack = []
    for kind in map(str, MEMORY_CATEGORIES):
        if kind not in frame.columns:
            continue
        values = frame[kind]
        if experts is not None and kind in experts.columns:
            part = experts.set_index(str(C.RANK))[kind].reindex(frame[str(C.RANK)]).fillna(0).to_numpy()
            out.append((f"{kind}:experts", EXPERT_LABELS[kind], EXPERT_COLOURS[kind],
                        pd.Series(part, index=frame.index)))
            values = values - part
        out.append((kind, LABELS[kind], COLOURS[kind], values))
    return out


def memory_figure(predicted: pd.DataFrame, measured: Optional[pd.DataFrame], title: str,
                  hardware: Optional[Hardware] = None, experts: Optional[pd.DataFrame] = None) -> go.Figure:
    """Stacked bars per rank: one bar of each kind for the prediction (``experts``: the experts' part of
    a kind beneath the rest, ``stacked_kinds``), one beside it measured; on ``hardware``, its capacity
    as a dashed line and the predicted bars over it edged and marked red."""
    fig = go.Figure()
    over = over_capacity(predicted, hardware)
    for side, frame in memory_sides(predicted, measured):
        x = bar_positions(frame[str(C.RANK)], side, paired=measured is not None)
        alert = [side == PREDICTED and int(r) in over for r in frame[str(C.RANK)]]
        for key, name, colour, values in stacked_kinds(frame, experts if side == PREDICTED else None):
            fig.add_trace(go.Bar(
                x=x, y=values, name=name, legendgroup=key, showlegend=side == PREDICTED and not over,
                marker=dict(color=colour, pattern_shape="/" if side == MEASURED else "",
                            line=dict(color=[OVER_CAPACITY_COLOUR if a else "white" for a in alert],
                                      width=[3 if a else 0 for a in alert])),
                customdata=[fmt_bytes(v) for v in values],
                hovertemplate=f"{name} ({side}): %{{customdata}}<extra></extra>"))
    if over:       # a legend swatch takes its trace's first edge, which may be red: these bars of zero have none
        first = bar_positions(predicted[str(C.RANK)].iloc[:1], PREDICTED, paired=measured is not None)
        for key, name, colour, _ in stacked_kinds(predicted, experts):
            fig.add_trace(go.Bar(x=first, y=[0], name=name, legendgroup=key, hoverinfo="skip",
                                 marker=dict(color=colour, line=dict(width=0))))
    if hardware is not None:
        add_capacity(fig, predicted, hardware, over, paired=measured is not None)
    fig.update_layout(barmode="stack", title=title, yaxis=bytes_axis(predicted, measured, hardware), height=420,
                      template="plotly_white",
                      margin=dict(l=60, r=20, t=60, b=60), legend=dict(orientation="h", y=-0.2))
    return fig


def bytes_axis(predicted: pd.DataFrame, measured: Optional[pd.DataFrame], hardware: Optional[Hardware]) -> dict:
    """The figure's y axis in binary units, as the SVG's, the capacity line's label and the space
    tab write bytes (``fmt_bytes``): ticks at round numbers of KiB, MiB or GiB up to the tallest bar
    or the capacity (plotly's own ``.3s`` would write SI gigabytes beside a capacity in GiB)."""
    totals = [frame[[k for k in map(str, MEMORY_CATEGORIES) if k in frame.columns]].sum(axis=1).max()
              for _, frame in memory_sides(predicted, measured)]
    tallest = max(totals + [hardware.memory_bytes if hardware is not None else 0.0])
    unit = binary_unit(tallest)
    ticks = [t * unit for t in nice_ticks(0.0, (tallest or 1.0) / unit)]
    return dict(title=MEMORY_AXIS, tickvals=ticks, ticktext=[fmt_bytes(t) for t in ticks],
                range=[0.0, ticks[-1] * 1.02])


def bar_positions(ranks, side: str, paired: bool):
    """Where a side's bars stand on the x axis: ``rank r`` alone, or, beside measured bars
    (``paired``), ``rank r`` with the side under it (plotly's two-level categories). A side's label
    under every bar of a prediction alone only crowded the axis (sixteen ranks in a pane)."""
    labels = [f"rank {r}" for r in ranks]
    return [labels, [side] * len(labels)] if paired else labels


def add_capacity(fig: go.Figure, predicted: pd.DataFrame, hardware: Hardware, over: Set[int],
                 paired: bool = False) -> None:
    """The capacity line, a red cross over each predicted bar that does not fit, and the note
    (``paired``: the bars stand beside measured ones, ``bar_positions``)."""
    fig.add_hline(y=hardware.memory_bytes, line=dict(color=CAPACITY_COLOUR, dash="dash", width=2),
                  annotation_text=capacity_line(hardware), annotation_position="top right")
    rows = predicted[predicted[str(C.RANK)].isin(over)]
    fig.add_trace(go.Scatter(
        x=bar_positions(rows[str(C.RANK)], PREDICTED, paired), y=rows[str(C.PEAK_BYTES)],
        mode="markers", name="does not fit", marker=dict(symbol="x", size=12, color=OVER_CAPACITY_COLOUR),
        customdata=[fmt_bytes(v - hardware.memory_bytes) for v in rows[str(C.PEAK_BYTES)]],
        hovertemplate="over capacity by %{customdata}<extra></extra>"))
    fig.add_annotation(text=capacity_note(predicted, hardware), xref="paper", yref="paper", x=0, y=1.02,
                       xanchor="left", yanchor="bottom", showarrow=False,
                       font=dict(size=12, color=OVER_CAPACITY_COLOUR if over else CAPACITY_COLOUR))


def memory_svg(predicted: pd.DataFrame, measured: Optional[pd.DataFrame], title: str,
               hardware: Optional[Hardware] = None, experts: Optional[pd.DataFrame] = None) -> str:
    """The figure's bars as SVG: per rank a stacked bar predicted (``experts``: as ``memory_figure``)
    and, beside it, one measured (dashed edge); a kind the measurement lacks is left out of its bar,
    not drawn as zero. On ``hardware``, the capacity line, a red edge on each predicted bar over it,
    and the note."""
    over = over_capacity(predicted, hardware)
    groups = []
    for rank in predicted[str(C.RANK)]:
        bars = []
        for side, frame in memory_sides(predicted, measured):
            rows = frame[frame[str(C.RANK)] == rank]
            if not len(rows):
                continue
            stack = stacked_kinds(rows, experts if side == PREDICTED else None)
            segments = [Segment(float(v), colour, f"rank {rank}, {name} ({side}): {fmt_bytes(v)}")
                        for _, name, colour, values in stack for v in values.iloc[:1] if pd.notna(v)]
            alert = OVER_CAPACITY_COLOUR if side == PREDICTED and int(rank) in over else None
            bars.append(Bar(side, segments, outlined=side == MEASURED, alert=alert))
        groups.append(BarGroup(f"rank {rank}", bars))
    legend = [(name, colour) for _, name, colour, _ in stacked_kinds(predicted, experts)]
    limit, note = None, ""
    if hardware is not None:
        limit = Limit(hardware.memory_bytes, capacity_line(hardware), CAPACITY_COLOUR)
        legend += [("does not fit (red edge)", OVER_CAPACITY_COLOUR)] if over else []
        note = capacity_note(predicted, hardware)
    tallest = max([bar.total for g in groups for bar in g.bars] + [limit.value if limit else 0.0])
    return stacked_bars_svg(title, groups, legend, MEMORY_AXIS, fmt_bytes, binary_unit(tallest), limit=limit, note=note)


class MemoryView(ChartView):
    """Per-rank memory, predicted by the cost model and, after a run, measured.

    >>> view = MemoryView(plan, optimizer=torch.optim.AdamW)          # doctest: +SKIP
    >>> MemoryView(plan, hardware=nbscaler.Hardware.named("T4"))      # doctest: +SKIP
    >>> view.update(measured=Measured(memory=meter_rows))              # doctest: +SKIP
    >>> view.gap                                                       # doctest: +SKIP
    """

    css_class = "nbs-memory"

    def __init__(self, plan: "Plan", measured: Optional[Measured] = None, *,
                 recipe: Optional[Recipe] = None, optimizer: Any = UNSET, hardware: Optional[Hardware] = None,
                 master_dtype: Any = UNSET, **optimizer_kwargs: Any) -> None:
        super().__init__(plan, measured=measured)
        # the training recipe the prediction assumes (``plan.memory``'s; the other keywords are its shorthands)
        self.recipe = plan.recipe_of(recipe, optimizer=optimizer, master_dtype=master_dtype,
                                     optimizer_kwargs=optimizer_kwargs)
        self.hardware = hardware
        self._redraw()

    # -- state --------------------------------------------------------------------------------
    def _redraw(self) -> None:
        self.predicted = self.plan.memory(recipe=self.recipe)
        experts = expert_memory_per_rank(self.plan.graph, self.predicted, self.plan.programs.weights,
                                         self.plan.config.device_of)
        self.experts = experts if experts.drop(columns=str(C.RANK)).to_numpy().any() else None
        measured = self.measured.memory
        self.gap = memory_gap(self.predicted, measured) if measured is not None else None
        self.over_capacity = over_capacity(self.predicted, self.hardware)
        self.figure = memory_figure(self.predicted, measured, self._title(), self.hardware, self.experts)
        self.gap_table = self._gap_table()
        self._shown()

    def _title(self) -> str:
        opt = getattr(self.recipe.optimizer, "__name__", "optimizer")
        target = f" on {self.hardware.name}" if self.hardware is not None else ""
        return f"Memory per rank: {self.plan.policy_name}, {opt}{target}" + (
            "" if self.measured.memory is None else " (predicted | measured)")

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
        note = (f"<p class='nbs-memory-experts' style='font-size:11px;color:#555'>{html.escape(EXPERT_NOTE)}</p>"
                if self.experts is not None else "")
        return (f"<table class='nbs-memory-gap' style='border-collapse:collapse;font-size:13px'>"
                f"{head}{''.join(rows)}</table>{note}")

    def fingerprint(self) -> Optional["Fingerprint"]:
        """The predicted memory with this view's optimizer."""
        from nbscaler.planning.fingerprint import of_frames
        return of_frames(self.predicted)

    # -- rendering --------------------------------------------------------------------------------
    def svg(self) -> str:
        return memory_svg(self.predicted, self.measured.memory, self._title(), self.hardware, self.experts)

    def table_html(self) -> str:
        return self.gap_table
