"""Charts as SVG text, drawn by nbscaler itself: what a notebook shows where no script runs.

A saved notebook read on GitHub, in nbviewer or as nbconvert HTML runs no JavaScript, so the
plotly figures of the live views would be blank there. Each chart view therefore also draws itself
with one of three charts here, in plain SVG elements with presentation attributes (no stylesheet, no
script, no reference to anything outside the element, which HTML sanitizers keep):

- ``lanes_svg``: blocks on horizontal lanes over time, in panels (a timeline; a lane's grey is
  the time its rank waits);
- ``stacked_bars_svg``: groups of stacked bars (memory per rank, predicted beside measured);
- ``lines_svg``: one line per series (a loss per rank).

Every mark carries a ``<title>``, the tooltip a browser shows on hover. Sizes are pixels; a chart
shrinks with a narrow page (``max-width:100%``).

>>> svg = lines_svg("loss", [Series("rank 0", "#4c78a8", [(0, 2.0), (1, 1.5)])], "step", "loss")
>>> svg.startswith("<svg") and "<polyline" in svg
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from nbscaler.widgets.formats import ascii_html
from nbscaler.widgets.palette import IDLE_COLOUR

FONT = "sans-serif"
INK, MUTED, GRID = "#333333", "#666666", "#e3e3e3"
Legend = Sequence[Tuple[str, str]]
"""(label, colour) pairs, in legend order."""


TITLE_MARGIN = 10
"""Pixels an axis title keeps from the chart's left edge."""


def text_width(text: str, size: float) -> float:
    """About how wide ``text`` draws in ``size``-pixel sans-serif: 0.6 em a character, a little more
    than the average, so that what fits by this measure fits on the page."""
    return 0.6 * size * len(text)


# -- elements ------------------------------------------------------------------------------------
def _value(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.1f}".rstrip("0").rstrip(".")
    return ascii_html(v)


def element(tag: str, body: str = "", **attrs: object) -> str:
    """``<tag a="v" ...>body</tag>``; ``font_size=`` is written ``font-size``, ``class_`` ``class``;
    ``None`` attributes are left out, floats rounded to a tenth of a pixel."""
    written = "".join(f' {k.rstrip("_").replace("_", "-")}="{_value(v)}"' for k, v in attrs.items() if v is not None)
    return f"<{tag}{written}>{body}</{tag}>" if body else f"<{tag}{written}/>"


def tooltip(text: str) -> str:
    return element("title", ascii_html(text)) if text else ""


def label(x: float, y: float, text: str, size: int = 12, anchor: str = "start", colour: str = INK,
          bold: bool = False) -> str:
    return element("text", ascii_html(text), x=float(x), y=float(y), font_size=size, font_family=FONT,
                   text_anchor=anchor, fill=colour, font_weight="bold" if bold else None)


def box(x: float, y: float, width: float, height: float, fill: str, hint: str = "", **more: object) -> str:
    return element("rect", tooltip(hint), x=float(x), y=float(y), width=float(max(width, 0.0)),
                   height=float(max(height, 0.0)), fill=fill, **more)


def document(width: float, height: float, title: str, body: str, kind: str) -> str:
    """The ``<svg>`` element around ``body``, titled (the title is also drawn at the top left)."""
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="nbs-chart nbs-chart-{kind}" role="img" '
            f'width="{int(width)}" height="{int(height)}" viewBox="0 0 {int(width)} {int(height)}" '
            f'style="max-width:100%;height:auto;background:#ffffff">{tooltip(title)}'
            f'{label(10, 20, title, size=14, bold=True)}{body}</svg>')


def _swatch_width(name: str) -> float:
    return 28 + 6.5 * len(name)          # a swatch, a gap, the name at about 6.5 px a character


def legend_width(items: Legend) -> float:
    return sum(_swatch_width(name) for name, _ in items)


def legend(items: Legend, x: float, y: float) -> str:
    """A row of colour swatches with their names, starting at ``(x, y)``."""
    out = []
    for name, colour in items:
        out.append(box(x, y - 10, 12, 12, colour, name) + label(x + 16, y, name, size=11))
        x += _swatch_width(name)
    return "".join(out)


# -- axes ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scale:
    """Data values ``lo .. hi`` onto pixels ``start .. end`` (``end < start`` for a y axis)."""

    lo: float
    hi: float
    start: float
    end: float

    def __call__(self, v: float) -> float:
        span = (self.hi - self.lo) or 1.0
        return self.start + (v - self.lo) / span * (self.end - self.start)


