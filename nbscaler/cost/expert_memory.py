"""How much of each rank's predicted memory is routed experts' weights, their gradients and their
optimizer state: the part expert parallelism splits over the expert group.

Each rank's share is the bytes of the expert weights it holds (the parameters behind ``w1``, ``w3``,
``w2`` of every routed-experts op, ``nbscaler.ir.expert_rules.expert_weight_sources``; under expert
parallelism its experts alone, ``held_experts``) over the bytes of all the parameters it holds, both as its weight table
stores them. That share of the rank's predicted parameters, gradients and optimizer state
(``plan.memory``) is the experts': exact where every parameter has one dtype, the optimizer keeps
the same state per element and ZeRO pads nothing, close otherwise.
"""

from __future__ import annotations

from typing import Callable, List, Set

import pandas as pd

from nbscaler.columns import SummaryColumn as C
from nbscaler.comm.program import LocalWeight
from nbscaler.ir.graph import IRGraph
from nbscaler.ir.expert_rules import EXPERT_OPS, expert_weight_sources

EXPERT_MEMORY_KINDS = (C.PARAM_BYTES, C.GRAD_BYTES, C.OPTIMIZER_BYTES)
"""The memory categories expert weights take part of: parameters, gradients, optimizer state."""


def expert_weight_names(graph: IRGraph) -> Set[str]:
    """The names of every routed-experts op's expert weights in ``graph`` (the parameters they are read from)."""
    return {t.name for node in graph.nodes if node.target in EXPERT_OPS for t in expert_weight_sources(graph, node)}


def expert_share(weights: List[LocalWeight], names: Set[str]) -> float:
    """The bytes of the parameters named in ``names`` over the bytes of all of ``weights``' parameters."""
    params = [w for w in weights if w.kind == "param"]
    total = sum(w.nbytes for w in params)
    return sum(w.nbytes for w in params if w.name in names) / total if total else 0.0


def expert_memory_per_rank(graph: IRGraph, memory: pd.DataFrame, weights_of: Callable[[int], List[LocalWeight]],
                           device_of: Callable[[int], int]) -> pd.DataFrame:
    """Per runtime rank of ``memory`` (``plan.memory()``'s rows): the bytes of its parameters,
    gradients and optimizer state that are expert weights' (module docstring), in the same columns.
    ``weights_of``: plan device -> its weight table (``plan.programs.weights``); ``device_of``: runtime
    rank -> plan device (``plan.config.device_of``). Zeros for a model without routed experts."""
    names = expert_weight_names(graph)
    shares = [expert_share(weights_of(device_of(int(r))), names) if names else 0.0 for r in memory[str(C.RANK)]]
    out = pd.DataFrame({str(C.RANK): memory[str(C.RANK)].to_numpy()})
    for kind in map(str, EXPERT_MEMORY_KINDS):
        out[kind] = [round(float(v) * s) for v, s in zip(memory[kind], shares)]
    return out
