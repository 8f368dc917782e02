"""Which ops a float8 recipe takes in fp8: the products of ``nn.Linear`` layers (the layers torchao's
``convert_to_float8_training`` converts; the tracer records them in ``graph.meta["linear_modules"]``),
but those of the modules the recipe leaves out (``Recipe.float8_skip``). Code generation prints
these calls as ``float8_linear``; the cost model prices them at the fp8 peak: both ask here.
"""

from __future__ import annotations

from typing import Collection, Sequence

from nbscaler.ir.graph import IRGraph, IRNode, in_module

LINEAR = "torch.nn.functional.linear"


def linear_modules(graph: IRGraph) -> Collection[str]:
    """The module paths of ``graph``'s ``nn.Linear`` layers; a ``ValueError`` naming the fix for a
    graph traced before they were recorded."""
    if "linear_modules" not in graph.meta:
        raise ValueError("this graph was traced before float8 recipes knew which layers are nn.Linear; "
                         "compile (or plan) again with reuse='override' to use Recipe(float8=...).")
    return set(graph.meta["linear_modules"])


def is_linear_layer(node: IRNode, layers: Collection[str]) -> bool:
    """Whether ``node`` is the product of one of the ``nn.Linear`` ``layers``."""
    return node.target == LINEAR and node.module_path in layers


def takes_float8(linear_layer: bool, module_path: str, skip: Sequence[str] = ()) -> bool:
    """Whether a float8 recipe that leaves out the modules ``skip`` takes an op in fp8: a linear
    layer's product outside them."""
    return linear_layer and not any(in_module(module_path, name) for name in skip)
