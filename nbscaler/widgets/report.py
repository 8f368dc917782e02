"""``write_report``: every view of one plan (and of a run, when there is one) in one offline HTML file.

The file holds plotly.js once, in its head, then each view's ``to_html`` fragment: the plan card and
per-rank summary, what the policy did and why (``plan.explain()``), the graph and the generated
code (where those views are installed), the op and collective tables, the timeline and the
memory bars, the runs table and the loss curves. It loads nothing from the network, so it opens
from a mail attachment or a CI artifact, and it is written to a temporary file and renamed, so a
failed report never leaves half a file.

>>> write_report(plan, "report.html", measured=Measured(timeline=..., memory=...))   # doctest: +SKIP
``nbscaler report DIR`` does the same from a folder ``parallelize`` wrote.
"""

from __future__ import annotations

import datetime
import html
import importlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple, Union

import pandas as pd
import plotly.graph_objects as go

from nbscaler.cost.hardware import Hardware
from nbscaler.genfiles import atomic_write_bytes
from nbscaler.recipe import UNSET
from nbscaler.widgets.base import Measured
from nbscaler.widgets.formats import ascii_html
from nbscaler.units import summary_format, unit_formatters
from nbscaler.widgets.memory import MemoryView
from nbscaler.widgets.palette import rank_colour
from nbscaler.widgets.plan_table import PlanView
from nbscaler.widgets.plotting import figure_html, plotlyjs_script
from nbscaler.widgets.timeline import TimelineView

if TYPE_CHECKING:
    from nbscaler.planning import Plan

OPTIONAL_VIEWS: List[Tuple[str, str, str]] = [("Graph", "nbscaler.widgets.graph", "GraphView"),
                                              ("Generated code", "nbscaler.widgets.code", "CodeView")]
"""Views from other parts of the package, by module and class; a report shows those installed."""

PAGE_STYLE = """<style>
body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px} h2{font-size:18px;border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:32px}
table.nbs-summary{border-collapse:collapse;font:12px monospace} .nbs-summary td,.nbs-summary th{padding:2px 8px;
border-top:1px solid #ddd;text-align:right} nav a{margin-right:12px}
</style>"""


def optional_view(module: str, name: str) -> Optional[type]:
    """The view class if its module is part of this install, else None (other import errors raise)."""
    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if e.name is not None and module.startswith(e.name):
            return None
        raise


def summary_html(plan: "Plan", optimizer: Any = UNSET, hardware: Optional[Hardware] = None) -> str:
    """``plan.summary()`` (on ``hardware``, if given) as a table, numbers written for people."""
    frame = plan.summary(optimizer, hardware=hardware)
    shown = pd.DataFrame({c: frame[c].map(summary_format(c)) for c in frame.columns if c != "rank"}, index=frame["rank"])
    return shown.to_html(classes="nbs-summary", border=0) + assumed_html(frame.attrs.get("assumed", []))


def assumed_html(lines: List[str]) -> str:
    """What a prediction assumes (``plan.assumed()``), one line each, under the table it concerns."""
    if not lines:
        return ""
    return ("<p class='nbs-assumed' style='font-family:monospace;white-space:pre-wrap'>Assumed: " +
            "<br>".join(ascii_html(line) for line in lines) + "</p>")


def styled_summary(frame: pd.DataFrame):
    """``plan.summary()`` as a pandas ``Styler`` that writes each number with its unit (82.9 MFLOP,
    1.5 GiB, 12.3 ms) and leaves the frame's values as they are: display it in a notebook."""
    return frame.style.format({c: summary_format(c) for c in frame.columns if c != "rank"}).hide(axis="index")


def explanation_html(plan: "Plan", rows: int = 20) -> str:
    """``plan.explain()``: its text as written, then the first ``rows`` rows of its table."""
    why = plan.explain()
    table = why.table.head(rows).to_html(classes="nbs-summary", border=0, index=False, na_rep="",
                                         float_format="{:.4g}".format, formatters=unit_formatters(why.table))
    return f"<pre style='font-size:12px;white-space:pre-wrap'>{html.escape(str(why), quote=False)}</pre>{table}"


