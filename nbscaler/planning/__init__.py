"""The in-memory compile: ``plan()`` and the ``Plan`` it returns (see ``nbscaler.planning.planner``)."""

from nbscaler.planning.planner import PLAN_FORMAT_VERSION, Plan, plan

__all__ = ["PLAN_FORMAT_VERSION", "Plan", "plan"]
