"""The calls generated code makes where ``Recipe(float8=...)`` takes a linear layer's products in
fp8: ``float8_linear`` from ``nbscaler.runtime.float8`` in place of ``F.linear``, told the recipe
and the process group of each dimension of the product this device holds a slice of::

    linear_1: "f32[4, 16]" = float8_linear(x, self.fc1_weight, self.fc1_bias, scaling='tensorwise', n_group=g0_1)

so that its scales are those of the whole tensors (see ``nbscaler.runtime.float8``).

The layers taken in fp8 are those ``ir.float8_layers`` says: the ``F.linear`` calls of ``nn.Linear``
modules, the layers torchao's ``convert_to_float8_training`` converts, but those of the modules the
recipe leaves out (``Recipe.float8_skip``); other calls of ``F.linear`` keep the module's dtype.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Tuple

from nbscaler.codegen.render import CodegenError, group_var, render
from nbscaler.ir.float8_layers import is_linear_layer, linear_modules, takes_float8
from nbscaler.ir.graph import Axis, IRGraph, IRNode
from nbscaler.recipe import Recipe


def float8_nodes(graph: IRGraph, skip: Sequence[str] = ()) -> Set[str]:
    """The names of ``graph``'s nodes whose products a float8 recipe that leaves out the modules
    ``skip`` takes in fp8."""
    try:
        layers = linear_modules(graph)
    except ValueError as err:
        raise CodegenError(str(err)) from None
    return {n.name for n in graph.nodes if takes_float8(is_linear_layer(n, layers), n.module_path, skip)}


def check_float8(graphs: Dict[str, IRGraph], recipe: Optional[Recipe]) -> None:
    """A float8 recipe needs a layer to take in fp8: a ``CodegenError`` naming the fix if none is."""
    if recipe is None or recipe.float8 is None:
        return
    if not any(float8_nodes(g, recipe.float8_skip) for g in graphs.values()):
        left_out = f" outside {', '.join(recipe.float8_skip)}" if recipe.float8_skip else ""
        raise CodegenError(f"Recipe(float8={recipe.float8.value!r}): the module has no nn.Linear layer{left_out} whose "
                           "products could be taken in fp8; use float8=None, or build the layers as nn.Linear.")


def split_dimensions(node: IRNode) -> List[Tuple[str, Optional[Axis]]]:
    """The dimensions of the product (``m`` rows, ``k`` inner, ``n`` output features) a device holds
    a slice of under ``node``'s placement, each with the axis of the grid it is split along (``None``
    off a grid); empty when the node is whole on every device. The linear annotation is
    ``'* k+, n k+[, n] -> * n'``: its weight's two dimensions name ``n`` and ``k``; any other split
    is of the rows (under context parallelism, the sequence's)."""
    if node.placement is None:
        return []
    out_name, inner_name = node.annotation.inputs[1]
    return [({inner_name: "k", out_name: "n"}.get(view.split, "m"), axis)
            for axis, view in node.placement.views() if view.split is not None]


def float8_call(node: IRNode, args: Tuple, kwargs: Dict, scaling: str, device: int) -> str:
    """The expression ``device`` evaluates for linear ``node`` in fp8: its tensor arguments are
    already rendered in ``args`` / ``kwargs``; each dimension it holds a slice of is told the
    process group it is split over."""
    operands = list(args) + [kwargs[k] for k in ("weight", "bias") if k in kwargs]
    while len(operands) > 2 and operands[-1] is None:
        operands.pop()
    text = ", ".join(render(a) for a in operands)
    place = node.placement
    groups = "".join(f", {dim}_group={group_var(place.group_of(axis, device))}"
                     for dim, axis in split_dimensions(node))
    return f"float8_linear({text}, scaling={str(scaling)!r}{groups})"


def float8_imports(recipe: Optional[Recipe]) -> str:
    """The import line of ``float8_linear`` under a float8 recipe ('' otherwise; ``check_float8``
    makes sure such a recipe has layers to take)."""
    if recipe is None or recipe.float8 is None:
        return ""
    return "from nbscaler.runtime.float8 import float8_linear"
