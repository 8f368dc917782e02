"""Where the browser side of the views lives: the one place that knows the path of ``widgets/``.

The ES modules and stylesheets that anywidget loads sit in the top-level ``widgets/`` folder of a
source checkout (an editable install reads them there). A wheel ships the same files as data files
under ``<prefix>/share/nbscaler/widgets`` (``pyproject.toml`` maps them), so both layouts work.

>>> esm = frontend_text("graph.js")          # doctest: +SKIP
"""

from __future__ import annotations

import functools
import site
import sys
import sysconfig
from pathlib import Path
from typing import List

_CHECKOUT = Path(__file__).resolve().parents[2] / "widgets"
_SHARED = Path("share", "nbscaler", "widgets")


def _candidates() -> List[Path]:
    prefixes = [sysconfig.get_path("data"), sys.prefix, getattr(site, "USER_BASE", None)]
    return [_CHECKOUT] + [Path(p) / _SHARED for p in prefixes if p]


@functools.lru_cache(maxsize=None)
def frontend_dir() -> Path:
    """The folder holding the views' ``.js`` and ``.css`` files."""
    for folder in _candidates():
        if folder.is_dir():
            return folder
    raise FileNotFoundError("nbscaler's browser files (widgets/*.js) are missing: looked in "
                            + ", ".join(map(str, _candidates())) + "; reinstall nbscaler (pip install -e .)")


def frontend_text(name: str) -> str:
    """The text of one file of ``widgets/`` (e.g. ``'graph.js'``, ``'graph.css'``)."""
    path = frontend_dir() / name
    if not path.is_file():
        raise FileNotFoundError(f"{name} is not among nbscaler's browser files in {frontend_dir()}")
    return path.read_text(encoding="utf-8")
