"""TimelineView: what each rank does over one training step, predicted and measured, on one time axis.

Rows are ranks, or (rank, stage) pairs for a pipeline; each block is a forward (``F``) or backward
(``B``) of one micro-batch, labelled with its micro-batch. The predicted step is
``plan.timeline()`` (the schedule simulator over the cost model's stage times); the measured one is
a frame of the same rows, ``(rank, stage, micro, phase, t_start, t_end)``, from
``ParallelModule.pipeline_timeline()`` or the cluster's ``TrainResult.schedule``. Both are drawn
from their own first start, so their lengths compare directly; each rank's bubble is the share of
the step it spends idle.

On a target (``hardware=``, ``nbscaler.Hardware``) the prediction is ``plan.timeline(hardware=hw)``
and the title gives that hardware, the step time and MFU of ``plan.summary(hardware=hw)`` and the
bubble; a run measured here is then drawn without a ratio to it (other hardware).

Where ranks run collectives beside their blocks, each rank of the prediction has one more lane,
``rank r · collectives`` (``Timeline.collectives``): under ZeRO stage 3 every all-gather and
reduce-scatter of its units, each labelled with its unit; hovering one says how long the rank's
compute waited for it (``cost.fsdp``: the blocks already last that long). With data-parallel units,
the gradient synchronisation's buckets too (``cost.timing.sync_spans``), each labelled ``bucket i``
(``bucket 0``: the first parameters, whose gradients the backward makes last): all-reduces, or ZeRO's
reduce-scatters and the all-gathers after the optimizer step, hidden in the last backward where the
target overlaps them, after it where it does not; hovering one says how long the step waits for it
(its part of the step's exposed synchronisation). Under context parallelism, each attention's
collectives (``cost.context_calls``) where the attention runs in its forward and backward: a ring's
passes, ``n-1`` forward steps and ``n`` backward, each labelled ``ring step k/n of <module>`` with
whose keys and values it brings; under ``context_parallel_kind='all_gather'`` the all-gathers of the
keys and values and the reduce-scatters of their gradients. Under expert parallelism, each expert op's
all-to-alls (``cost.expert_calls``) where it runs them: the per-expert counts and the rows out to their
experts before its products, the rows back after them, each labelled ``<module>: rows out to their
experts`` and so on (the legend names them by ``nbscaler.glossary.EXPERT_ALL_TO_ALLS``).
"""

from __future__ import annotations

import textwrap
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from nbscaler.columns import SummaryColumn as C
from nbscaler.cost.hardware import Hardware
from nbscaler.recipe import UNSET, Recipe
from nbscaler.widgets.base import Measured
from nbscaler.widgets.collective_lanes import (COLLECTIVE_COLUMNS, add_collectives, collective_labels,
                                               collective_lanes, is_expert)
from nbscaler.widgets.formats import ascii_html, fmt_seconds
from nbscaler.widgets.palette import (COLLECTIVE_COLOURS, COLLECTIVE_NAMES, IDLE_COLOUR, OTHER_COLOUR, PHASE_COLOURS,
                                      PHASE_NAMES)
from nbscaler.widgets.plotting import ChartView
from nbscaler.widgets.svgchart import Block, Panel, lanes_svg

if TYPE_CHECKING:
    from nbscaler.planning import Plan

TIMELINE_COLUMNS = ["rank", "stage", "micro", "phase", "t_start", "t_end"]
TIME_AXIS = "time in the step (ms)"
ZERO3_ASSUMPTION = ("ZeRO stage 3: each unit's all-gathers and reduce-scatters on the link its ZeRO group spans, "
                    "beside the compute as FSDP prefetches them on a target (on this machine nothing overlaps); a "
                    "block lasts its compute and what it waits for them (nbscaler.cost.fsdp, plan.unit_collectives()).")
SYNC_ASSUMPTION = ("Gradient synchronisation: each bucket reduced across the data-parallel units as the step "
                   "prices it (nbscaler.cost.timing.exposed_sync), in the reverse of parameter order; where the "
                   "target overlaps it, the buckets but the first run in the last backward and only what they "
                   "wait after it counts; else all after the backward. ZeRO's all-gathers follow the optimizer "
                   "step, which is not drawn.")
CONTEXT_ASSUMPTION = ("Context parallelism: each ring attention's passes priced as the all-gather that moves their "
                      "bytes (plan.collectives' ring_pass rows), split over its n-1 forward and n backward steps by "
                      "the blocks each carries, from where the attention runs in its block; the ring passes while the "
                      "attention computes, and the blocks add only what that compute does not hide, and the "
                      "backward's last pass, home (nbscaler.cost.context_calls.ring_exposed). "
                      "All-gathered keys and values: the block waits for them.")
