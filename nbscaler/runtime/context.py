"""What generated code calls where a plan splits the sequence (``nbscaler.attention`` explains it);
the loss of a split sequence is ``nbscaler.runtime.losses.split_cross_entropy``."""

from nbscaler.attention import context_attention

__all__ = ["context_attention"]
