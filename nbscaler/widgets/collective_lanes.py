"""The collectives lanes of a timeline: one lane per rank of the collectives it runs beside its
blocks (``schedule.Timeline.collectives``), drawn in the plotly figure and in the saved SVG alike,
each coloured and named by ``palette`` and hinted with what it is and who waits for it.

A collective of context or expert parallelism is named by its label alone, which says what it is
(``'ring step 1/3 of blocks.0.attn: ...'``, ``'blocks.0.moe: rows out to their experts'``); another
by its kind and its unit (``'all-gather of unit 2'``).
"""

from __future__ import annotations

from typing import Dict, List

import pandas as pd
import plotly.graph_objects as go

from nbscaler.cost.expert_calls import EXPERT_COLLECTIVES
from nbscaler.widgets.palette import COLLECTIVE_COLOURS, COLLECTIVE_NAMES, OTHER_COLOUR, PHASE_NAMES
from nbscaler.widgets.svgchart import Block

COLLECTIVE_COLUMNS = ["rank", "stage", "micro", "phase", "kind", "unit", "t_start", "t_end", "waited_s", "sync",
                      "context"]
"""The columns of a timeline's collectives (``schedule.CollectiveBlock``)."""


def collective_labels(frame: pd.DataFrame) -> Dict[int, str]:
    """The y-axis label of each rank's collectives lane."""
    return {int(r): f"rank {int(r)} · collectives" for r in sorted(set(frame["rank"]))}


def is_expert(kind: str) -> bool:
    """Whether a collective of kind ``kind`` is an expert-parallel op's all-to-all (``cost.expert_calls``)."""
    return kind in {str(c) for c in EXPERT_COLLECTIVES}


def waiter(sync: bool) -> str:
    """Who waits for a collective: the step for a bucket of the gradient synchronisation (after
    the blocks), the compute for ZeRO stage 3's (inside them)."""
    return "the step" if sync else "the compute"


def collective_hint(panel: str, lane: str, kind: str, unit: str, micro: int, phase: str, start_ms: float,
                    end_ms: float, waited_ms: float, sync: bool = False, context: bool = False) -> str:
    """What hovering a collective of the SVG says (the figure's hover text says the same). A
    context-parallel attention's (``context``) or an expert-parallel op's is named by its label alone,
    which says what it is."""
    what = unit if context or is_expert(kind) else f"{COLLECTIVE_NAMES.get(kind, kind)} of {unit}"
    wait = ("while the attention computes" if context and not waited_ms
            else f"{waiter(sync)} waits {waited_ms:.3f} ms for it")
    return (f"{panel} {lane}: {what} in the {PHASE_NAMES.get(phase, phase)} of micro-batch {micro}, "
            f"{start_ms:.3f} -> {end_ms:.3f} ms, {wait}")


def add_collectives(fig: go.Figure, frame: pd.DataFrame, labels: Dict[int, str], row: int, panel: str) -> None:
    """One horizontal bar per collective on its rank's collectives lane, labelled with its unit, a
    trace per kind."""
    for kind, calls in frame.groupby("kind", sort=False):
        fig.add_trace(go.Bar(
            orientation="h", base=calls.t_start * 1e3, x=(calls.t_end - calls.t_start) * 1e3,
            y=[labels[int(r)] for r in calls["rank"]], name=COLLECTIVE_NAMES.get(kind, str(kind)),
            legendgroup=str(kind), showlegend=row == 1,
            marker=dict(color=COLLECTIVE_COLOURS.get(kind, OTHER_COLOUR), line=dict(color="white", width=1)),
            text=list(calls.unit), textposition="inside", insidetextanchor="middle",
            customdata=[(h,) for h in (collective_hint(panel, labels[int(c.rank)], c.kind, c.unit, int(c.micro), c.phase,
                                                       c.t_start * 1e3, c.t_end * 1e3, c.waited_s * 1e3, bool(c.sync),
                                                       bool(c.context))
                                       for c in calls.itertuples(index=False))],
            hovertemplate="%{customdata[0]}<extra></extra>"),
            row=row, col=1)


def collective_lanes(frame: pd.DataFrame, labels: Dict[int, str], panel: str) -> Dict[str, List[Block]]:
    """The SVG's collectives lanes of one panel, its blocks in ms, each labelled with its unit."""
    lanes: Dict[str, List[Block]] = {labels[r]: [] for r in sorted(labels)}
    for c in frame.itertuples(index=False):
        lane, start, end = labels[int(c.rank)], c.t_start * 1e3, c.t_end * 1e3
        lanes[lane].append(Block(start, end, COLLECTIVE_COLOURS.get(c.kind, OTHER_COLOUR), c.unit,
                                 collective_hint(panel, lane, c.kind, c.unit, int(c.micro), c.phase, start, end,
                                                 c.waited_s * 1e3, bool(c.sync), bool(c.context))))
    return lanes
