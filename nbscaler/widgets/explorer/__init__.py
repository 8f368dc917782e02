"""The Explorer: one widget to choose a model, a policy and compute knobs, compile, train on a
cluster, and compare runs in every view. See ``Explorer``."""

from nbscaler.widgets.explorer.app import Explorer
from nbscaler.widgets.explorer.knobs import BuiltinPolicy, Knobs

__all__ = ["BuiltinPolicy", "Explorer", "Knobs"]
