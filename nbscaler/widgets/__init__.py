"""Views over a ``Plan`` for Jupyter: each has a live widget and a self-contained HTML rendering.

Nothing else in ``nbscaler`` imports this package (``nbscaler.cli`` does, lazily, for ``report``).
"""

from nbscaler.widgets.base import Measured, View
from nbscaler.widgets.explorer import Explorer

__all__ = ["Explorer", "Measured", "View"]