def nice_ticks(lo: float, hi: float, count: int = 5) -> List[float]:
    """Round tick values covering ``lo .. hi``: steps of 1, 2 or 5 times a power of ten."""
    if not math.isfinite(lo) or not math.isfinite(hi) or hi <= lo:
        hi = lo + 1.0 if math.isfinite(lo) else 1.0
        lo = hi - 1.0
    raw = (hi - lo) / count
    power = 10.0 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw * (1 - 1e-9))
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [i * step for i in range(first, last + 1)]


def tick_text(v: float) -> str:
    """A tick number as short as it reads: 0, 2.5, 1200, 1.5e-05."""
    return f"{v:.4g}"


def x_axis(ticks: Sequence[float], to_x: Scale, top: float, bottom: float, title: str,
           fmt: Callable[[float], str] = tick_text) -> str:
    """Grid lines from ``top`` to ``bottom`` at each tick, its number under them, the title below."""
    out = [element("line", x1=to_x(t), x2=to_x(t), y1=float(top), y2=float(bottom), stroke=GRID) +
           label(to_x(t), bottom + 14, fmt(t), size=11, anchor="middle", colour=MUTED) for t in ticks]
    out.append(label((to_x.start + to_x.end) / 2, bottom + 32, title, size=12, anchor="middle", colour=MUTED))
    return "".join(out)


def y_axis(ticks: Sequence[float], to_y: Scale, left: float, right: float, title: str,
           fmt: Callable[[float], str] = tick_text) -> str:
    """Grid lines from ``left`` to ``right`` at each tick, its number left of them, the title above."""
    out = [element("line", x1=float(left), x2=float(right), y1=to_y(t), y2=to_y(t), stroke=GRID) +
           label(left - 6, to_y(t) + 4, fmt(t), size=11, anchor="end", colour=MUTED) for t in ticks]
    if text_width(title, 11) <= left - 6 - TITLE_MARGIN:        # ends over the tick numbers, as it fits
        out.append(label(left - 6, to_y.end - 12, title, size=11, anchor="end", colour=MUTED))
    else:                                                       # else starts at the chart's left edge
        out.append(label(TITLE_MARGIN, to_y.end - 12, title, size=11, anchor="start", colour=MUTED))
    return "".join(out)


# -- lanes: a timeline --------------------------------------------------------------------------------
@dataclass
class Block:
    """One bar on a lane, from ``start`` to ``end`` in the axis's unit."""

    start: float
    end: float
    colour: str
    text: str = ""
    hint: str = ""


@dataclass
class Panel:
    """A titled set of lanes (label -> blocks), drawn top to bottom in insertion order."""

    title: str
    lanes: Dict[str, List[Block]] = field(default_factory=dict)


LANE, LANE_GAP, LANES_LEFT = 24, 4, 150
EDGED_PX = 4.0
"""A lane's block at least this wide has a white edge between it and the next; a narrower one (a
small gradient bucket among hundreds) none, which would hide it."""


def lanes_svg(title: str, panels: Sequence[Panel], items: Legend, axis_title: str, width: int = 900) -> str:
    """Panels of lanes on one shared time axis. Each lane's grey band runs to its panel's last end:
    where no block covers it, that lane waited (the bubble of a pipeline). The legend wraps in rows
    as wide as the axis."""
    ends = [b.end for p in panels for blocks in p.lanes.values() for b in blocks]
    ticks = nice_ticks(0.0, max(ends, default=0.0) or 1.0, count=8)      # the axis ends near the last block
    to_x = Scale(0.0, ticks[-1], LANES_LEFT, width - 20)
    rows = legend_rows(list(items), width - 20 - LANES_LEFT)
    y, body = 54.0 + 18 * (len(rows) - 1), [legend(row, LANES_LEFT, 42 + 18 * i) for i, row in enumerate(rows)]
    top = y
    for panel in panels:
        span = max((b.end for blocks in panel.lanes.values() for b in blocks), default=0.0)
        body.append(label(LANES_LEFT, y + 14, panel.title, size=12, bold=True))
        y += 22
        for lane, blocks in panel.lanes.items():
            body.append(label(LANES_LEFT - 8, y + LANE / 2 + 4, lane, size=11, anchor="end"))
            body.append(box(to_x(0), y, to_x(span) - to_x(0), LANE, IDLE_COLOUR, f"{lane}: idle where no block"))
            for b in blocks:
                x0, x1 = to_x(b.start), to_x(b.end)
                edge = {"stroke": "#ffffff", "stroke_width": 1} if x1 - x0 >= EDGED_PX else {}
                body.append(box(x0, y, max(x1 - x0, 1.0), LANE, b.colour, b.hint, class_="nbs-block", **edge))
                if x1 - x0 > 7 * len(b.text) + 4:
                    body.append(label((x0 + x1) / 2, y + LANE / 2 + 4, b.text, size=10, anchor="middle",
                                      colour="#ffffff"))
            y += LANE + LANE_GAP
        y += 8
    grid = x_axis(ticks, to_x, top, y, axis_title)
    return document(width, y + 44, title, grid + "".join(body), "lanes")


