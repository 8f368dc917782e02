"""Positions for a scene, from graphviz ``dot``: only what is on screen is ever laid out.

The scene becomes a small DOT graph (one fixed-size box per shown module or op, one cluster per
open module, one edge per pair of boxes that exchange data) and ``dot -Tjson`` answers with box
centres, cluster rectangles and edge splines. The DOT text depends only on what is shown, not on
bytes or colours, so it is the cache key: the same expansion of the same model is laid out once,
whatever the policy, and the panes of ranks that run the same ops share one layout.

Coordinates are returned in SVG user units (points), y growing downwards.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from nbscaler.widgets.graph.scene import Box, BoxKind, Scene

Point = Tuple[float, float]
Rect = Tuple[float, float, float, float]            # x, y (top left), width, height

BOX_HEIGHT = {BoxKind.MODULE: 46.0, BoxKind.OP: 40.0, BoxKind.IO: 36.0}
FRAME_LABEL_SIZE = 11
_CACHE: "OrderedDict[str, Tuple[GraphLayout, List[str]]]" = OrderedDict()   # DOT text -> (layout, its box keys)
_CACHE_SIZE = 256


class LayoutError(RuntimeError):
    """``dot`` is missing or failed; says how to install graphviz."""


@dataclass
class GraphLayout:
    width: float
    height: float
    boxes: Dict[str, Rect]
    frames: Dict[str, Tuple[Rect, Point]]           # open module -> (rectangle, label position)
    edges: Dict[Tuple[str, str], Tuple[List[Point], Optional[Point]]]   # (src, dst) -> Bezier points, arrow tip


def box_width(box: Box) -> float:
    """Wide enough for the title (12 px) and the subtitle (10 px) in a sans-serif font."""
    return max(84.0, min(240.0, max(len(box.title) * 7.2, len(box.subtitle) * 5.8) + 22))


def to_dot(scene: Scene) -> Tuple[str, List[str]]:
    """The DOT text of a scene, and the box keys in the order of their DOT names (``n0, n1, ...``)."""
    keys = list(scene.boxes)
    name = {k: f"n{i}" for i, k in enumerate(keys)}
    lines = ["digraph G {",
             '  graph [rankdir=TB, nodesep=0.2, ranksep=0.32, margin=0, fontname="Helvetica", '
             f"fontsize={FRAME_LABEL_SIZE}];",
             '  node [shape=box, fixedsize=true, label=""];',
             "  edge [arrowsize=0.6];"]
    frame_ids = {path: i for i, path in enumerate(scene.frames)}

    def member(key: str, indent: str) -> None:
        if key in scene.frames:
            lines.append(f'{indent}subgraph cluster_{frame_ids[key]} {{ label="{_dot_escape(key)}"; labeljust=l; margin=8;')
            for m in scene.frames[key]:
                member(m, indent + "  ")
            lines.append(f"{indent}}}")
        else:
            box = scene.boxes[key]
            lines.append(f"{indent}{name[key]} [width={box_width(box) / 72:.3f}, "
                         f"height={BOX_HEIGHT[box.kind] / 72:.3f}];")

    for key in scene.top:
        member(key, "  ")
    for e in scene.edges:
        lines.append(f"  {name[e.src]} -> {name[e.dst]};")
    lines.append("}")
    return "\n".join(lines), keys


def layout_scenes(scenes: Sequence[Scene]) -> List[GraphLayout]:
    """Lay out several scenes; the ones not cached run through ``dot`` side by side."""
    dots = [to_dot(s) for s in scenes]
    running: Dict[str, subprocess.Popen] = {}
    for text, _ in dots:
        if text not in _CACHE and text not in running:
            running[text] = _start_dot(text)
    for scene, (text, keys) in zip(scenes, dots):
        if text in running:
            proc = running.pop(text)
            out, err = proc.communicate(text)
            if proc.returncode != 0:
                raise LayoutError(f"dot failed ({proc.returncode}): {err.strip()[:500]}")
            _remember(text, _parse(json.loads(out), keys, scene), keys)
    out = []
    for text, keys in dots:
        _CACHE.move_to_end(text)
        layout, cached_keys = _CACHE[text]
        out.append(layout if cached_keys == keys else _rekeyed(layout, cached_keys, keys))
    return out


def _rekeyed(layout: GraphLayout, old: List[str], new: List[str]) -> GraphLayout:
    """A cached layout for a scene of the same shape whose boxes have other keys (the DOT text names
    boxes by position, so two plans' op ids can share one layout)."""
    key = dict(zip(old, new))
    return GraphLayout(layout.width, layout.height, {key[k]: r for k, r in layout.boxes.items()}, layout.frames,
                       {(key[a], key[b]): e for (a, b), e in layout.edges.items()})


def _start_dot(text: str) -> subprocess.Popen:
    exe = shutil.which("dot")
    if exe is None:
        raise LayoutError("graphviz's `dot` is not on PATH; install graphviz (apt-get install graphviz, "
                          "conda install graphviz, or brew install graphviz) to draw the graph")
    return subprocess.Popen([exe, "-Tjson"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _remember(text: str, layout: GraphLayout, keys: List[str]) -> None:
    _CACHE[text] = (layout, keys)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)


def _parse(data: dict, keys: List[str], scene: Scene) -> GraphLayout:
    llx, lly, urx, ury = map(float, data["bb"].split(","))
    height = ury - lly
    flip = lambda x, y: (float(x) - llx, height - (float(y) - lly))
    boxes: Dict[str, Rect] = {}
    frames: Dict[str, Tuple[Rect, Point]] = {}
    frame_paths = list(scene.frames)
    by_gvid: Dict[int, str] = {}
    for obj in data.get("objects", []):
        name = obj.get("name", "")
        if name.startswith("cluster_"):
            x0, y0, x1, y1 = map(float, obj["bb"].split(","))
            (left, top), (right, bottom) = flip(x0, y1), flip(x1, y0)
            lp = flip(*obj["lp"].split(",")) if "lp" in obj else (left + 6, top + 12)
            frames[frame_paths[int(name[len("cluster_"):])]] = ((left, top, right - left, bottom - top), lp)
        elif "pos" in obj:
            key = keys[int(name[1:])]
            cx, cy = flip(*obj["pos"].split(","))
            w, h = float(obj["width"]) * 72, float(obj["height"]) * 72
            boxes[key] = (cx - w / 2, cy - h / 2, w, h)
            by_gvid[obj["_gvid"]] = key
    edges = {}
    for e in data.get("edges", []):
        edges[(by_gvid[e["tail"]], by_gvid[e["head"]])] = _spline(e.get("pos", ""), flip)
    return GraphLayout(urx - llx, height, boxes, frames, edges)


def _spline(pos: str, flip) -> Tuple[List[Point], Optional[Point]]:
    """dot's edge ``pos`` (``e,x,y x,y x,y ...``): the Bezier control points and the arrow tip."""
    points: List[Point] = []
    tip: Optional[Point] = None
    for token in pos.split():
        parts = token.split(",")
        if parts[0] == "e":
            tip = flip(parts[1], parts[2])
        elif parts[0] != "s":
            points.append(flip(parts[0], parts[1]))
    return points, tip


def _dot_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')
