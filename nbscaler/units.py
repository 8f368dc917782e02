"""How nbscaler writes quantities for people: bytes in binary units, counts with SI prefixes,
seconds as milliseconds. Missing values (``None``, NaN) are written as the empty string.

>>> fmt_bytes(1536), fmt_count(2.1e6), fmt_seconds(0.0123)
('1.5 KiB', '2.1M', '12.3 ms')
"""

from __future__ import annotations

import math
from typing import Any


def is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def fmt_bytes(n: Any) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    if is_missing(n):
        return ""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} B" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} GiB"


def fmt_count(n: Any) -> str:
    """``2.1e6`` -> ``'2.1M'``."""
    if is_missing(n):
        return ""
    n = float(n)
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def fmt_seconds(s: Any) -> str:
    """Seconds as milliseconds: ``0.0123`` -> ``'12.3 ms'``."""
    if is_missing(s):
        return ""
    return f"{float(s) * 1e3:.3g} ms"
