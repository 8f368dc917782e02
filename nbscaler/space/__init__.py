"""The plan space: every configuration of a run on a target, priced without planning each whole.

``sweep`` and ``PlanSpace`` (``plan_space``) trace a two-layer copy of the model once, place it
once per layout (``layer_facts``, ``op_ledger``) and price each configuration's step from those
facts (``pricing``, ``prune``, ``ranges``); ``pareto`` finds the front, and ``autodist`` on a target
takes the fastest row that fits and plans it whole. It sits above ``nbscaler.planning``: it asks the
planner to compile, and the planner never asks it.
"""

from nbscaler.space.pareto import pareto_front
from nbscaler.space.plan_space import PlanSpace
from nbscaler.space.sweep import config_of, sweep

__all__ = ["PlanSpace", "config_of", "pareto_front", "sweep"]
