"""Plotly figures as live widgets and as offline HTML fragments.

Charts are built once, as a plain ``go.Figure``, and then shown two ways:

- live: as the one output of an ``ipywidgets.Output`` in the view's box, in plotly's own MIME type
  (``application/vnd.plotly.v1+json``, drawn by the ``jupyterlab-plotly`` renderer that ships
  with plotly); an ``update`` replaces that output, so the cell that shows the box redraws. The
  output is widget state, so a view that renders late (after "Run All") still finds the newest
  figure. (A ``go.FigureWidget`` was tried first: under load its front end sometimes drew an
  empty plot.)
- saved: ``figure_html`` turns the figure into a ``<div>`` plus a script that needs no network.

plotly.js is about 4.8 MB. A page needs it once: ``nbscaler report`` puts it in the page's head
(``plotlyjs_script``) and the figures after it leave it out; a notebook fragment carries it only the
first time this process renders one (``PlotlyJsOnce``), and later fragments wait for
``window.Plotly`` to appear. Clearing that first output leaves the others blank in a saved
notebook; ``nbscaler.widgets.plotting.PLOTLYJS.reset()`` makes the next fragment carry it again.
"""

from __future__ import annotations

import html
import json
import uuid
from typing import Optional

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.utils import PlotlyJSONEncoder


PLOTLY_MIME = "application/vnd.plotly.v1+json"


def figure_output(figure: go.Figure) -> dict:
    """``figure`` as one display-data output, in plotly's MIME type (plain JSON values)."""
    spec = json.loads(json.dumps(figure.to_plotly_json(), cls=PlotlyJSONEncoder))
    return {"output_type": "display_data", "metadata": {},
            "data": {PLOTLY_MIME: {"data": spec.get("data", []), "layout": spec.get("layout", {}),
                                   "config": {"displaylogo": False, "responsive": True}},
                     "text/plain": f"<plotly figure: {figure.layout.title.text or 'untitled'}>"}}


def show_figure(output: widgets.Output, figure: go.Figure) -> None:
    """Make ``output`` show ``figure`` alone (no kernel needed: it sets the widget's state)."""
    output.outputs = (figure_output(figure),)


class FigureAndTable:
    """The live form of a chart view: a plotly figure above an HTML table, redrawn in place."""

    def __init__(self, figure: go.Figure, table: str) -> None:
        self.output = widgets.Output()
        show_figure(self.output, figure)
        self.table = widgets.HTML(table)
        self.box = widgets.VBox([self.output, self.table])

    def show(self, figure: go.Figure, table: str) -> None:
        show_figure(self.output, figure)
        self.table.value = table


def plotlyjs_script() -> str:
    """The whole of plotly.js as one inline ``<script>`` (no network)."""
    return f"<script type='text/javascript'>{get_plotlyjs()}</script>"


class PlotlyJsOnce:
    """Whether this process has already put plotly.js into a notebook fragment."""

    def __init__(self) -> None:
        self.sent = False

    def take(self) -> bool:
        """True the first time (the caller inlines plotly.js), False afterwards."""
        first, self.sent = not self.sent, True
        return first

    def reset(self) -> None:
        self.sent = False


PLOTLYJS = PlotlyJsOnce()


def figure_html(figure: go.Figure, *, include_plotlyjs: bool = True, div_id: Optional[str] = None) -> str:
    """A ``<div>`` and a script that draw ``figure`` offline.

    With ``include_plotlyjs=False`` the page must load plotly.js elsewhere (before or after: the
    script waits up to a minute for ``window.Plotly``).
    """
    div_id = div_id or f"nbs-{uuid.uuid4().hex[:12]}"
    # plotly's encoder (numpy, NaN), ASCII only so the page's charset does not matter, and no
    # '</script>' inside the script.
    spec = json.dumps(figure.to_plotly_json(), cls=PlotlyJSONEncoder).replace("</", "<\\/")
    height = figure.layout.height or 450
    draw = (f"(function(){{var spec={spec};var tries=0;function draw(){{"
            f"if(window.Plotly){{window.Plotly.newPlot({json.dumps(div_id)},spec.data,spec.layout,"
            f"{{responsive:true,displaylogo:false}});}}"
            f"else if(tries++<600){{setTimeout(draw,100);}}}}draw();}})();")
    js = plotlyjs_script() if include_plotlyjs else ""
    return (f"{js}<div id='{html.escape(div_id)}' class='nbs-plot' style='width:100%;height:{int(height)}px'></div>"
            f"<script type='text/javascript'>{draw}</script>")
