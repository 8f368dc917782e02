"""What each runtime rank stores: its rows of the weight table, without lowering its code.

A runtime rank plays plan device ``rank % plan_ngpus``. The weights it creates are those its
sections read, at their stored (local) shapes, in the order of the graph's weights: the order of
``module.parameters()`` at run time. ``comm.lower.weight_table`` decides this once, for the rank
files and the cost model alike; this module is the cost model's door to it.
"""

from __future__ import annotations

from typing import List

from nbscaler.comm.lower import rank_sections, train_graph, weight_table
from nbscaler.comm.placed import PlacedGraphs
from nbscaler.comm.program import LocalWeight

__all__ = ["LocalWeight", "local_weights", "train_graph"]


def local_weights(placed: PlacedGraphs, device: int) -> List[LocalWeight]:
    """The weights plan ``device`` stores, in the order the runtime registers them."""
    graphs, geometry = placed.graphs, placed.geometry
    return weight_table(graphs, placed.storage, rank_sections(graphs, device, geometry), geometry)
