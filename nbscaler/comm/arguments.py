"""A call's arguments as one device makes them: the numbers a split changes.

Most calls read the same arguments on every device, their tensors aside. A few spell out a size
the split changes: a strided ``split``'s sizes, a grouped convolution's ``groups``, and the shape
a ``view``, ``reshape`` or ``expand`` is asked for. Code generation prints the arguments this
module gives, and the cost model calls the op with them on fake tensors, so the two never differ.

>>> local_arguments(reshape_node, (x, (4, 6, 4, 8)), {}, out_shape=(4, 6, 2, 8))   # doctest: +SKIP
((x, (4, 6, 2, 8)), {})
"""

from __future__ import annotations

from typing import Sequence, Tuple

from nbscaler.ir.graph import IRNode
from nbscaler.ir.registry import spec_of


def local_arguments(node: IRNode, args: tuple, kwargs: dict, out_shape: Sequence[int]) -> Tuple[tuple, dict]:
    """The ``(args, kwargs)`` one device calls ``node``'s function with (its tensors already the
    local ones): ``local_call``'s numbers, and for a call whose arguments spell out its output's
    shape (``view``, ``reshape``, ``expand``) the local ``out_shape`` the rank's program holds."""
    args, kwargs = local_call(node, args, kwargs)
    spec = spec_of(node.target)
    if spec is not None and spec.shape_args:
        args = (args[0], tuple(out_shape))
        kwargs = {k: v for k, v in kwargs.items() if k not in ("shape", "size")}
    return args, kwargs


def local_call(node: IRNode, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
    """The ``(args, kwargs)`` one device calls ``node``'s function with, where a split changes a
    number in the call: the sizes of a strided ``split`` (``local_split_sizes``) and the ``groups``
    of a grouped convolution split in whole groups (``conv2d(..., groups=C)`` on 2 devices becomes
    ``groups=C // 2``)."""
    args = local_split_sizes(node, args)
    place = node.placement
    if node.op != "conv" or place is None or place.split != "g":
        return args, kwargs
    if "groups" in kwargs:
        return args, {**kwargs, "groups": kwargs["groups"] // place.parts}
    return args[:6] + (args[6] // place.parts,) + args[7:], kwargs


def local_split_sizes(node: IRNode, args: tuple) -> tuple:
    """``args`` of a ``split`` whose split axis is itself split (equal blocks, strided): each
    device splits its share, so the sizes shrink by the number of parts (``qkv.split(C)`` becomes
    ``qkv.split(C // 2)`` on 2 devices). Any other call's ``args`` come back unchanged."""
    if node.op != "split" or node.placement is None or not node.target.endswith(".split"):
        return args         # chunk, tensor_split, unbind: counts of pieces, the same on every device
    for _, place in node.placement.views():         # over a grid, the axis that splits the blocks
        if (0, place.split) not in node.annotation.grouped:
            continue
        sizes = args[1] if len(args) > 1 else None
        if isinstance(sizes, int):
            return (args[0], sizes // place.parts) + tuple(args[2:])
        if isinstance(sizes, (list, tuple)):
            return (args[0], type(sizes)(s // place.parts for s in sizes)) + tuple(args[2:])
    return args