# -- stacked bars: memory per rank ---------------------------------------------------------------------
@dataclass
class Segment:
    value: float
    colour: str
    hint: str = ""


@dataclass
class Bar:
    """One stacked bar: its segments bottom up; ``outlined`` bars get a dark edge (measured ones),
    ``alert`` ones a thick edge and total in ``alert`` colour (over a limit)."""

    label: str
    segments: List[Segment]
    outlined: bool = False
    alert: Optional[str] = None

    @property
    def total(self) -> float:
        return float(sum(s.value for s in self.segments))


@dataclass
class BarGroup:
    label: str
    bars: List[Bar]


@dataclass(frozen=True)
class Limit:
    """A horizontal line across the bars at ``value`` (a capacity), labelled at its right end."""

    value: float
    text: str
    colour: str


BAR, BAR_GAP, GROUP_GAP, BARS_LEFT, PLOT_HEIGHT = 58, 6, 30, 90, 260


def stacked_bars_svg(title: str, groups: Sequence[BarGroup], items: Legend, axis_title: str,
                     fmt: Callable[[float], str] = tick_text, unit: float = 1.0, limit: Optional[Limit] = None,
                     note: str = "") -> str:
    """Groups of stacked bars side by side on one value axis from zero; its ticks are round in
    ``unit`` (1024 ** k for bytes) and written by ``fmt``. A ``limit`` is drawn as a dashed line (the
    axis reaches it); a ``note`` is a line of text under the chart."""
    tallest = max((bar.total for g in groups for bar in g.bars), default=0.0)
    top_value = max(tallest, limit.value if limit is not None else 0.0) / unit
    ticks = [t * unit for t in nice_ticks(0.0, top_value or 1.0)]
    nbars = sum(len(g.bars) for g in groups)
    width = BARS_LEFT + max(nbars * (BAR + BAR_GAP) + len(groups) * GROUP_GAP, legend_width(items), 6.5 * len(note)) + 20
    top = 70.0
    to_y = Scale(0.0, ticks[-1], top + PLOT_HEIGHT, top)
    body = [legend(items, BARS_LEFT, 42), y_axis(ticks, to_y, BARS_LEFT, width - 20, axis_title, fmt)]
    x = BARS_LEFT + GROUP_GAP / 2
    for group in groups:
        start = x
        for bar in group.bars:
            base = 0.0
            for s in bar.segments:
                y0, y1 = to_y(base), to_y(base + s.value)
                body.append(box(x, y1, BAR, y0 - y1, s.colour, s.hint, class_="nbs-bar"))
                base += s.value
            if bar.outlined:
                body.append(box(x, to_y(base), BAR, to_y(0) - to_y(base), "none", stroke=INK, stroke_width=1.5,
                                stroke_dasharray="4 2"))
            if bar.alert:
                body.append(box(x, to_y(base), BAR, to_y(0) - to_y(base), "none", stroke=bar.alert, stroke_width=3,
                                class_="nbs-alert"))
            body.append(label(x + BAR / 2, to_y(base) - 4, fmt(base), size=10, anchor="middle",
                              colour=bar.alert or MUTED, bold=bar.alert is not None))
            body.append(label(x + BAR / 2, top + PLOT_HEIGHT + 14, bar.label, size=10, anchor="middle",
                              colour=MUTED))
            x += BAR + BAR_GAP
        body.append(label((start + x - BAR_GAP) / 2, top + PLOT_HEIGHT + 30, group.label, size=12, anchor="middle"))
        x += GROUP_GAP
    if limit is not None:
        y = to_y(limit.value)
        body.append(element("line", tooltip(limit.text), x1=float(BARS_LEFT), x2=float(width - 20), y1=y, y2=y,
                            stroke=limit.colour, stroke_width=2, stroke_dasharray="6 3", class_="nbs-limit"))
        body.append(label(width - 22, y - 4, limit.text, size=10, anchor="end", colour=limit.colour))
    height = top + PLOT_HEIGHT + 44
    if note:
        body.append(label(BARS_LEFT, height + 4, note, size=12, colour=INK))
        height += 18
    return document(width, height, title, "".join(body), "bars")


