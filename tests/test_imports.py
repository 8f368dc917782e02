"""Import cycles inside a package: none is longer than two files, and none runs at import time; and
the packages import one another only downwards (``LAYERS``).

Read from the source alone (nothing is imported): every ``import nbscaler.…`` and ``from nbscaler.…
import …`` is an arrow from its file to the file it names, wherever it stands, except under
``if TYPE_CHECKING:``, which names types for annotations and never runs. An arrow runs at import
time when it stands at module level; one inside a function runs later, when it is called. A package here is a top-level package of ``nbscaler``
with all its subpackages (``nbscaler/widgets/**``); the modules directly in ``nbscaler/`` are one
more. Only arrows between files of the same package count.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Dict, Iterator, List, Set, Tuple

ROOT = Path(__file__).resolve().parents[1] / "nbscaler"

# Packages whose cycles are not checked yet, each with the reason.
ALLOWED_CYCLES: Dict[str, str] = {}

# The packages and top-level modules from the bottom up: each imports only from its own row and
# the rows below. The runtime, which runs on every rank, imports only from ``RUNTIME_IMPORTS``.
# Modules in no row (the entry points: parallel, cli, walkthroughs, ...) may import anything.
LAYERS = [
    ("config", "schedule", "blocks", "columns", "genfiles", "layouts", "units", "attention", "losses"),
    ("ir", "experts"),
    ("trace", "comm", "cost"),
    ("policy",),
    ("codegen",),
    ("planning",),
    ("space",),
    ("runtime",),
    ("cluster",),
    ("widgets",),
]
RUNTIME_IMPORTS = {"config", "schedule", "blocks", "columns", "genfiles", "layouts", "units", "attention", "losses",
                   "experts"}

Arrow = Tuple[str, str]


def module_files() -> Dict[str, Path]:
    """Every module of ``nbscaler`` by dotted name (a package by its ``__init__.py``)."""
    files = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join(parts)] = path
    return files


def _imports(statements: List[ast.stmt], at_import: bool = True) -> Iterator[Tuple[ast.stmt, bool]]:
    """Each import statement among ``statements`` and the blocks inside them, with whether it runs
    at import time (imports are statements, so expressions are never walked)."""
    for stmt in statements:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            yield stmt, at_import
        elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _imports(stmt.body, False)
        elif isinstance(stmt, ast.If) and _is_type_checking(stmt.test):
            yield from _imports(stmt.orelse, at_import)        # names for annotations only: no arrow
        else:
            for block in ("body", "orelse", "finalbody"):
                yield from _imports(getattr(stmt, block, []), at_import)
            for handler in getattr(stmt, "handlers", []):
                yield from _imports(handler.body, at_import)
            for case in getattr(stmt, "cases", []):
                yield from _imports(case.body, at_import)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def arrows(files: Dict[str, Path]) -> Dict[Arrow, bool]:
    """Every arrow between two modules of ``nbscaler``, with whether any import behind it runs at
    import time."""
    found: Dict[Arrow, bool] = {}
    for name, path in files.items():
        for stmt, at_import in _imports(ast.parse(path.read_text(), str(path)).body):
            if isinstance(stmt, ast.Import):
                targets = [alias.name for alias in stmt.names]
            elif stmt.level == 0 and stmt.module is not None:
                # ``from a.b import c``: module ``a.b.c`` when it is one, else a name from ``a.b``.
                targets = [f"{stmt.module}.{alias.name}" if f"{stmt.module}.{alias.name}" in files
                           else stmt.module for alias in stmt.names]
            else:
                targets = []
            for target in targets:
                if target in files and target != name:
                    found[name, target] = found.get((name, target), False) or at_import
    return found


@functools.lru_cache(maxsize=None)
def every_arrow() -> Dict[Arrow, bool]:
    """``arrows`` of the whole of ``nbscaler``, read once per test session."""
    return arrows(module_files())


def package_of(module: str) -> str:
    """The top-level package a module belongs to (``nbscaler`` for the modules directly in it)."""
    parts = module.split(".")
    is_package = (ROOT.parent / Path(*parts) / "__init__.py").exists()
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and is_package) else "nbscaler"


def cycles(nodes: Set[str], edges: Set[Arrow]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    succ: Dict[str, List[str]] = {n: [] for n in nodes}
    for a, b in edges:
        succ[a].append(b)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in succ[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(nodes):
        if node not in index:
            visit(node)
    return found


def package_cycles() -> Dict[str, Tuple[List[List[str]], Dict[Arrow, bool]]]:
    """Per package, its cycles and the arrows among its modules."""
    files = module_files()
    every = every_arrow()
    result = {}
    for package in sorted({package_of(m) for m in files}):
        nodes = {m for m in files if package_of(m) == package}
        inside = {arrow: at_import for arrow, at_import in every.items()
                  if arrow[0] in nodes and arrow[1] in nodes}
        result[package] = (cycles(nodes, set(inside)), inside)
    return result


def test_no_import_cycle_inside_a_package_is_longer_than_two_files_or_runs_at_import():
    problems = []
    for package, (found, inside) in package_cycles().items():
        if package in ALLOWED_CYCLES:
            continue
        for component in found:
            if len(component) > 2:
                problems.append(f"{package}: a cycle of {len(component)} files: {', '.join(component)}")
            elif all(inside[a, b] for a, b in ((component[0], component[1]), (component[1], component[0]))):
                problems.append(f"{package}: {component[0]} <-> {component[1]} runs both ways at import time")
    assert not problems, "\n".join(problems)


def test_the_allowed_packages_are_packages():
    packages = {package_of(m) for m in module_files()}
    assert set(ALLOWED_CYCLES) <= packages


def test_packages_import_only_downwards():
    row = {name: i for i, names in enumerate(LAYERS) for name in names}

    def top(module: str) -> str:                    # nbscaler.cost.timing -> cost, nbscaler.blocks -> blocks
        return module.split(".")[1] if "." in module else "nbscaler"

    upwards = []
    for importer, imported in every_arrow():
        a, b = top(importer), top(imported)
        if a == b or a not in row or b not in row:
            continue
        if row[b] > row[a] or (a == "runtime" and b not in RUNTIME_IMPORTS):
            upwards.append(f"{importer} -> {imported}")
    assert not upwards, "imports against the order of LAYERS:\n" + "\n".join(sorted(upwards))
