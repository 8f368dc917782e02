"""Where the cost model keeps what it measured once: op profiles and collective calibrations.

``$NBSCALER_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/nbscaler`` (``~/.cache/nbscaler``). Files are
small JSON tables, written atomically, so two processes profiling at once lose at worst a few
entries, never the file.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Dict


def cache_dir() -> Path:
    """The cost model's cache folder (not created here)."""
    if os.environ.get("NBSCALER_CACHE_DIR"):
        return Path(os.environ["NBSCALER_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "nbscaler"


def read_table(path: Path) -> Dict[str, Any]:
    """A JSON object from ``path``; empty when it is missing or unreadable (a cache, not a record)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_table(path: Path, table: Dict[str, Any]) -> None:
    """Merge ``table`` into the JSON object at ``path`` and write it atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    merged = {**read_table(path), **table}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(merged, f)
    os.replace(tmp, path)
