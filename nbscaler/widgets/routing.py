"""RoutingView: how a real routing loaded the experts, per training step (a ``RoutingLog`` drawn).

A plan prices a dropless step's exchanges and activations for routing that gives every expert as
many (token, expert) pairs; a real router does not. The view draws what ``nbscaler.experts.RoutingLog``
recorded, per training step (``RoutingLog.next_step``):

- **pairs per rank**: the pairs routed to the experts each rank holds (``expert_rules.held_experts``
  of the plan's first routed-experts op, or ``expert_range`` for ``expert_parallel=n``), with the
  balanced share as a dashed line: under expert parallelism the busiest rank sets the step's pace;
- **pairs per expert**: each expert's pairs, coloured by the rank that holds it; under capacity
  routing the dropped ones on top, in grey.

A step's calls (one per routed-experts op and forward) are summed in its bars. Its **busiest over
mean** sums, over its calls, the busiest expert's (or rank's) pairs, over the same sum of the mean:
the experts' time of the step, each call waiting for its busiest, against a balanced routing's
(1.0: balanced). ``per_step`` holds these numbers; the saved HTML is SVG and a table, no script.

>>> with RoutingLog() as log:            # doctest: +SKIP
...     for batch in batches:
...         model(**batch).backward(); log.next_step()
>>> RoutingView(log, plan)               # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import pandas as pd

from nbscaler.ir.expert_rules import EXPERT_OPS, expert_parallel as is_expert_parallel, expert_range, held_experts
from nbscaler.widgets.formats import ascii_html
from nbscaler.widgets.palette import CAPACITY_COLOUR, OTHER_COLOUR, rank_colour
from nbscaler.widgets.svgchart import Bar, BarGroup, Limit, Segment, stacked_bars_svg

if TYPE_CHECKING:
    from nbscaler.experts import RoutingLog
    from nbscaler.planning import Plan

STEP_COLUMNS = ["step", "pairs", "busiest_expert", "expert_imbalance", "busiest_rank", "rank_imbalance"]
"""The columns of ``RoutingView.per_step``."""
DROPPED = "dropped (capacity)"
PAIRS_AXIS = "pairs (token, expert) routed"

Holders = List[Tuple[str, range]]


def holders(experts: int, plan: Optional["Plan"] = None, expert_parallel: Optional[int] = None) -> Holders:
    """(rank label, the experts it holds) of each rank: from the plan's first routed-experts op, or
    split over ``expert_parallel`` ranks, or one group of every rank holding every expert."""
    nodes = [n for n in plan.graph.nodes if n.target in EXPERT_OPS] if plan is not None else []
    if nodes and is_expert_parallel(nodes[0]):
        name = "rank" if plan.config.units == 1 else "device"
        return [(f"{name} {d}", held_experts(nodes[0], d)) for d in nodes[0].placement.devices]
    if expert_parallel and not nodes:
        return [(f"rank {i}", expert_range(experts, expert_parallel, i)) for i in range(expert_parallel)]
    return [("every rank", range(experts))]


def busiest_over_mean(calls: pd.DataFrame, key: str) -> Tuple[Any, float]:
    """Of one step's rows (``call``, ``key``, ``routed``): the ``key`` routed the most pairs in all,
    and the sum over calls of the busiest's pairs over the sum of the mean (module docstring)."""
    per_call = calls.groupby(["call", key]).routed.sum()
    busiest = per_call.groupby(level="call").max().sum()
    mean = per_call.groupby(level="call").mean().sum()
    return calls.groupby(key).routed.sum().idxmax(), float(busiest / mean) if mean else 1.0


