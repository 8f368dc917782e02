"""The plan space as a chart: every configuration of a sweep, its time against its memory per GPU.

``space_svg(frame, hardware)`` draws one mark per row of ``nbscaler.sweep``'s table (or a
``PlanSpace``'s): peak memory per GPU across, the step time (or the MFU) up; the target's memory
capacity as a vertical dashed line, so what does not fit lies right of it; a colour per tp x cp x ep
x pp layout (``palette.layout_colour``; a context- or expert-parallel layout, tp 1 x cp n x pp or
tp 1 x ep n x pp, is named apart in the legend), a circle where nothing is recomputed, a triangle
where the attention cores are and a diamond where the layers are (the ``recompute`` column: none, selective, full); the Pareto front
(``space.pareto.pareto_front``) ringed in black and joined by a dashed line; a white dot inside a
mark where its products are in fp8, a white bar across it where its target compiles (the
``float8`` and ``compiled`` columns, keyed in the legend where the frame has such rows). Each mark's
``<title>`` is the configuration (``sequence parallel`` where it is, ``cp n`` and its kind where the
sequence is split, ``ep n`` where the experts are) and its figures (the
browser's hover text).

``SpaceWidget`` shows that SVG live and turns a click on a mark into its row (``selected``); the
browser side (``widgets/space.js``) only inserts the SVG and reports the click.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import anywidget
import pandas as pd
import traitlets

from nbscaler.columns import StrEnum, SweepColumn as S
from nbscaler.cost.hardware import Hardware
from nbscaler.space.pareto import pareto_front
from nbscaler.space.ranges import NO_FLOAT8
from nbscaler.widgets.formats import BINARY_BYTES, binary_unit, fmt_bytes
from nbscaler.widgets.frontend import frontend_text
from nbscaler.widgets.palette import CAPACITY_COLOUR, layout_colour
from nbscaler.widgets.svgchart import (INK, MUTED, Scale, document, element, label, legend, legend_rows, legend_width,
                                       nice_ticks, tooltip, x_axis, y_axis)

WIDTH, HEIGHT = 760, 440
LEFT, TOP, RIGHT, BOTTOM = 80.0, 76.0, 20.0, 52.0
FRONT_COLOUR = "#000000"


class Metric(StrEnum):
    """What the space chart draws up: the step's seconds or the model FLOPs utilisation."""

    STEP_TIME = "step time"
    MFU = "MFU"


METRIC_COLUMNS: Dict[Metric, str] = {Metric.STEP_TIME: S.STEP_TIME_S, Metric.MFU: S.MFU}


def group_name(tp: int, pp: int, cp: int = 1, ep: int = 1) -> str:
    """A colour group's legend name: its tensor-, context- and expert- (each where above 1) and
    pipeline-parallel sizes."""
    inner = "".join(f" x {name} {int(size)}" for name, size in (("cp", cp), ("ep", ep)) if int(size) > 1)
    return f"tp {int(tp)}{inner} x pp {int(pp)}"


def _cp(row) -> int:
    """A row's context-parallel size (1 for a frame from before ``cp`` was a column)."""
    return int(row[S.CP]) if S.CP in row else 1


def _ep(row) -> int:
    """A row's expert-parallel size (1 for a frame from before ``ep`` was a column)."""
    return int(row[S.EP]) if S.EP in row else 1


def group_of(row) -> str:
    """A row's colour group (``group_name`` of its tp, pp, cp and ep)."""
    return group_name(row[S.TP], row[S.PP], _cp(row), _ep(row))


