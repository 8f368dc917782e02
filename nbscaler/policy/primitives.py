"""The PAS primitives a policy is written with: partition, replicate, assign.

A policy walks the graph and places every node. Placement is all it decides; the collectives that
move tensors between differently placed nodes follow from it (``nbscaler.comm``).

>>> for node in graph.select(op='linear'):                     # doctest: +SKIP
...     partition(node, 'n', devices=[0, 1])                      # column-parallel
>>> for node in graph.nodes:                                      # doctest: +SKIP
...     if node.placement is None:
...         replicate(node, devices=[0, 1])
"""

from __future__ import annotations

from typing import List, Sequence, Union

from nbscaler.blocks import Blocks, describe, is_strided, normalize, units
from nbscaler.ir.graph import InnerSplit, IRNode, Placement


class PolicyError(ValueError):
    """A policy asked for a placement that cannot work; the message says why."""


def partition(node: IRNode, dim: Union[str, int], devices: Sequence[int], blocks: Blocks = 1) -> IRNode:
    """Split ``node`` along its annotated dimension ``dim`` into ``len(devices)`` parts.

    ``dim`` is a name from the node's annotation (``'n'`` for a linear's output features), or an
    int: the dimension of the node's first input, whose name is looked up for you.
    Device ``devices[i]`` computes part ``i``. ``blocks=3`` splits strided: ``dim`` is three equal
    blocks (q, k, v of a fused projection) and device ``devices[i]`` computes part ``i`` of each;
    ``blocks=(2, 1, 1)`` does the same with blocks of relative sizes 2:1:1 (``nbscaler.blocks``).
    """
    blocks = normalize(blocks)
    devices = tuple(devices)
    if len(set(devices)) != len(devices) or not devices:
        raise PolicyError(f"partition({node.name}): devices {list(devices)} must be distinct and non-empty")
    if node.annotation is None:
        raise PolicyError(f"partition({node.name}): '{node.target}' has no annotation, so it can only be "
                          "replicated; register one with nbscaler.register_op")
    if isinstance(dim, int):
        dim = dim_name(node, 0, dim)
    reason = node.annotation.can_split(dim, len(devices) * units(blocks))
    if reason:
        strided = f" in {describe(blocks)}" if is_strided(blocks) else ""
        raise PolicyError(f"partition({node.name}, {dim!r}, {len(devices)} parts{strided}): {reason}. "
                          f"The op is '{node.annotation}'.")
    node.placement = Placement(devices, dim if len(devices) > 1 else None, blocks if len(devices) > 1 else 1)
    return node


def partition_grid(node: IRNode, outer: str, inner: str, devices: Sequence[int], inner_parts: int) -> IRNode:
    """Split ``node`` along ``outer`` over groups of ``inner_parts`` neighbouring ``devices``, and
    each group's part along ``inner`` over its devices (``Placement.inner``)."""
    devices = tuple(devices)
    groups = len(devices) // inner_parts
    partition(node, outer, devices[::inner_parts])                       # checks ``outer`` into the groups
    reason = node.annotation.can_split(inner, inner_parts) or (None if outer != inner else "it is the outer cut")
    if reason:
        raise PolicyError(f"partition_grid({node.name}, {outer!r}, {inner!r}): {reason}. The op is '{node.annotation}'.")
    node.placement = Placement(devices, outer if groups > 1 else None, 1,
                               InnerSplit(inner, inner_parts) if groups > 1 else None)
    return node


def replicate(node: IRNode, devices: Sequence[int]) -> IRNode:
    """Every device in ``devices`` computes the whole of ``node``."""
    node.placement = Placement(tuple(devices))
    return node


def assign(node: IRNode, device: int) -> IRNode:
    """Run ``node`` whole on one device."""
    return replicate(node, [device])


def dim_name(node: IRNode, input_index: int, dim: int) -> str:
    """The annotated name of dimension ``dim`` of the node's ``input_index``-th tensor input."""
    names = node.annotation.inputs[input_index] if node.annotation else None
    if names is None:
        raise PolicyError(f"{node.name} has no annotated tensor input {input_index}")
    return names[dim % len(names)]


def splittable(node: IRNode, parts: int) -> List[str]:
    """The annotated dimensions along which ``node`` may be split into ``parts``."""
    return node.annotation.splittable(parts) if node.annotation else []
