"""What generated code calls where a plan splits the experts (``nbscaler.experts.parallel`` explains them)."""

from nbscaler.experts.parallel import expert_parallel_capacity, expert_parallel_dropless

__all__ = ["expert_parallel_capacity", "expert_parallel_dropless"]
