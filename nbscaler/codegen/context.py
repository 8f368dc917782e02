"""The calls generated code makes where a plan splits the tokens (``context_parallel``): attention
over every device's keys (``nbscaler.runtime.context``), the loss of this device's tokens
(``nbscaler.runtime.losses``, also where the batch is split), and the comment that says which
chunks of the sequence a device holds."""

from __future__ import annotations

from typing import Any, Dict, Tuple

from nbscaler.attention.online import held_chunks, ring_source
from nbscaler.codegen.render import group_var, render_call
from nbscaler.ir.graph import CONTEXT_KIND, Axis, IRGraph, IRNode
from nbscaler.ir.layer_rules import context_parallel, vocab_group, vocab_parallel, vocab_share

FUNCTIONS = {"attention": "context_attention", "loss": "split_cross_entropy"}
"""The function that runs each kind of op split along its tokens: attention from
``nbscaler.runtime.context``, the loss from ``nbscaler.runtime.losses``."""
MODULES = {"context_attention": "nbscaler.runtime.context", "split_cross_entropy": "nbscaler.runtime.losses"}


def context_call(node: IRNode, args: Tuple, kwargs: Dict[str, Any], group: str, device: int) -> str:
    """The expression generated code evaluates for context-parallel ``node`` over rendered arguments
    on ``device``; ``group`` names the process group its tokens are split over."""
    place = node.placement
    fn = FUNCTIONS[context_parallel(node)]
    call = render_call(node, args, kwargs)           # F.name(arguments)
    inner = call[call.index("(") + 1:-1]
    if fn == "split_cross_entropy":
        if not vocab_parallel(node):
            return f"{fn}({inner}, group={group})"
        # its logits split by their classes too: this device's share of each token's loss
        classes = vocab_group(node, device)
        return (f"{fn}({inner}, group={group}, vocab_start={classes.index(device) * vocab_share(node)}, "
                f"vocab_group={group_var(classes)})")
    return f"{fn}({inner}, kind={node.meta[CONTEXT_KIND]!r}, blocks={place.blocks!r}, group={group})"


def chunk_comment(node: IRNode, group: Tuple[int, ...], device: int) -> str:
    """``# this device's queries: positions 0:4 and 28:32 of 32 (chunks 0 and 7 of 8)``, for
    ``device`` of the context-parallel ``group``."""
    place = node.placement
    length = node.inputs[0].shape[-2]
    index, parts = group.index(device), len(group)
    held = held_chunks(length, place.blocks, parts, index)
    size = held[0][2] - held[0][1]
    where = " and ".join(f"{lo}:{hi}" for _, lo, hi in held)
    chunks = " and ".join(str(c) for c, _, _ in held) if size else "none"
    how = {"ring": "the keys and values pass round the ring of the group, one device's block a step",
           "all_gather": "the keys and values arrive whole"}[node.meta[CONTEXT_KIND]]
    line = (f"# context parallel: this device's queries are positions {where} of {length} (chunks {chunks} of "
            f"{length // size if size else 0}); {how}")
    if place.inner is not None and place.inner.name is not None:       # tensor parallel inside the group
        pair = place.axis_group(Axis.INNER, device)
        line += (f"\n# tensor parallel inside: devices {list(pair)} split this attention's heads between them, each "
                 f"with its own context-parallel group (this device's: {list(group)})")
    if node.meta[CONTEXT_KIND] != "ring" or not size:
        return line
    steps = []
    for step in range(parts):
        source = ring_source(index, step, parts)
        theirs = " and ".join(str(c) for c, _, _ in held_chunks(length, place.blocks, parts, source))
        whose = "its own chunks" if step == 0 else f"device {group[source]}'s chunks"
        steps.append(f"{step}: {whose} {theirs}")
    return line + "\n# ring steps, each computing against the block in hand while passing it on: " + "; ".join(steps)


def context_imports(graphs: Dict[int, IRGraph]) -> str:
    """The import lines of the functions ``graphs`` call for ops split along their tokens ('' when none)."""
    used = sorted({FUNCTIONS[kind] for g in graphs.values() for n in g.nodes for kind in [context_parallel(n)] if kind})
    return "\n".join(f"from {MODULES[fn]} import {fn}" for fn in used)