def describe(row) -> str:
    """One configuration and its figures, as a sentence (a mark's hover text, the status line)."""
    fits = "fits" if bool(row[S.FITS]) else "does not fit"
    recompute = row[S.RECOMPUTE]
    sequence = ", sequence parallel" if bool(row[S.SEQUENCE_PARALLEL]) else ""
    cp = _cp(row)
    context = f" x cp {cp} ({row[S.CONTEXT_PARALLEL_KIND]})" if cp > 1 else ""
    context += f" x ep {_ep(row)}" if _ep(row) > 1 else ""
    fp8, compiled = _software(row)
    software = (f", fp8 {row[S.FLOAT8]}" if fp8 else "") + (", compiled" if compiled else "")
    return (f"tp {int(row[S.TP])}{context} x pp {int(row[S.PP])} x dp {int(row[S.DP])}, micro-batch "
            f"{int(row[S.MICRO_BATCH])} x {int(row[S.MICRO_BATCHES])}, recompute {recompute}{sequence}, "
            f"ZeRO {int(row[S.ZERO_STAGE])}{software}: step {row[S.STEP_TIME_S]:.4g} s, MFU {row[S.MFU]:.1%}, "
            f"{fmt_bytes(row[S.PEAK_BYTES])} per GPU ({fits})")


def _software(row) -> Tuple[bool, bool]:
    """Whether a row's products are in fp8 and whether its target compiles (``False`` for a frame
    from before they were columns)."""
    fp8 = S.FLOAT8 in row and str(row[S.FLOAT8]) != NO_FLOAT8
    return fp8, bool(row[S.COMPILED]) if S.COMPILED in row else False


def _mark(x: float, y: float, recompute: str, colour: str, ring: bool, size: float = 5.5,
          software: Tuple[bool, bool] = (False, False)) -> str:
    """A circle (nothing recomputed), a triangle (the attention cores, ``selective``) or a diamond
    (each layer, ``full``), ringed in black on the front; a white dot inside where the products are
    in fp8, a white bar across where the target compiles."""
    fp8, compiled = software
    inner = element("circle", cx=float(x), cy=float(y), r=1.8, fill="#ffffff") if fp8 else ""
    if compiled:
        inner += element("line", x1=x - size * 0.8, x2=x + size * 0.8, y1=y, y2=y, stroke="#ffffff", stroke_width=1.2)
    return _shape(x, y, recompute, colour, ring, size) + inner


def _shape(x: float, y: float, recompute: str, colour: str, ring: bool, size: float) -> str:
    stroke = dict(stroke=FRONT_COLOUR, stroke_width=2) if ring else dict(stroke="#ffffff", stroke_width=1)
    if recompute == "full":
        s = size * 1.3
        points = f"{x:.1f},{y - s:.1f} {x + s:.1f},{y:.1f} {x:.1f},{y + s:.1f} {x - s:.1f},{y:.1f}"
        return element("polygon", points=points, fill=colour, **stroke)
    if recompute == "selective":
        s = size * 1.3
        points = f"{x:.1f},{y - s:.1f} {x + s:.1f},{y + s * 0.8:.1f} {x - s:.1f},{y + s * 0.8:.1f}"
        return element("polygon", points=points, fill=colour, **stroke)
    return element("circle", cx=float(x), cy=float(y), r=float(size), fill=colour, **stroke)


def _colours(frame: pd.DataFrame) -> Dict[str, str]:
    """Each tp x cp x ep x pp group of ``frame`` (the legend's order) and its colour, a function of
    the layout alone (``palette.layout_colour``): a knob that adds or drops layouts recolours none."""
    cps, eps = ([int(v) for v in frame[c]] if c in frame.columns else [1] * len(frame) for c in (S.CP, S.EP))
    layouts = sorted({(int(t), c, e, int(p)) for t, c, e, p in zip(frame[S.TP], cps, eps, frame[S.PP])})
    return {group_name(t, p, c, e): layout_colour(t, p, c, e) for t, c, e, p in layouts}


