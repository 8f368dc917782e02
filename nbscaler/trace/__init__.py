"""Tracing: run a module's forward once and record its torch calls as an ``IRGraph``."""

from nbscaler.trace.modes import trace_modes
from nbscaler.trace.tracer import TraceError, trace_module

__all__ = ["TraceError", "trace_modes", "trace_module"]
