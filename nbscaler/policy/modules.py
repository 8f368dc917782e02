"""How knobs name the modules of a traced model: one vocabulary for every ``pas_config`` key that does.

A name is either

- a **module path** or a pattern over paths (``fnmatch``): ``'blocks'``, ``'blocks.3'``,
  ``'blocks.*.mlp'``. It names the module at that path and everything under it;
- a **class name**: ``'Block'`` names every module whose class is called that.

The paths and classes come from the trace (``graph.meta['module_classes']``); an op belongs to every
module on its ``module_path``:

>>> prefixes("blocks.0.mlp.fc")
['blocks', 'blocks.0', 'blocks.0.mlp', 'blocks.0.mlp.fc']
>>> named_prefix("blocks.0.mlp.fc", "blocks.*", {"blocks.0": "Block"})
'blocks.0'
>>> named_prefix("blocks.0.mlp.fc", "Block", {"blocks.0": "Block"})
'blocks.0'
"""

from __future__ import annotations

import fnmatch
from typing import Dict, Iterable, List, Optional

from nbscaler.ir.graph import IRGraph


def prefixes(path: str) -> List[str]:
    """The paths of the modules an op at ``path`` runs inside, outermost first."""
    parts = path.split(".") if path else []
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def named_prefix(path: str, name: str, classes: Dict[str, str]) -> Optional[str]:
    """The outermost module on ``path`` that ``name`` names (by path, pattern or class), or ``None``."""
    for prefix in prefixes(path):
        if prefix == name or fnmatch.fnmatchcase(prefix, name) or classes.get(prefix) == name:
            return prefix
    return None


def module_classes(graph: IRGraph) -> Dict[str, str]:
    """Module path -> class name, for every sub-module of the traced model."""
    return graph.meta.get("module_classes", {})


def unknown_names(graph: IRGraph, names: Iterable[str]) -> List[str]:
    """The names that name no module any op of ``graph`` runs in."""
    classes = module_classes(graph)
    paths = {n.module_path for n in graph.nodes}
    return [name for name in names if not any(named_prefix(p, name, classes) for p in paths)]


def describe_modules(graph: IRGraph, depth: int = 3, most: int = 16) -> str:
    """The model's modules down to ``depth`` levels, as ``'blocks (ModuleList), blocks.0 (Block), ...'``,
    for error messages that list what a name could have been."""
    classes = module_classes(graph)
    paths = sorted({p for n in graph.nodes for p in prefixes(n.module_path)[:depth]},
                   key=lambda p: [(0, int(s), "") if s.isdigit() else (1, 0, s) for s in p.split(".")])
    shown = [f"{p} ({classes[p]})" if p in classes else p for p in paths[:most]]
    more = f", ... ({len(paths) - most} more)" if len(paths) > most else ""
    return ", ".join(shown) + more
