"""The views' colours and names for what their charts draw: the one place both renderings ask.

A chart view draws the same data twice, as a plotly figure (live, interactive) and as an SVG that
nbscaler writes itself (saved notebooks, GitHub, nbviewer); both read their colours and legend
names here, so the two always agree.
"""

from __future__ import annotations

import colorsys
import math
from typing import Dict, List

from nbscaler.columns import SummaryColumn as C
from nbscaler.glossary import EXPERT_ALL_TO_ALLS

PHASE_COLOURS: Dict[str, str] = {"F": "#4c78a8", "B": "#f58518", "W": "#54a24b"}
"""A pipeline block's colour by phase (forward, backward, weight gradients)."""
PHASE_NAMES: Dict[str, str] = {"F": "forward", "B": "backward", "W": "weight gradients"}
COLLECTIVE_COLOURS: Dict[str, str] = {"all_gather": "#72b7b2", "reduce_scatter": "#b279a2", "all_reduce": "#e45756",
                                      "ring_pass": "#eeca3b", "expert_exchange": "#9d755d", "expert_counts": "#ff9da6"}
"""A collective's colour in a timeline's collectives lane (``Timeline.collectives``): ZeRO stage 3's,
the data-parallel gradient synchronisation's buckets, context parallelism's (a ring attention's
passes; all-gathered keys and values) and expert parallelism's all-to-alls (rows, counts)."""
COLLECTIVE_NAMES: Dict[str, str] = {"all_gather": "all-gather", "reduce_scatter": "reduce-scatter",
                                    "all_reduce": "all-reduce", "ring_pass": "ring pass (context parallel)",
                                    **{t.label: t.name for t in EXPERT_ALL_TO_ALLS}}
OTHER_COLOUR = "#999999"
"""A phase or kind the tables above do not name."""
IDLE_COLOUR = "#eeeeee"
"""Where a rank waits: the bubble of a timeline."""

MEMORY_LABELS: Dict[str, str] = {C.PARAM_BYTES: "parameters", C.GATHERED_BYTES: "gathered parameters (ZeRO-3)",
                                 C.GRAD_BYTES: "gradients",
                                 C.OPTIMIZER_BYTES: "optimizer state", C.BUFFER_BYTES: "buffers",
                                 C.ACTIVATION_BYTES: "activations"}
"""The legend name of each memory category (``nbscaler.columns.MEMORY_CATEGORIES``)."""
MEMORY_COLOURS: Dict[str, str] = {C.PARAM_BYTES: "#4c78a8", C.GATHERED_BYTES: "#9ecae9", C.GRAD_BYTES: "#f58518", C.OPTIMIZER_BYTES: "#54a24b",
                                  C.BUFFER_BYTES: "#b279a2", C.ACTIVATION_BYTES: "#e45756"}

EXPERT_MEMORY_LABELS: Dict[str, str] = {C.PARAM_BYTES: "expert weights", C.GRAD_BYTES: "expert gradients",
                                        C.OPTIMIZER_BYTES: "expert optimizer state"}
"""The legend name of the part of a memory category that is routed experts' (``cost.expert_memory``)."""
EXPERT_MEMORY_COLOURS: Dict[str, str] = {C.PARAM_BYTES: "#27466b", C.GRAD_BYTES: "#a3560c",
                                         C.OPTIMIZER_BYTES: "#2e6228"}
"""A darker shade of its category's colour, drawn at the bottom of the category's segment."""

CAPACITY_COLOUR = "#333333"
"""The line at a target GPU's memory capacity."""
OVER_CAPACITY_COLOUR = "#d00000"
"""The outline and marks of a rank whose predicted memory exceeds that capacity."""

RANK_COLOURS: List[str] = ["#4c78a8", "#f58518", "#54a24b", "#e45756", "#72b7b2", "#eeca3b", "#b279a2", "#ff9da6"]
"""One colour per rank, for charts with a line per rank (the loss curve)."""


def rank_colour(rank: int) -> str:
    """The colour of ``rank``'s line (the list repeats past eight ranks)."""
    return RANK_COLOURS[int(rank) % len(RANK_COLOURS)]


LAYOUT_HUES: List[float] = [215.0, 30.0, 125.0, 355.0, 275.0, 50.0, 180.0]
"""The hue (degrees) of tensor-parallel size 1, 2, 4, 8, 16, 32, 64 in the plan space."""


EXPERT_HUE = 310.0
"""The hue (degrees) of every expert-parallel layout: magenta, which no tensor-parallel size takes."""


def layout_colour(tp: int, pp: int, cp: int = 1, ep: int = 1) -> str:
    """The colour of a tp x cp x ep x pp layout, the same in every chart whatever else it draws: the
    hue says the tensor-parallel size (a power of two takes its own; 3, 6, 12 ... the nearest one's,
    turned 20 degrees), or ``EXPERT_HUE`` where ``ep > 1``; the shade the pipeline stages (darkest
    at 1, lighter at each doubling), and the saturation the context- or expert-parallel size (full
    at 1, and at ep 2; halved at each doubling), so a cp or ep layout never shares a tp layout's
    colour."""
    if int(tp) < 1 or int(pp) < 1 or int(cp) < 1 or int(ep) < 1:
        raise ValueError(f"layout_colour(tp={tp}, pp={pp}, cp={cp}, ep={ep}): all must be whole numbers >= 1.")
    steps = math.log2(int(tp))
    hue = LAYOUT_HUES[round(steps) % len(LAYOUT_HUES)] + (0.0 if steps.is_integer() else 20.0)
    if int(ep) > 1:
        hue = EXPERT_HUE
    lightness = min(0.34 + 0.10 * math.log2(int(pp)), 0.84)
    saturation = 0.70 / int(cp) / max(int(ep) // 2, 1)
    r, g, b = colorsys.hls_to_rgb((hue % 360.0) / 360.0, lightness, saturation)
    return "#{:02x}{:02x}{:02x}".format(*(round(255 * c) for c in (r, g, b)))