class RoutingView:
    """A ``RoutingLog`` per training step: pairs per rank and per expert, and the busiest over the mean.

    >>> view = RoutingView(log, plan)     # doctest: +SKIP
    >>> view.per_step                     # step, pairs, busiest expert and rank, their imbalance  # doctest: +SKIP
    """

    def __init__(self, log: "RoutingLog", plan: Optional["Plan"] = None, *,
                 expert_parallel: Optional[int] = None) -> None:
        frame = log.frame()
        if frame.empty:
            raise ValueError("the RoutingLog recorded no call: open it around the model's forwards "
                             "(with RoutingLog() as log: ...), on this process.")
        self.plan = plan
        self.holders = holders(int(frame.expert.max()) + 1, plan, expert_parallel)
        holder_of = {e: i for i, (_, held) in enumerate(self.holders) for e in held}
        labels = [label for label, _ in self.holders]
        holder = frame.expert.map(holder_of)
        self.calls = frame.assign(holder=holder, rank=holder.map(labels.__getitem__))
        sums = ["routed", "served", "dropped"]
        self.per_expert = self.calls.groupby(["step", "expert", "holder", "rank"], as_index=False)[sums].sum()
        self.per_rank = self.calls.groupby(["step", "holder", "rank"], as_index=False)[sums].sum()
        self.per_step = pd.DataFrame([self._step_row(step, rows) for step, rows in self.calls.groupby("step")],
                                     columns=STEP_COLUMNS)

    def _step_row(self, step: int, rows: pd.DataFrame) -> dict:
        expert, expert_x = busiest_over_mean(rows, "expert")
        rank, rank_x = busiest_over_mean(rows, "rank")
        return {"step": step, "pairs": int(rows.routed.sum()), "busiest_expert": int(expert),
                "expert_imbalance": expert_x, "busiest_rank": rank, "rank_imbalance": rank_x}

    # -- rendering --------------------------------------------------------------------------------
    def _balanced(self, nbars: int) -> Optional[Limit]:
        """The balanced share of a step's pairs over ``nbars`` bars: a line where every step routed
        as many pairs (else none)."""
        pairs = set(self.per_step.pairs)
        if len(pairs) != 1:
            return None
        share = pairs.pop() / nbars
        return Limit(share, f"balanced: {share:g} pairs each", CAPACITY_COLOUR)

    def _bars(self, rows: pd.DataFrame, by_expert: bool) -> List[BarGroup]:
        """A group per step of ``rows`` (``per_rank`` or ``per_expert``), a bar per rank or expert:
        its served pairs in its rank's colour, the dropped ones on top in grey."""
        imbalance = self.per_step.set_index("step")["expert_imbalance" if by_expert else "rank_imbalance"]
        groups = []
        for step, in_step in rows.groupby("step"):
            bars = []
            for r in in_step.itertuples(index=False):
                name = f"expert {r.expert} ({r.rank})" if by_expert else r.rank
                segments = [Segment(float(r.served), rank_colour(r.holder),
                                    f"step {step}, {name}: {r.routed} pairs routed, {r.served} served")]
                if r.dropped:
                    segments.append(Segment(float(r.dropped), OTHER_COLOUR,
                                            f"step {step}, {name}: {r.dropped} dropped"))
                bars.append(Bar(f"e{r.expert}" if by_expert else r.rank, segments))
            groups.append(BarGroup(f"step {step}: {imbalance[step]:.2f}x", bars))
        return groups

    def svg(self) -> str:
        """Two charts: pairs per rank, then per expert, a group of bars per step, each group named
        with its busiest over mean."""
        legend = [(f"{label}: experts {held[0]}..{held[-1]}", rank_colour(i)) for i, (label, held) in
                  enumerate(self.holders)]
        if self.per_expert.dropped.any():
            legend.append((DROPPED, OTHER_COLOUR))
        ranks = stacked_bars_svg("Pairs per rank, per step (busiest over mean under each step)",
                                 self._bars(self.per_rank, by_expert=False), legend, PAIRS_AXIS,
                                 limit=self._balanced(len(self.holders)))
        experts = stacked_bars_svg("Pairs per expert, per step (busiest over mean under each step)",
                                   self._bars(self.per_expert, by_expert=True), legend, PAIRS_AXIS,
                                   limit=self._balanced(self.per_expert.expert.nunique()))
        return ranks + experts

    def table_html(self) -> str:
        """``per_step`` as a small table: readable where the charts are not."""
        shown = self.per_step.assign(expert_imbalance=self.per_step.expert_imbalance.map("{:.2f}x".format),
                                     rank_imbalance=self.per_step.rank_imbalance.map("{:.2f}x".format))
        head = "".join(f"<th>{ascii_html(c)}</th>" for c in shown.columns)
        body = "".join("<tr>" + "".join(f"<td>{ascii_html(v)}</td>" for v in row) + "</tr>"
                       for row in shown.itertuples(index=False))
        return (f"<table class='nbs-routing-steps' style='border-collapse:collapse;font-size:13px'>"
                f"<tr>{head}</tr>{body}</table>")

    def notebook_html(self) -> str:
        """What a notebook shows and saves: the charts and the table, no script."""
        return f"<div class='nbs-view nbs-routing nbs-static'>{self.svg()}{self.table_html()}</div>"

    to_html = notebook_html

    def _repr_html_(self) -> str:
        return self.notebook_html()

    def __repr__(self) -> str:
        return f"RoutingView({len(self.per_step)} step(s), {len(self.holders)} rank group(s))"
