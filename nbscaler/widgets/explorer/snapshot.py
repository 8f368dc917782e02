"""The Explorer as a saved notebook shows it: its state at display time, as HTML with no script.

A notebook read on GitHub, in nbviewer or converted by nbconvert has no kernel, so the Explorer's
widgets cannot draw there. ``snapshot_html`` writes what they show at the moment the Explorer is
displayed: the status line, the knobs, the timeline and memory of the plan on screen (their SVG
renderings), the loss curve of the last run and the runs table. Display the Explorer again at the
end of a notebook to save its final state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nbscaler.widgets.explorer.panes import ViewName

if TYPE_CHECKING:
    from nbscaler.widgets.explorer.app import Explorer


def snapshot_html(ex: "Explorer") -> str:
    """The Explorer's state as self-contained HTML (inline SVG and tables)."""
    charts = "".join(ex.panes.views[name].notebook_html() for name in (ViewName.TIMELINE, ViewName.MEMORY)
                     if name in ex.panes.views)
    losses = ex.losses.svg() if ex.runs["step_s"].notna().any() else ""
    return (f"<div class='nbscaler-explorer nbs-static'><h3 style='margin:4px 0'>nbscaler Explorer</h3>"
            f"{ex.status.value}<div style='display:flex;gap:16px;align-items:flex-start'>{ex.controls.as_table()}"
            f"<div>{charts}</div></div>{losses}<div style='overflow:auto'>{ex.runs_table.value}</div></div>")
