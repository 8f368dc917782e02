"""Cost estimates per op, used to balance pipeline stages (and, later, by autodist and the views)."""

from nbscaler.cost.flops import node_flops

__all__ = ["node_flops"]
