"""``PlacedGraphs``: a placed plan as lowering and the cost model read it, in one object.

What a policy has placed is four facts that travel together: the traced graphs by mode, the layout
each weight is stored in (``comm.layout.storage_layouts``), the compute config and the pipeline
geometry. The cost model's passes (``cost.ranks``, ``cost.memory``, ``cost.timing``) take them as
one argument; ``Plan.placed`` is the plan's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from nbscaler.comm.layout import Layout
from nbscaler.config import ComputeConfig
from nbscaler.ir.graph import IRGraph
from nbscaler.schedule import PipelineGeometry


@dataclass(frozen=True, eq=False)
class PlacedGraphs:
    """The graphs of one plan by mode (``'any'``, or ``'train'`` and ``'eval'``), each op placed;
    ``storage``: how each weight is stored; ``config``: the compute config; ``geometry``: the
    pipeline's stages and devices (``None`` without a pipeline)."""

    graphs: Dict[str, IRGraph]
    storage: Dict[str, Layout]
    config: ComputeConfig
    geometry: Optional[PipelineGeometry]
