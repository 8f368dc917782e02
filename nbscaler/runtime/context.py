"""What generated code calls where a plan splits the sequence (``nbscaler.attention`` explains them)."""

from nbscaler.attention import context_attention, context_cross_entropy

__all__ = ["context_attention", "context_cross_entropy"]