EXPERT_ASSUMPTION = ("Expert parallelism: each expert op's all-to-alls (the per-expert counts under dropless "
                     "routing, the rows out to their experts and back; their gradients the other ways) priced as "
                     "plan.collectives' expert_counts and expert_exchange rows, for routing that loads every expert "
                     "alike (or, dropless, the busiest device of Recipe(expert_imbalance=...), for every device); the "
                     "block waits for each, drawn where the op runs it (nbscaler.cost.expert_calls). A real routing's "
                     "imbalance: nbscaler.experts.RoutingLog.")
TITLE_CHARS = 56
"""The longest line of the figure's title: about what a half-width pane shows at plotly's 17 px
title font (the Explorer puts the timeline beside the memory view)."""


def wrapped_title(parts: List[str], width: int = TITLE_CHARS) -> str:
    """The title ``" ".join(parts)`` for plotly, in lines of at most ``width`` characters
    (``<br>`` between them): a line breaks between parts where it can (never inside "H100-SXM-80GB
    x 16"), and a part longer than a line between its words."""
    lines: List[str] = []
    for part in parts:
        if lines and len(lines[-1]) + 1 + len(part) <= width:
            lines[-1] += " " + part
        else:
            lines += textwrap.wrap(part, width, break_on_hyphens=False)
    return "<br>".join(lines)


def normalized(frame: pd.DataFrame) -> pd.DataFrame:
    """One step of a timeline frame, with time from its first start.

    Telemetry of several steps (a ``step`` column) keeps the last one.
    """
    if "step" in frame.columns and len(frame):
        frame = frame[frame.step == frame.step.max()]
    frame = frame[TIMELINE_COLUMNS].copy()
    if len(frame):
        origin = frame.t_start.min()
        frame["t_start"] -= origin
        frame["t_end"] -= origin
    return frame.sort_values(["rank", "stage", "t_start"]).reset_index(drop=True)


def bubble_per_rank(frame: pd.DataFrame, nranks: int) -> pd.Series:
    """Each rank's idle share of the whole step: ``1 - busy(rank) / makespan`` (ranks that ran
    nothing are idle throughout)."""
    makespan = frame.t_end.max() - frame.t_start.min() if len(frame) else 0.0
    busy = (frame.t_end - frame.t_start).groupby(frame["rank"]).sum().reindex(range(nranks), fill_value=0.0)
    return (1 - busy / makespan) if makespan > 0 else busy * 0.0


def row_labels(frame: pd.DataFrame, pipelined: bool) -> Dict[Tuple[int, int], str]:
    """The y-axis label of each (rank, stage) row."""
    pairs = sorted({(int(r), int(s)) for r, s in zip(frame["rank"], frame.stage)})
    return {(r, s): f"rank {r} · stage {s}" if pipelined else f"rank {r}" for r, s in pairs}


def lane_order(labels: Dict[Tuple[int, int], str], collectives: Dict[int, str]) -> List[str]:
    """Every lane's label, top to bottom: each rank's stages, then its collectives."""
    out: List[str] = []
    for rank in sorted({r for r, _ in labels} | set(collectives)):
        out += [labels[k] for k in sorted(labels) if k[0] == rank] + ([collectives[rank]] if rank in collectives else [])
    return out


def add_blocks(fig: go.Figure, frame: pd.DataFrame, labels: Dict[Tuple[int, int], str], row: int,
               panel: str) -> None:
    """One horizontal bar per block, a trace per phase so the legend toggles phases."""
    for phase, blocks in frame.groupby("phase", sort=False):
        ys = [labels[(int(r), int(s))] for r, s in zip(blocks["rank"], blocks.stage)]
        fig.add_trace(go.Bar(
            orientation="h", base=blocks.t_start * 1e3, x=(blocks.t_end - blocks.t_start) * 1e3, y=ys,
            name=PHASE_NAMES.get(phase, str(phase)), legendgroup=str(phase), showlegend=row == 1,
            marker=dict(color=PHASE_COLOURS.get(phase, OTHER_COLOUR), line=dict(color="white", width=1)),
            text=[f"{phase}{m}" for m in blocks.micro], textposition="inside", insidetextanchor="middle",
            customdata=list(zip(blocks.micro, blocks.t_start * 1e3, blocks.t_end * 1e3)),
            hovertemplate=(f"{panel} %{{y}}<br>{PHASE_NAMES.get(phase, phase)} of micro-batch %{{customdata[0]}}"
                           "<br>%{customdata[1]:.3f} → %{customdata[2]:.3f} ms<extra></extra>")),
            row=row, col=1)


