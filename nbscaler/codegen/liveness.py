"""Free each local of a generated forward after its last use, as a module-by-module forward does.

A generated forward is one flat function, so without help every intermediate it names stays alive
until it returns. A user's model frees them earlier: a block's locals go when the block returns,
and what autograd does not save (a residual branch's output once it is added, an embedding's
lookup) is freed then. In the flat function those tensors all add up at the end of the forward,
where the loss is computed. ``release_dead`` deletes each name right after the statement that uses
it last, so a rank holds only what autograd saved plus what later statements still read.

A statement's uses include the names it reads inside a local function it defines (a recomputed
region), so nothing a later call of that function reads is deleted before the call.
"""

from __future__ import annotations

import ast
from typing import Dict, List


def _stored(stmt: ast.stmt) -> List[str]:
    """Names the statement itself binds (not those bound inside a function it defines)."""
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return []
    targets = stmt.targets if isinstance(stmt, ast.Assign) else getattr(stmt, "target", None)
    if targets is None:
        return []
    names: List[str] = []
    for target in targets if isinstance(targets, list) else [targets]:
        names += [n.id for n in ast.walk(target) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)]
    return names


def release_dead(lines: List[str]) -> List[str]:
    """``lines`` (a function body, unindented) with each local it binds deleted right after the
    statement that uses it last, on that statement's line (``y = f(x);  del x``, as torch.fx writes
    ``x = None``), so the lines keep their numbers.

    Names the final ``return`` reads, or that the body never binds (arguments, globals), are left
    alone; a name last read by a local function's definition is deleted after the call that follows it.
    """
    tree = ast.parse("def _body():\n" + "\n".join("    " + line for line in lines))
    stmts = tree.body[0].body
    last: Dict[str, int] = {}
    bound = set()
    reads: Dict[str, set] = {}          # local function -> the names its body reads
    for i, stmt in enumerate(stmts):
        bound.update(_stored(stmt))
        used = {node.id for node in ast.walk(stmt) if isinstance(node, ast.Name)}
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            reads[stmt.name] = used
            i += 1                      # its own body is no place for a release: the next statement
        for name in used | {n for f in used & reads.keys() for n in reads[f]}:
            last[name] = max(last.get(name, i), i)
    released: Dict[int, List[str]] = {}
    for name in sorted(bound, key=lambda n: (last[n], n)):
        if last[name] < len(stmts) - 1 and not isinstance(stmts[last[name]], ast.Return):
            released.setdefault(last[name], []).append(name)
    out = list(lines)
    for i, names in released.items():
        row, col = stmts[i].end_lineno - 2, stmts[i].end_col_offset - 4      # in ``lines``
        out[row] = f"{out[row][:col]};  del {', '.join(names)}{out[row][col:]}"
    return out