# -- lines: a loss per rank ------------------------------------------------------------------------
@dataclass
class Series:
    label: str
    colour: str
    points: List[Tuple[float, float]]


def lines_svg(title: str, series: Sequence[Series], x_title: str, y_title: str, width: int = 520,
              height: int = 300) -> str:
    """A line with dots per series, over the range of all their points."""
    points = [p for s in series for p in s.points]
    if not points:
        return document(width, 60, title, label(10, 44, "no data yet", size=12, colour=MUTED), "lines")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    left, top, bottom = 70.0, 60.0, height - 44.0
    whole = all(float(x).is_integer() for x in xs)          # steps: no tick between two of them
    x_ticks = nice_ticks(min(xs), max(xs), min(5, max(1, int(max(xs) - min(xs)))) if whole else 5)
    y_ticks = nice_ticks(min(ys), max(ys))
    to_x = Scale(x_ticks[0], x_ticks[-1], left, width - 20)
    to_y = Scale(y_ticks[0], y_ticks[-1], bottom, top)
    body = [legend([(s.label, s.colour) for s in series], left, 42),
            x_axis(x_ticks, to_x, top, bottom, x_title), y_axis(y_ticks, to_y, left, width - 20, y_title)]
    for s in series:
        path = " ".join(f"{to_x(x):.1f},{to_y(y):.1f}" for x, y in s.points)
        body.append(element("polyline", points=path, fill="none", stroke=s.colour, stroke_width=2))
        body.extend(element("circle", tooltip(f"{s.label}, {x_title} {x:g}: {y:.6g}"), cx=to_x(x), cy=to_y(y),
                            r=3.0, fill=s.colour) for x, y in s.points)
    return document(width, height, title, "".join(body), "lines")


# -- scatter: points in panels side by side ----------------------------------------------------------
@dataclass
class Marks:
    """The points of one legend entry. ``shapes`` holds a shape per point (``"circle"``, ``"square"``,
    ``"diamond"``, ``"star"``) or one for all; ``line`` joins the points in order, ``"straight"`` or
    ``"step"`` (across, then up or down: a front of best values); ``hints`` are the points' tooltips."""

    label: str
    colour: str
    points: List[Tuple[float, float]]
    shapes: Sequence[str] = ("circle",)
    hints: Sequence[str] = ()
    line: Optional[str] = None
    dash: Optional[str] = None
    size: float = 4.0
    markers: bool = True


@dataclass
class ScatterPanel:
    title: str
    marks: List[Marks]


def marker(shape: str, x: float, y: float, r: float, fill: str, hint: str = "") -> str:
    """One point drawn as ``shape`` of radius about ``r`` around ``(x, y)``, with a white edge."""
    edge = {"stroke": "#ffffff", "stroke_width": 0.5, "class_": "nbs-point"}
    if shape == "circle":
        return element("circle", tooltip(hint), cx=float(x), cy=float(y), r=float(r), fill=fill, **edge)
    if shape == "square":
        return box(x - r, y - r, 2 * r, 2 * r, fill, hint, **edge)
    if shape == "star":
        corners = [(r * (1.0 if i % 2 == 0 else 0.45), math.pi / 2 + i * math.pi / 5) for i in range(10)]
    else:                                                             # a diamond
        corners = [(r * 1.3, math.pi / 2 * i) for i in range(4)]
    points = " ".join(f"{x + d * math.cos(a):.1f},{y - d * math.sin(a):.1f}" for d, a in corners)
    return element("polygon", tooltip(hint), points=points, fill=fill,
                   **{**edge, "stroke": INK if shape == "star" else "#ffffff"})


