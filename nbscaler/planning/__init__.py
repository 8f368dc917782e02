"""The in-memory compile: ``plan()`` and the ``Plan`` it returns (see ``nbscaler.planning.planner``)."""

from nbscaler.planning.planner import PLAN_FORMAT_VERSION, Plan, plan
from nbscaler.planning.saved import SavedPlanError, load_plan

__all__ = ["PLAN_FORMAT_VERSION", "Plan", "SavedPlanError", "load_plan", "plan"]
