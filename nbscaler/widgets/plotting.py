"""Chart views: a plotly figure live, nbscaler's own SVG where no script runs.

A chart is built once, as a plain ``go.Figure``, and shown three ways:

- live: as the one output of an ``ipywidgets.Output`` in the view's box, in plotly's own MIME type
  (``application/vnd.plotly.v1+json``, drawn by the ``jupyterlab-plotly`` renderer that ships
  with plotly); an ``update`` replaces that output, so the cell that shows the box redraws. The
  output is widget state, so a view that renders late (after "Run All") still finds the newest
  figure. (A ``go.FigureWidget`` was tried first: under load its front end sometimes drew an
  empty plot.)
- saved in a notebook: ``ChartView``'s display bundle (see there): the figure in plotly's MIME type
  and, as ``text/html``, the same chart drawn as SVG by ``nbscaler.widgets.svgchart``, which needs
  neither a kernel nor a script nor the network. plotly.js (about 4.8 MB) never goes into a notebook.
- in a page: ``figure_html`` turns the figure into a ``<div>`` plus a script; ``nbscaler report``
  puts plotly.js once in the page's head (``plotlyjs_script``), so the page works offline.
"""

from __future__ import annotations

import html
import json
import uuid
from typing import Any, Dict, Optional

import ipywidgets as widgets
import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.utils import PlotlyJSONEncoder

from nbscaler.widgets.base import View


PLOTLY_MIME = "application/vnd.plotly.v1+json"


def figure_spec(figure: go.Figure) -> Dict[str, Any]:
    """``figure`` as plotly's MIME type holds it: data, layout and config, plain JSON values."""
    spec = json.loads(json.dumps(figure.to_plotly_json(), cls=PlotlyJSONEncoder))
    return {"data": spec.get("data", []), "layout": spec.get("layout", {}),
            "config": {"displaylogo": False, "responsive": True}}


def figure_output(figure: go.Figure) -> dict:
    """``figure`` as one display-data output, in plotly's MIME type."""
    return {"output_type": "display_data", "metadata": {},
            "data": {PLOTLY_MIME: figure_spec(figure),
                     "text/plain": f"<plotly figure: {figure.layout.title.text or 'untitled'}>"}}


def show_figure(output: widgets.Output, figure: go.Figure) -> None:
    """Make ``output`` show ``figure`` alone (no kernel needed: it sets the widget's state)."""
    output.outputs = (figure_output(figure),)


class FigureAndSVG:
    """A plotly figure for a notebook cell, with the same chart drawn as SVG in the same output.

    JupyterLab draws the figure (its plotly renderer ranks before images); GitHub, nbviewer and
    nbconvert's HTML, which run no script, draw the SVG instead of leaving the cell blank. A chart a
    walkthrough builds with plotly itself ends its cell with one of these rather than the bare figure:

    >>> FigureAndSVG(fig, lanes_svg(...))                                # doctest: +SKIP
    """

    def __init__(self, figure: go.Figure, svg: str) -> None:
        self.figure, self.svg = figure, svg

    def _repr_mimebundle_(self, **kwargs: Any) -> Dict[str, Any]:
        return {PLOTLY_MIME: figure_spec(self.figure), "image/svg+xml": self.svg,
                "text/plain": f"<plotly figure: {self.figure.layout.title.text or 'untitled'}, with its SVG>"}


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


class ChartView(View):
    """A view drawn as one chart above a small table.

    Subclasses keep ``self.figure`` (the plotly figure) current in ``_redraw`` and then call
    ``self._shown()``; they draw the same chart as SVG in ``svg`` (same data, colours and names from
    ``nbscaler.widgets.palette``) and write the table in ``table_html``.

    The display bundle carries three renderings, and each reader takes the best it can draw:

    - ``application/vnd.jupyter.widget-view+json``: the live widget, in a running kernel (JupyterLab
      ranks it first);
    - ``application/vnd.plotly.v1+json``: the figure, which JupyterLab's plotly renderer draws
      interactively from a saved notebook without a kernel or the network (it ranks before HTML);
    - ``text/html``: the SVG and the table (``notebook_html``), which nbconvert, nbviewer and GitHub
      show: their display priority takes ``text/html`` before the others they know, and skips a widget
      whose state the notebook did not save.
    """

    css_class = "nbs-chart-view"
    figure: go.Figure

    def _build_widget(self) -> widgets.VBox:
        self._live = FigureAndTable(self.figure, self.table_html())
        return self._live.box

    def _shown(self) -> None:
        """Redraw the live widget, if there is one, from the current figure and table."""
        if self._widget is not None:
            self._live.show(self.figure, self.table_html())

    def svg(self) -> str:
        """The chart as an ``<svg>`` element (``nbscaler.widgets.svgchart``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement svg")

    def table_html(self) -> str:
        """The figures the chart shows, as a small HTML table (readable anywhere)."""
        raise NotImplementedError(f"{type(self).__name__} must implement table_html")

    def to_html(self, include_plotlyjs: bool = True) -> str:
        """The interactive chart and the table; with ``include_plotlyjs=False`` the page loads
        plotly.js itself (``nbscaler report`` does, once, in its head)."""
        return (f"<div class='nbs-view {self.css_class}'>{figure_html(self.figure, include_plotlyjs=include_plotlyjs)}"
                f"{self.table_html()}</div>")

    def notebook_html(self) -> str:
        """The SVG chart and the table: no script, no network, a few tens of kilobytes."""
        return f"<div class='nbs-view {self.css_class} nbs-static'>{self.svg()}{self.table_html()}</div>"

    def _repr_mimebundle_(self, **kwargs: Any) -> Dict[str, Any]:
        bundle = super()._repr_mimebundle_(**kwargs)
        bundle[PLOTLY_MIME] = figure_spec(self.figure)
        return bundle
