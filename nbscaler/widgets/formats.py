"""Text for the views' HTML: quantities as ``nbscaler.units`` writes them, escaped for any page."""

from __future__ import annotations

import html
from typing import Any

from nbscaler.units import binary_unit, fmt_bytes, fmt_count, fmt_flops, fmt_seconds, is_missing

__all__ = ["BINARY_BYTES", "ascii_html", "binary_unit", "fmt_bytes", "fmt_count", "fmt_flops", "fmt_seconds", "is_missing"]

BINARY_BYTES = "1 GiB = 2^30 bytes"
"""What a byte axis says of its unit: every view writes bytes in binary units (``fmt_bytes``),
the GPU's capacity line included, so the axis and the line read in the same unit."""


def ascii_html(text: Any) -> str:
    """``text`` escaped for HTML, non-ASCII as character references: right under any charset."""
    return html.escape(str(text)).encode("ascii", "xmlcharrefreplace").decode("ascii")
