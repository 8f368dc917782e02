"""The calls generated code makes where a plan splits the vocabulary (``vocab_parallel``): the
embedding's masked lookup and the cross-entropy's partial loss, both from
``nbscaler.runtime.vocab``, each told the first vocabulary entry its device holds."""

from __future__ import annotations

from typing import Dict, Tuple

from nbscaler.codegen.render import render
from nbscaler.ir.graph import IRGraph, IRNode
from nbscaler.ir.layer_rules import vocab_parallel, vocab_share
from nbscaler.ir.shape_rules import arg

FUNCTIONS = {"embedding": "vocab_embedding", "loss": "vocab_cross_entropy"}
"""The function of ``nbscaler.runtime.vocab`` that runs each kind of vocabulary-parallel op."""


def vocab_call(node: IRNode, args: Tuple, index: int, group: str) -> str:
    """The expression the ``index``-th device of vocabulary-parallel ``node``'s group evaluates,
    whose tensor arguments are already rendered in ``args``; ``group`` names that process group."""
    start = index * vocab_share(node)
    fn = FUNCTIONS[node.op]
    if node.op == "embedding":                   # (tokens, weight): a masked lookup, no communication
        return f"{fn}({render(args[0])}, {render(args[1])}, {start})"
    options = f"ignore_index={arg(node, 4, 'ignore_index', -100)!r}, reduction={arg(node, 6, 'reduction', 'mean')!r}"
    return f"{fn}({render(args[0])}, {render(args[1])}, {start}, {group}, {options})"


def vocab_imports(graphs: Dict[int, IRGraph]) -> str:
    """The import line of the vocabulary-parallel functions ``graphs`` call ('' when none)."""
    used = sorted({FUNCTIONS[n.op] for g in graphs.values() for n in g.nodes if vocab_parallel(n)})
    return f"from nbscaler.runtime.vocab import {', '.join(used)}" if used else ""