def _scales(frame: pd.DataFrame, column: str, capacity: float) -> Tuple[float, List[float], List[float], Scale, Scale]:
    """The x axis in the binary unit of the largest peak (KiB, MiB, GiB ...), reaching the capacity
    where it is within three times that peak (beyond, every point fits and the line is noted);
    the y axis from 0."""
    most = float(frame[S.PEAK_BYTES].max())
    reach = max(most, capacity) if capacity <= 3 * most else most
    unit = binary_unit(reach)
    x_ticks = nice_ticks(0.0, reach * 1.05 / unit)
    ys = list(frame[column])
    y_ticks = nice_ticks(0.0, max(ys) * 1.08 if max(ys) > 0 else 1.0)
    to_x = Scale(x_ticks[0] * unit, x_ticks[-1] * unit, LEFT, WIDTH - RIGHT)
    to_y = Scale(y_ticks[0], y_ticks[-1], HEIGHT - BOTTOM, TOP)
    return unit, x_ticks, y_ticks, to_x, to_y


def space_svg(frame: pd.DataFrame, hardware: Hardware, metric: Metric = Metric.STEP_TIME,
              selected: Optional[int] = None, title: str = "") -> str:
    """The scatter of ``frame``'s configurations on ``hardware`` (see the module docstring); the
    row ``selected`` (its position in ``frame``) is drawn larger, with a crosshair."""
    column = METRIC_COLUMNS[Metric(metric)]
    title = title or f"The plan space on {hardware.name} x {hardware.nodes} node(s): {len(frame)} configurations"
    if frame.empty:
        return document(WIDTH, 60, title, label(10, 44, "no configuration to draw", colour=MUTED), "space")
    front = pareto_front(frame).to_numpy()
    colours = _colours(frame)
    unit, x_ticks, y_ticks, to_x, to_y = _scales(frame, column, hardware.memory_bytes)
    y_title = "step time (s), lower is faster" if column == S.STEP_TIME_S else "MFU, higher is better"
    y_fmt = (lambda v: f"{v * 100:.3g}%") if column == S.MFU else (lambda v: f"{v:.3g}")
    x_title = f"peak memory per GPU ({BINARY_BYTES})"
    body = [x_axis([t * unit for t in x_ticks], to_x, TOP, HEIGHT - BOTTOM, x_title, fmt_bytes),
            y_axis(y_ticks, to_y, LEFT, WIDTH - RIGHT, "", y_fmt), label(10, TOP - 14, y_title, size=11, colour=MUTED)]
    capacity = f"{hardware.name} capacity {fmt_bytes(hardware.memory_bytes)}"
    if hardware.memory_bytes <= to_x.hi:
        cap = to_x(hardware.memory_bytes)
        body.append(element("line", tooltip(capacity), x1=cap, x2=cap, y1=TOP, y2=HEIGHT - BOTTOM,
                            stroke=CAPACITY_COLOUR, stroke_width=2, stroke_dasharray="6 4", class_="nbs-capacity"))
        body.append(label(cap - 4, TOP + 12, capacity, size=11, anchor="end", colour=CAPACITY_COLOUR))
    else:
        body.append(label(WIDTH - RIGHT, TOP - 14, f"{capacity}: off the chart, every point fits", size=11,
                          anchor="end", colour=CAPACITY_COLOUR))
    on_front = frame[front].sort_values(S.PEAK_BYTES, kind="stable")
    path = " ".join(f"{to_x(r[S.PEAK_BYTES]):.1f},{to_y(r[column]):.1f}" for _, r in on_front.iterrows())
    body.append(element("polyline", points=path, fill="none", stroke=FRONT_COLOUR, stroke_width=1.2,
                        stroke_dasharray="3 3", class_="nbs-front"))
    order = sorted(range(len(frame)), key=lambda i: (bool(front[i]), i == selected))   # front and pick on top
    for i in order:
        row = frame.iloc[i]
        x, y = to_x(row[S.PEAK_BYTES]), to_y(row[column])
        mark = _mark(x, y, str(row[S.RECOMPUTE]), colours[group_of(row)], bool(front[i]),
                     8.0 if i == selected else 5.5, _software(row))
        hint = describe(row) + (" - on the Pareto front" if front[i] else "")
        body.append(element("g", mark + tooltip(hint), class_="nbs-point nbs-front-point" if front[i] else "nbs-point",
                            data_row=i))
    if selected is not None and 0 <= selected < len(frame):
        row = frame.iloc[selected]
        x, y = to_x(row[S.PEAK_BYTES]), to_y(row[column])
        body.append(element("circle", cx=x, cy=y, r=12.0, fill="none", stroke="#d00000", stroke_width=2,
                            class_="nbs-selected"))
    keys, extra = _legend(colours, _softwares(frame))
    # A legend of more rows than one pushes the plot down by as much (the plot is drawn for one).
    plot = element("g", "".join(body), transform=f"translate(0,{extra:g})") if extra else "".join(body)
    return document(WIDTH, HEIGHT + extra, title, plot + keys, "space")


