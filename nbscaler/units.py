"""How nbscaler writes quantities for people: bytes in binary units, counts with SI prefixes,
FLOPs with SI prefixes, seconds as milliseconds. Missing values (``None``, NaN) are written as the empty string.

>>> fmt_bytes(1536), fmt_bytes(1_048_000), fmt_count(2.1e6), fmt_seconds(0.0123), fmt_seconds(2.5)
('1.5 KiB', '0.999 MiB', '2.1M', '12.3 ms', '2.5 s')
>>> fmt_flops(82862208.0), fmt_flops(1.25e12), fmt_flops(512)
('82.9 MFLOP', '1.25 TFLOP', '512 FLOP')
"""

from __future__ import annotations

import math
from typing import Any, Callable

from nbscaler.columns import SummaryColumn as C


def is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def fmt_bytes(n: Any) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    if is_missing(n):
        return ""
    n = float(n)
    if abs(n) < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 999.5 or unit == "TiB":          # 1000 KiB is written 0.977 MiB, not 1e+03 KiB
            return f"{n:.3g} {unit}"
    return f"{n:.3g} TiB"


def binary_unit(n: float) -> float:
    """The binary unit (1, 1024, 1024 ** 2 ...) an axis reaching ``n`` bytes is ticked in: the
    largest not above ``n``, so the ticks read 20, 40, 60 GiB, not 21.5, 42.9, 64.4 GB."""
    return 1024.0 ** max(0, int(math.log(n, 1024))) if n >= 1 else 1.0


def fmt_count(n: Any) -> str:
    """``2.1e6`` -> ``'2.1M'``."""
    if is_missing(n):
        return ""
    n = float(n)
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.3g}"


def fmt_flops(n: Any) -> str:
    """Floating-point operations with an SI prefix: ``82862208`` -> ``'82.9 MFLOP'``."""
    if is_missing(n):
        return ""
    n = float(n)
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale * 0.9995:
            return f"{n / scale:.3g} {unit}FLOP"
    return f"{n:.3g} FLOP"


def fmt_seconds(s: Any) -> str:
    """Seconds as milliseconds below a second: ``0.0123`` -> ``'12.3 ms'``, ``2.5`` -> ``'2.5 s'``."""
    if is_missing(s):
        return ""
    s = float(s)
    return f"{s * 1e3:.3g} ms" if abs(s) < 0.9995 else f"{s:.3g} s"


def unit_formatter(column: str):
    """How a table's numeric ``column`` is written for people, by its name: bytes (``*_bytes``,
    ``bytes_*``), seconds (``*_s``), FLOPs (``*flops*``); ``None`` for a column of none of these."""
    if column.endswith("_bytes") or column.startswith("bytes_"):
        return fmt_bytes
    if "flops" in column:
        return fmt_flops
    if column.endswith("_s") and column != "tokens_per_s":
        return fmt_seconds
    return None


def unit_formatters(frame) -> dict:
    """``DataFrame.to_html``'s ``formatters`` for the numeric columns of ``frame`` that hold bytes,
    seconds or FLOPs, so they print with their units; the frame keeps its numbers."""
    from pandas.api.types import is_numeric_dtype

    return {c: unit_formatter(str(c)) for c in frame.columns
            if unit_formatter(str(c)) is not None and is_numeric_dtype(frame[c])}


def summary_format(column: str) -> Callable[[Any], str]:
    """How a per-rank summary (``plan.summary()``) writes a column's numbers: bytes, seconds, FLOPs,
    tokens a second, yes/no, a share, or a count, each with its unit.

    >>> summary_format("flops")(82862208.0), summary_format("peak_bytes")(1165368), summary_format("mfu")(0.387)
    ('82.9 MFLOP', '1.11 MiB', '38.7%')
    """
    if column in (C.FLOPS, C.HARDWARE_FLOPS) or column.startswith("flops_") or column.endswith("_flops"):
        return fmt_flops
    if column == C.TOKENS_PER_S:
        return lambda v: f"{fmt_count(v)} tokens/s" if not is_missing(v) else ""
    if column == C.FITS:
        return lambda v: "yes" if v else "no"
    if column in (C.MFU, C.HFU):
        return lambda v: f"{float(v):.1%}" if not is_missing(v) else ""
    if column.endswith("_bytes") or column.startswith("bytes_"):
        return fmt_bytes
    return fmt_seconds if column.endswith("_time_s") else fmt_count