def block_hint(panel: str, lane: str, phase: str, micro: int, start_ms: float, end_ms: float) -> str:
    """What hovering a block of the SVG says (the figure's hover text says the same)."""
    return f"{panel} {lane}: {PHASE_NAMES.get(phase, phase)} of micro-batch {micro}, {start_ms:.3f} -> {end_ms:.3f} ms"


def lanes_of(frame: pd.DataFrame, labels: Dict[Tuple[int, int], str], panel: str) -> Dict[str, List[Block]]:
    """The SVG's lanes of one panel: a lane per row label (rank 0 on top), its blocks in ms."""
    lanes: Dict[str, List[Block]] = {labels[key]: [] for key in sorted(labels)}
    for r in frame.itertuples(index=False):
        lane, start, end = labels[(int(r.rank), int(r.stage))], r.t_start * 1e3, r.t_end * 1e3
        lanes[lane].append(Block(start, end, PHASE_COLOURS.get(r.phase, OTHER_COLOUR), f"{r.phase}{r.micro}",
                                 block_hint(panel, lane, r.phase, int(r.micro), start, end)))
    return lanes


class TimelineView(ChartView):
    """The predicted (and, after a run, measured) timeline of one training step.

    >>> TimelineView(plan)                                                      # doctest: +SKIP
    >>> TimelineView(plan, hardware=nbscaler.Hardware.named("H100-SXM-80GB"))  # doctest: +SKIP
    >>> view.update(measured=Measured(timeline=pd.DataFrame(pm.pipeline_timeline().to_rows())))  # doctest: +SKIP
    """

    css_class = "nbs-timeline"

    def __init__(self, plan: "Plan", measured: Optional[Measured] = None, *, hardware: Optional[Hardware] = None,
                 recipe: Optional[Recipe] = None, optimizer: Any = UNSET, master_dtype: Any = UNSET) -> None:
        super().__init__(plan, measured=measured)
        # the training recipe prices the target's step (``plan.summary``'s; the others are its shorthands)
        self.hardware = hardware
        self.recipe = plan.recipe_of(recipe, optimizer=optimizer, master_dtype=master_dtype)
        self._redraw()

    # -- state --------------------------------------------------------------------------------
    def _redraw(self) -> None:
        line = self.plan.timeline(hardware=self.hardware, recipe=self.recipe)
        self.predicted = normalized(pd.DataFrame(line.to_rows(), columns=TIMELINE_COLUMNS))
        calls = pd.DataFrame(line.collective_rows(), columns=COLLECTIVE_COLUMNS)
        origin = min((b.t_start for b in line.blocks), default=0.0)       # as normalized() shifts the blocks
        self.collectives = calls.assign(t_start=calls.t_start - origin, t_end=calls.t_end - origin)
        self.predicted_bubble_total = line.bubble_fraction
        self.target = (self.plan.summary(hardware=self.hardware, recipe=self.recipe)
                       if self.hardware is not None else None)
        measured = self.measured.timeline
        self.measured_frame = normalized(measured) if measured is not None and len(measured) else None
        nranks = self.plan.config.runtime_ngpus
        bubbles = {"predicted": bubble_per_rank(self.predicted, nranks)}
        if self.measured_frame is not None:
            bubbles["measured"] = bubble_per_rank(self.measured_frame, nranks)
        self.bubbles = pd.DataFrame(bubbles).rename_axis("rank").reset_index()
        self.assumptions = (target_assumptions(self.hardware, self.predicted) if self.hardware is not None
                            else assumptions(self.plan, self.predicted))
        context, experts = self.collectives.context.astype(bool), self.collectives.kind.map(is_expert).astype(bool)
        if (~self.collectives.sync.astype(bool) & ~context & ~experts).any():
            self.assumptions += "\n" + ZERO3_ASSUMPTION
        if context.any():
            self.assumptions += "\n" + CONTEXT_ASSUMPTION
        if experts.any():
            self.assumptions += "\n" + EXPERT_ASSUMPTION
        if self.collectives.sync.astype(bool).any():
            self.assumptions += "\n" + SYNC_ASSUMPTION
        self.figure = self._figure()
        self.bubble_table = self._bubble_table()
        self._shown()

    def _frames(self) -> List[Tuple[str, pd.DataFrame]]:
        """(panel name, frame): the prediction, and the measurement when there is one."""
        return [("predicted", self.predicted)] + ([("measured", self.measured_frame)]
                                                  if self.measured_frame is not None else [])

    def _labels(self) -> Dict[Tuple[int, int], str]:
        return row_labels(pd.concat([f for _, f in self._frames()]), self.plan.config.use_pipeline)

    def _panel_titles(self) -> List[str]:
        """Each panel's step time and bubble (the measured one against the prediction)."""
        frames = self._frames()
        spans = {name: f.t_end.max() if len(f) else 0.0 for name, f in frames}
        titles = [f"{name}: step {fmt_seconds(spans[name])}, bubble {self._total_bubble(name, f):.0%}"
                  for name, f in frames]
        if self.hardware is not None:        # the step of the title adds the optimizer and what the blocks hide
            titles[0] = (f"predicted on {self.hardware.name}: forwards and backwards "
                         f"{fmt_seconds(spans['predicted'])}, bubble {self.predicted_bubble_total:.0%}")
        if len(frames) == 2 and spans["predicted"] > 0 and self.hardware is None:
            titles[1] += f" ({spans['measured'] / spans['predicted']:.2g}x the prediction)"
        return titles

    def _title_parts(self) -> List[str]:
        """The title in the parts a line may break between: what is drawn, on a target which
        one, and the step's figures."""
        head = f"Timeline of one training step: {self.plan.policy_name}"
        if self.target is None:
            return [head]
        hw = self.hardware
        return [head, f"on {hw.name} x {hw.ngpus}:",
                f"step {fmt_seconds(self.target[str(C.STEP_TIME_S)].max())}, "
                f"bubble {self.predicted_bubble_total:.0%}, MFU {self.target[str(C.MFU)].mean():.0%}"]

    def _title(self) -> str:
        return " ".join(self._title_parts())

    def _collective_labels(self, name: str) -> Dict[int, str]:
        """The collectives lanes of panel ``name``: the prediction's ranks that run any."""
        return collective_labels(self.collectives) if name == "predicted" else {}

    def _figure(self) -> go.Figure:
        frames, labels, titles = self._frames(), self._labels(), self._panel_titles()
        fig = make_subplots(rows=len(frames), cols=1, shared_xaxes=True, subplot_titles=titles,
                            vertical_spacing=0.12)
        for i, (name, frame) in enumerate(frames, start=1):
            add_blocks(fig, frame, labels, i, name)
            calls = self._collective_labels(name)
            if calls:
                add_collectives(fig, self.collectives, calls, i, name)
            order = lane_order(labels, calls)[::-1]          # plotly lists categories bottom up
            fig.update_yaxes(categoryorder="array", categoryarray=order, row=i, col=1)
        fig.update_xaxes(title_text=TIME_AXIS, row=len(frames), col=1)
        wrapped = "<br>".join(textwrap.fill(line, 130).replace("\n", "<br>") for line in self.assumptions.splitlines())
        # the assumptions sit under the time axis's title, however many lines they wrap to
        bottom = 60 + 14 * (wrapped.count("<br>") + 1)
        title = wrapped_title(self._title_parts())
        top = 62 + 22 * title.count("<br>")             # the legend sits above the title's lines
        lanes = sum(len(labels) + len(self._collective_labels(name)) for name, _ in frames)
        height = top + 40 * len(frames) + 28 * lanes + bottom
        fig.update_layout(barmode="overlay", height=height, template="plotly_white",
                          title=dict(text=title, y=1.0, yref="container", yanchor="top", pad=dict(t=30)),
                          margin=dict(l=130, r=20, t=top + 18, b=bottom),
                          legend=dict(orientation="h", yref="container", y=0.995, x=1, xanchor="right", yanchor="top"))
        fig.add_annotation(text=wrapped, xref="paper", yref="paper", x=0,
                           y=0, yshift=-50, xanchor="left", yanchor="top", showarrow=False, align="left",
                           font=dict(size=10, color="#555"))
        return fig

    def _total_bubble(self, name: str, frame: pd.DataFrame) -> float:
        if name == "predicted":
            return self.predicted_bubble_total
        nranks = self.plan.config.runtime_ngpus
        span = frame.t_end.max() - frame.t_start.min() if len(frame) else 0.0
        return max(0.0, 1 - (frame.t_end - frame.t_start).sum() / (nranks * span)) if span > 0 else 0.0

    def _bubble_table(self) -> str:
        cols = [c for c in ("predicted", "measured") if c in self.bubbles.columns]
        head = "<tr><th>rank</th>" + "".join(f"<th>bubble, {c}</th>" for c in cols) + "</tr>"
        body = "".join("<tr><td>{}</td>{}</tr>".format(int(r["rank"]), "".join(f"<td>{r[c]:.1%}</td>" for c in cols))
                       for _, r in self.bubbles.iterrows())
        return (f"<table class='nbs-bubbles' style='border-collapse:collapse;font-size:13px'>{head}{body}</table>"
                f"<pre style='font-size:11px;color:#555;white-space:pre-wrap'>{ascii_html(self.assumptions)}</pre>")

    # -- rendering --------------------------------------------------------------------------------
    def svg(self) -> str:
        """The same panels as the figure: a lane per rank (and stage), a block per forward or
        backward; the grey a lane shows between its blocks is its bubble. Where ranks run collectives (ZeRO
        stage 3's, the gradient synchronisation's buckets, context parallelism's ring steps) a lane per
        rank of them, each block labelled with its unit, bucket or ring step."""
        labels = self._labels()
        panels = []
        for (name, frame), title in zip(self._frames(), self._panel_titles()):
            calls = self._collective_labels(name)
            lanes = lanes_of(frame, labels, name)
            if calls:                           # the prediction's collectives: its panel only
                lanes.update(collective_lanes(self.collectives, calls, name))
            panels.append(Panel(title, {lane: lanes[lane] for lane in lane_order(labels, calls)}))
        legend = [(PHASE_NAMES[p], PHASE_COLOURS[p]) for p in PHASE_COLOURS]
        drawn = set(self.collectives.kind)
        legend += [(COLLECTIVE_NAMES[k], COLLECTIVE_COLOURS[k]) for k in COLLECTIVE_COLOURS if k in drawn]
        return lanes_svg(self._title(), panels, legend + [("idle (bubble)", IDLE_COLOUR)], TIME_AXIS)

    def table_html(self) -> str:
        return self.bubble_table