#: The marks' key after the colour swatches: what each shape and the black ring say.
MARK_KEYS = [("none", False, "layers kept"), ("selective", False, "attention recomputed"),
             ("full", False, "layers recomputed"), ("none", True, "Pareto front")]
#: The key of the software marks, shown where a frame has such rows: fp8 products, a compiled target.
SOFTWARE_KEYS = [((True, False), "fp8 products"), ((False, True), "compiled")]
LEGEND_ROW = 16.0


def _key_width(name: str) -> float:
    """One entry of the marks' key: a mark, a gap, the name at about 6.5 px a character."""
    return 30 + 6.5 * len(name)


def _softwares(frame: pd.DataFrame) -> List[Tuple[Tuple[bool, bool], str]]:
    """The software keys ``frame`` needs: fp8 where some row has fp8 products, compiled where some
    row's target compiles."""
    marks = [_software(row) for _, row in frame.iterrows()]
    return [(flags, name) for flags, name in SOFTWARE_KEYS if any(m[flags.index(True)] for m in marks)]


def _legend(colours: Dict[str, str], softwares: List[Tuple[Tuple[bool, bool], str]] = ()) -> Tuple[str, float]:
    """The legend: the colour groups' swatches in rows as wide as the plot, then the marks' key
    (on the last row where it fits; the software keys of ``softwares`` after it); returns it and
    how far below one row it reaches."""
    rows = legend_rows(list(colours.items()), WIDTH - LEFT - RIGHT)
    out, y = "", 42.0
    for row in rows:
        out += legend(row, LEFT, y)
        y += LEGEND_ROW
    keys = [(recompute, ring, (False, False), name) for recompute, ring, name in MARK_KEYS]
    keys += [("none", False, flags, name) for flags, name in softwares]
    x, y = LEFT + legend_width(rows[-1]) + 10, y - LEGEND_ROW
    if x + sum(_key_width(key[-1]) for key in keys) > WIDTH - RIGHT and rows[-1]:
        x, y = LEFT, y + LEGEND_ROW
    for recompute, ring, flags, name in keys:
        if x + _key_width(name) > WIDTH - RIGHT:             # the key wraps too
            x, y = LEFT, y + LEGEND_ROW
        out += _mark(x + 6, y - 4, recompute, "#bbbbbb", ring, 5.0, flags) + label(x + 16, y, name, size=11, colour=INK)
        x += _key_width(name)
    return out, y - 42.0


class SpaceWidget(anywidget.AnyWidget):
    """The live chart: ``svg`` to show, ``selected`` the row of the mark last clicked."""

    _esm = traitlets.Unicode(frontend_text("space.js")).tag(sync=True)
    _css = traitlets.Unicode(frontend_text("space.css")).tag(sync=True)

    svg = traitlets.Unicode("").tag(sync=True)
    selected = traitlets.Int(None, allow_none=True).tag(sync=True)


def front_rows(frame: pd.DataFrame) -> List[int]:
    """The positions in ``frame`` of the rows on its Pareto front."""
    return [i for i, on in enumerate(pareto_front(frame).to_numpy()) if on]

