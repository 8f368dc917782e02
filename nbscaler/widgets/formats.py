"""Text for the views' HTML: quantities as ``nbscaler.units`` writes them, escaped for any page."""

from __future__ import annotations

import html
from typing import Any

from nbscaler.units import fmt_bytes, fmt_count, fmt_seconds, is_missing

__all__ = ["ascii_html", "fmt_bytes", "fmt_count", "fmt_seconds", "is_missing"]


def ascii_html(text: Any) -> str:
    """``text`` escaped for HTML, non-ASCII as character references: right under any charset."""
    return html.escape(str(text)).encode("ascii", "xmlcharrefreplace").decode("ascii")
