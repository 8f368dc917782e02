"""Numbers as people read them on a graph: ``12.3 KB``, ``4.1 GFLOP``-style counts."""

from __future__ import annotations


def human_bytes(n: float) -> str:
    """Bytes with a decimal unit: 0 B, 512 B, 6.1 KB, 12 MB, 3.4 GB."""
    n = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" or abs(n) >= 100 else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def human_count(n: float) -> str:
    """A count with a decimal prefix: 950, 1.2k, 34M, 5.6G, 7.8T."""
    n = float(n)
    for unit in ("", "k", "M", "G"):
        if abs(n) < 1000:
            return f"{n:.0f}{unit}" if unit == "" or abs(n) >= 100 else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}T"