def losses_html(losses: pd.DataFrame) -> str:
    """Loss per step, a line per rank, from a frame with ``step``, ``rank`` and ``loss`` columns."""
    fig = go.Figure()
    for rank, rows in losses.groupby("rank"):
        fig.add_trace(go.Scatter(x=rows.step, y=rows.loss, mode="lines+markers", name=f"rank {rank}",
                                 line=dict(color=rank_colour(rank))))
    fig.update_layout(title="Loss per step", xaxis_title="step", yaxis_title="loss", height=360,
                      template="plotly_white")
    return figure_html(fig, include_plotlyjs=False)


def report_sections(plan: "Plan", measured: Measured, runs: Optional[pd.DataFrame],
                    optimizer: Any,
                    hardware: Optional[Hardware] = None) -> List[Tuple[str, Callable[[], str]]]:
    """(title, render) per section, in page order."""
    sections: List[Tuple[str, Callable[[], str]]] = [
        ("Plan", lambda: plan._repr_html_() + summary_html(plan, optimizer, hardware)),
        ("Why this plan", lambda: explanation_html(plan))]
    for title, module, name in OPTIONAL_VIEWS:
        cls = optional_view(module, name)
        if cls is not None:
            sections.append((title, lambda cls=cls: cls(plan).to_html()))
    sections += [
        ("Ops and collectives", lambda: PlanView(plan).to_html()),
        ("Timeline", lambda: TimelineView(plan, measured, hardware=hardware, optimizer=optimizer)
         .to_html(include_plotlyjs=False)),
        ("Memory", lambda: MemoryView(plan, measured, optimizer=optimizer, hardware=hardware)
         .to_html(include_plotlyjs=False)),
    ]
    if runs is not None and len(runs):
        sections.append(("Runs", lambda: runs.to_html(classes="nbs-summary", border=0)))
    if measured.losses is not None and len(measured.losses):
        sections.append(("Losses", lambda: losses_html(measured.losses)))
    return sections


def report_html(plan: "Plan", measured: Optional[Measured] = None, runs: Optional[pd.DataFrame] = None,
                optimizer: Any = UNSET, hardware: Optional[Hardware] = None) -> str:
    """The whole report page as a string; on ``hardware``, the summary, timeline and memory are that target's."""
    measured = measured if measured is not None else Measured()
    sections = report_sections(plan, measured, runs, optimizer, hardware)
    anchors = [f"s{i}" for i in range(len(sections))]
    nav = "".join(f"<a href='#{a}'>{ascii_html(t)}</a>" for a, (t, _) in zip(anchors, sections))
    body = "".join(f"<section id='{a}'><h2>{ascii_html(t)}</h2>{render()}</section>"
                   for a, (t, render) in zip(anchors, sections))
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    title = ascii_html(f"{plan.module_name} under {plan.policy_name}"
                       + (f" on {hardware.name} x {hardware.ngpus}" if hardware is not None else ""))
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>nbscaler report: {title}</title>"
            f"{PAGE_STYLE}{plotlyjs_script()}</head><body><h1>nbscaler report: {title}</h1>"
            f"<p>{ascii_html(repr(plan))}; written {when}{'; with measured data' if measured else ''}.</p>"
            f"<nav>{nav}</nav>{body}</body></html>")


def write_report(plan: "Plan", path: Union[str, Path], measured: Optional[Measured] = None,
                 runs: Optional[pd.DataFrame] = None, *,
                 optimizer: Any = UNSET, hardware: Optional[Hardware] = None) -> Path:
    """Write every view of ``plan`` (with ``measured`` data and a ``runs`` table, if given) to one
    self-contained HTML file at ``path``; returns the path. A folder ``path`` gets ``report.html``.
    With ``hardware`` the summary, timeline and memory show the plan on that target."""
    path = Path(path)
    if path.is_dir():
        path = path / "report.html"
    page = report_html(plan, measured, runs, optimizer, hardware)      # all of it first: a failure writes nothing
    atomic_write_bytes(path, page.encode("utf-8"))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)                           # readable like any new file, not 0600
    return path
