"""Draw a laid-out scene as SVG: the one drawing used live (the widget inserts it) and saved (``to_html``).

Colours and strokes are SVG attributes, not CSS, so the drawing looks the same where a page strips
stylesheets (GitHub's notebook preview). Every box carries ``data-key`` (and ``data-node`` for an
op) and every open module's frame ``data-key``, which is all the browser side needs to make
clicks expand, collapse and select.
"""

from __future__ import annotations

import math
from html import escape
from typing import List, Optional, Sequence, Tuple

from nbscaler.glossary import GLOSSARY_URL, legend
from nbscaler.widgets.graph.layout import GraphLayout, Point
from nbscaler.widgets.graph.scene import Box, BoxKind, Edge, Scene
from nbscaler.widgets.formats import fmt_bytes

#: One colour per plan device (Tableau 10); devices beyond ten reuse them.
DEVICE_COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
                  "#9c755f", "#bab0ac"]
EDGE_COLOUR, QUIET_EDGE = "#b5483b", "#9aa0a6"
FONT = "Helvetica, Arial, sans-serif"
MAX_EDGE_WIDTH = 9.0


def device_colour(device: int) -> str:
    return DEVICE_COLOURS[device % len(DEVICE_COLOURS)]


def tint(colour: str, amount: float = 0.82) -> str:
    """``colour`` mixed with white (``amount`` of white)."""
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    mix = lambda c: round(c + (255 - c) * amount)
    return f"#{mix(r):02x}{mix(g):02x}{mix(b):02x}"


def edge_width(nbytes: int, max_bytes: int) -> float:
    """1 px for an edge nothing crosses, then proportional to the bytes up to ``MAX_EDGE_WIDTH``."""
    if nbytes <= 0 or max_bytes <= 0:
        return 1.0
    return 1.5 + (MAX_EDGE_WIDTH - 1.5) * nbytes / max_bytes


def scene_svg(scene: Scene, layout: GraphLayout, max_bytes: int, pane: str = "logical", pad: float = 6.0) -> str:
    """The SVG element of one pane."""
    w, h = layout.width + 2 * pad, layout.height + 2 * pad
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" class="nbs-graph-svg" data-pane="{escape(pane)}" '
             f'width="{w:.0f}" height="{h:.0f}" viewBox="{-pad:.1f} {-pad:.1f} {w:.1f} {h:.1f}" '
             f'font-family="{FONT}">']
    frames = sorted(layout.frames.items(), key=lambda kv: -kv[1][0][2] * kv[1][0][3])
    parts += [_frame(path, rect, lp) for path, (rect, lp) in frames]
    for e in scene.edges:
        spline = layout.edges.get((e.src, e.dst))
        if spline is not None:
            parts.append(_edge(e, spline[0], spline[1], max_bytes))
    parts += [_box(scene.boxes[key], rect) for key, rect in layout.boxes.items()]
    parts.append("</svg>")
    return "".join(parts)


def _frame(path: str, rect: Tuple[float, float, float, float], lp: Point) -> str:
    x, y, w, h = rect
    return (f'<g class="nbs-frame" data-key="{escape(path)}"><title>{escape(path)}: click the label to collapse'
            f'</title><rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="7" fill="#f5f6fa" '
            f'fill-opacity="0.7" stroke="#a9b0c2"/><text class="nbs-frame-label" x="{lp[0]:.1f}" y="{lp[1] + 4:.1f}" '
            f'text-anchor="middle" font-size="11" fill="#4a5068">&#9662; {escape(path)}</text></g>')


