"""One box of a graph pane: what the plan's facts make (``facts``) and a scene arranges (``scene``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple


class BoxKind:
    MODULE = "module"
    OP = "op"
    IO = "io"


@dataclass
class Box:
    """One box of a pane: a collapsed module, an op, or the inputs/outputs of the model."""

    key: str
    kind: str
    title: str
    subtitle: str
    tooltip: str
    shares: List[Tuple[int, float]]                  # (plan device, share), shares add up to 1
    split: str = ""                                   # split marks, e.g. 'n', 'k+', 'n k+'
    inside_bytes: int = 0
    inside_collectives: Dict[str, int] = field(default_factory=dict)