def block_times(predicted: pd.DataFrame) -> str:
    """Each stage's mean forward and backward block, in one line."""
    per = (predicted.t_end - predicted.t_start).groupby([predicted.stage, predicted.phase]).mean()
    return "Block times: " + ", ".join(f"stage {s} {p} {fmt_seconds(t)}" for (s, p), t in per.items())


def target_assumptions(hardware: Hardware, predicted: pd.DataFrame) -> str:
    """What a prediction on ``hardware`` rests on: formulas and its datasheet, nothing timed here."""
    lines = [f"Predicted on {hardware.name} ({hardware.nodes} node(s) of {hardware.gpus_per_node} GPUs): op "
             f"times from a roofline of each op's FLOPs and bytes (nbscaler.cost.roofline), collectives from "
             f"NCCL's ring and tree costs on the link each group spans (nbscaler.cost.nccl); nothing run on "
             f"this machine. Step and MFU: plan.summary(hardware=...), the slowest rank's step and the ranks' "
             f"mean MFU."]
    if len(predicted):
        lines.append(block_times(predicted))
    return "\n".join(lines)


def assumptions(plan: "Plan", predicted: pd.DataFrame) -> str:
    """What the prediction rests on, in a few lines: where op and collective times come from, the
    slowest ops as timed, and each stage's forward and backward time."""
    from nbscaler.cost import comm_model
    from nbscaler.cost.timing import profiler_for

    comm = comm_model.load(comm_model.local_backend(plan.config.runtime_ngpus), nranks=max(2, plan.config.plan_ngpus))
    profiler = profiler_for(plan.config)
    speed = ("at the speed its ranks measured side by side" if profiler.calibrated
             else "as timed alone (no ranks calibrated yet)")
    lines = [f"Predicted: op times profiled on this machine ({profiler.key}), {speed}, summed per stage; "
             f"collectives by an alpha-beta model (alpha {comm.alpha_s * 1e6:.3g} µs, "
             f"{1 / comm.beta_s_per_byte / 1e9:.3g} GB/s, {'calibrated' if comm.calibrated else 'defaults'}"
             + (f"; starting a send or a receive takes its rank {comm.p2p_post_s * 1e6:.3g} µs"
                if plan.config.use_pipeline and comm.p2p_post_s else "")
             + "); Python overhead and waits for a slower rank not counted."]
    lines += plan.assumed()
    timed: List[Tuple[float, str]] = []
    for n in plan.graph.nodes:
        fwd, bwd = n.meta.get("local_time_fwd_s", {}), n.meta.get("local_time_bwd_s", {})
        if fwd:
            timed.append((max(fwd.values()) + max(bwd.values(), default=0.0), n.name))
    slowest = sorted(timed, reverse=True)[:4]
    if slowest:
        lines.append("Slowest ops (fwd+bwd on their device): " +
                     ", ".join(f"{name} {fmt_seconds(t)}" for t, name in slowest))
    if len(predicted):
        lines.append(block_times(predicted))
    return "\n".join(lines)