def _box(box: Box, rect: Tuple[float, float, float, float]) -> str:
    x, y, w, h = rect
    node = f' data-node="{box.key[1:]}"' if box.kind == BoxKind.OP else ""
    alone = [d for d, share in box.shares if share > 0.999]       # tinted only when one device runs it all
    fill = tint(device_colour(alone[0])) if alone else "#f1f3f4" if box.shares else "#ffffff"
    dash = ' stroke-dasharray="4 3"' if box.kind == BoxKind.IO else ""
    out = [f'<g class="nbs-box nbs-{box.kind}" data-key="{escape(box.key)}"{node}>',
           f"<title>{escape(box.tooltip)}</title>",
           f'<rect class="nbs-body" x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" rx="5" '
           f'fill="{fill}" stroke="#5f6368" stroke-width="1"{dash}/>']
    left = x + 1.5
    for device, share in box.shares:            # the placement bar: each device's share of the box
        out.append(f'<rect class="nbs-device" x="{left:.1f}" y="{y + 1.5:.1f}" width="{share * (w - 3):.1f}" '
                   f'height="5" fill="{device_colour(device)}"><title>device {device}: {share:.0%}</title></rect>')
        left += share * (w - 3)
    weight = ' font-weight="600"' if box.kind != BoxKind.IO else ""
    out.append(f'<text x="{x + 8:.1f}" y="{y + 20:.1f}" font-size="12" fill="#202124"{weight}>{escape(box.title)}</text>')
    out.append(f'<text x="{x + 8:.1f}" y="{y + 33:.1f}" font-size="10" fill="#5f6368">{escape(box.subtitle)}</text>')
    if box.split:
        out.append(f'<text class="nbs-split" x="{x + w - 6:.1f}" y="{y + 19:.1f}" text-anchor="end" font-size="11" '
                   f'font-style="italic" fill="#8e24aa">{escape(box.split)}</text>')
    if box.kind == BoxKind.MODULE:
        out.append(f'<text x="{x + w - 6:.1f}" y="{y + h - 6:.1f}" text-anchor="end" font-size="12" '
                   f'fill="#5f6368">+</text>')
    if box.inside_bytes:
        names = "/".join(sorted(box.inside_collectives))
        out.append(f'<text x="{x + w - 18:.1f}" y="{y + h - 6:.1f}" text-anchor="end" font-size="9" fill="{EDGE_COLOUR}">'
                   f'⇄ {fmt_bytes(box.inside_bytes)}<title>inside: {escape(names)}</title></text>')
    out.append("</g>")
    return "".join(out)


def _edge(e: Edge, points: List[Point], tip: Optional[Point], max_bytes: int) -> str:
    if not points:
        return ""
    width = edge_width(e.bytes, max_bytes)
    colour = EDGE_COLOUR if e.collectives else QUIET_EDGE
    d = f"M{points[0][0]:.1f},{points[0][1]:.1f}" + "".join(
        f" C{_pt(points[i])} {_pt(points[i + 1])} {_pt(points[i + 2])}" for i in range(1, len(points) - 2, 3))
    names = " · ".join(f"{k}" for k in sorted(e.collectives))
    title = f"{e.tensors} tensor(s)" + (f"; {names}: {fmt_bytes(e.bytes)} per device" if e.collectives else "")
    out = [f'<g class="nbs-edge" data-src="{escape(e.src)}" data-dst="{escape(e.dst)}" data-bytes="{e.bytes}">',
           f"<title>{escape(title)}</title>",
           f'<path d="{d}" fill="none" stroke="{colour}" stroke-width="{width:.2f}" stroke-opacity="0.85"/>']
    if tip is not None:
        out.append(_arrow(points[-1], tip, colour, width))
    if e.collectives:
        mx, my = points[len(points) // 2]
        out.append(f'<text class="nbs-edge-label" x="{mx + 5:.1f}" y="{my + 3:.1f}" font-size="9" fill="{EDGE_COLOUR}" '
                   f'stroke="#ffffff" stroke-width="3" paint-order="stroke">{escape(names)} {fmt_bytes(e.bytes)}</text>')
    out.append("</g>")
    return "".join(out)


def _arrow(base: Point, tip: Point, colour: str, width: float) -> str:
    dx, dy = tip[0] - base[0], tip[1] - base[1]
    length = math.hypot(dx, dy) or 1.0
    ux, uy = dx / length, dy / length
    half = max(3.0, width * 0.9)
    left = (base[0] - uy * half, base[1] + ux * half)
    right = (base[0] + uy * half, base[1] - ux * half)
    return f'<polygon points="{_pt(tip)} {_pt(left)} {_pt(right)}" fill="{colour}"/>'


def _pt(p: Point) -> str:
    return f"{p[0]:.1f},{p[1]:.1f}"


def legend_html(devices: Sequence[int], splits: Sequence[Tuple] = ()) -> str:
    """A link to the glossary with the readable name of each split label the graph shows
    (``(label, op)`` pairs, or ``(label, op, context)``: ``glossary.legend``), then swatches for the devices, and what edge widths and marks mean."""
    names = legend(splits)
    glossary = (f'<div class="nbs-glossary"><a href="{GLOSSARY_URL}" target="_blank">glossary of split and '
                f'layout labels</a>{": " + escape(names) if names else ""}</div>')
    swatches = "".join(f'<span class="nbs-swatch"><span style="display:inline-block;width:10px;height:10px;'
                       f'background:{device_colour(d)};margin-right:3px;border-radius:2px"></span>device {d}</span> '
                       for d in devices)
    return (f'<div class="nbs-legend" style="font:11px {FONT};color:#444;margin:4px 0">{glossary}{swatches}'
            f'<span style="margin-left:8px">bar: placement · <i style="color:#8e24aa">n</i>, '
            f'<i style="color:#8e24aa">k+</i>: split label (+ partial sums) · edge width ∝ bytes each device sends '
            f'per step · ⇄ collectives inside a box</span></div>')