def log_ticks(lo: float, hi: float) -> List[float]:
    """1, 2 and 5 times the powers of ten from ``lo`` to ``hi`` (both above zero)."""
    return [m * 10.0 ** k for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
            for m in (1, 2, 5) if lo * (1 - 1e-9) <= m * 10.0 ** k <= hi * (1 + 1e-9)]


def legend_rows(items: Legend, width: float) -> List[Legend]:
    """``items`` in rows no wider than ``width``."""
    rows: List[List[Tuple[str, str]]] = [[]]
    for item in items:
        if rows[-1] and legend_width(rows[-1] + [item]) > width:
            rows.append([])
        rows[-1].append(item)
    return rows


def scatter_svg(title: str, panels: Sequence[ScatterPanel], x_title: str, y_title: str, *, log_x: bool = False,
                x_range: Optional[Tuple[float, float]] = None, panel_width: int = 460, height: int = 340) -> str:
    """Panels side by side, each with its own y axis from its points and one x axis for all
    (``x_range``, or the points' range; logarithmic with ``log_x``). A point beyond ``x_range`` is
    left out, and the chart says how many were; a line reaching beyond it stops at the edge."""
    xs = [x for p in panels for m in p.marks for x, _ in m.points]
    lo, hi = x_range or (min(xs, default=1.0), max(xs, default=10.0))
    if log_x:                             # the axis in powers of ten, its ticks written as the values
        ticks = [math.log10(t) for t in log_ticks(lo, hi)]
        lo, hi, to_value = math.log10(lo), math.log10(hi), math.log10

        def fmt(t: float) -> str:
            return tick_text(10.0 ** t)
    else:
        ticks = nice_ticks(lo, hi)
        lo, hi, to_value, fmt = ticks[0], ticks[-1], float, tick_text
    width = len(panels) * panel_width + 20
    seen: Dict[str, str] = {}
    for p in panels:
        for m in p.marks:
            seen.setdefault(m.label, m.colour)
    rows = legend_rows(list(seen.items()), width - 80)
    body = [legend(row, 60, 42 + 18 * i) for i, row in enumerate(rows)]
    top = 42 + 18 * len(rows) + 24
    bottom, left_out = top + height - 76, 0
    for n, panel in enumerate(panels):
        left = n * panel_width + 70
        to_x = Scale(lo, hi, left, left + panel_width - 90)
        ys = [y for m in panel.marks for x, y in m.points if x_range is None or lo <= to_value(x) <= hi]
        y_ticks = nice_ticks(min(ys, default=0.0), max(ys, default=1.0))
        to_y = Scale(y_ticks[0], y_ticks[-1], bottom, top + 30)
        body.append(label(left, top + 4, panel.title, size=12, bold=True))
        body.append(label(left - 60, top + 20, y_title, size=11, colour=MUTED))     # over the axis, not cut off
        body.append(x_axis(ticks, to_x, top + 30, bottom, x_title, fmt))
        body.append(y_axis(y_ticks, to_y, left, to_x.end, ""))
        for m in panel.marks:
            inside = [(x, y, i) for i, (x, y) in enumerate(m.points) if lo <= to_value(x) <= hi]
            if m.line:
                path = []
                for x, y in m.points:
                    px = min(max(to_x(to_value(x)), to_x.start), to_x.end)
                    if m.line == "step" and path:
                        path.append(f"{px:.1f},{path[-1].split(',')[1]}")
                    path.append(f"{px:.1f},{to_y(y):.1f}")
                body.append(element("polyline", tooltip(m.label), points=" ".join(path), fill="none", stroke=m.colour,
                                    stroke_width=1.5, stroke_dasharray=m.dash, class_="nbs-line"))
            if m.markers:
                left_out += len(m.points) - len(inside)
                for x, y, i in inside:
                    shape = m.shapes[i] if len(m.shapes) == len(m.points) else m.shapes[0]
                    hint = m.hints[i] if i < len(m.hints) else f"{m.label}: {x:.4g}, {y:.4g}"
                    body.append(marker(shape, to_x(to_value(x)), to_y(y), m.size, m.colour, hint))
    total = bottom + 44
    if left_out:
        body.append(label(70, total, f"{left_out} point(s) beyond the x axis left out", size=11, colour=MUTED))
        total += 14
    return document(width, total, title, "".join(body), "scatter")
