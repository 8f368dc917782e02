"""Cost estimates per op and per rank: passes that write ``node.meta``, read by the Plan, the views and autodist."""

from nbscaler.cost.annotate import COST_KEYS, annotate_costs
from nbscaler.cost.flops import node_flops

__all__ = ["COST_KEYS", "annotate_costs", "node_flops"]
