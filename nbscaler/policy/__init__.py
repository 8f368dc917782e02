"""PAS policies: the primitives (partition, replicate, assign) and the built-in policies."""

from nbscaler.policy.builtin import POLICIES, get_policy
from nbscaler.policy.checks import check_placements, check_stages
from nbscaler.policy.primitives import PolicyError, assign, dim_name, partition, replicate, splittable

__all__ = ["POLICIES", "PolicyError", "check_placements", "check_stages", "assign", "dim_name", "get_policy", "partition", "replicate", "splittable"]
