"""Plotly figures as live widgets and as offline HTML fragments.

Charts are built once, as a plain ``go.Figure``, and then shown two ways:

- live: as a ``go.FigureWidget`` (anywidget-based in plotly >= 6) inside the view's box; an
  ``update`` puts a new FigureWidget into the same box, so the output cell that shows the box
  redraws. (Emptying and refilling one FigureWidget's traces instead sends messages that a view
  rendered later, as after "Run All", can miss, leaving it blank.)
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

import plotly.graph_objects as go
from plotly.offline import get_plotlyjs
from plotly.utils import PlotlyJSONEncoder


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
