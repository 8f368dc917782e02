"""The table behind the op registry: call target -> ``OpSpec``, and ``register`` to add entries.

The registry (``registry``) and the model families' ops (``model_ops``) both fill it, so it sits
below both of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

from nbscaler.ir.shape_rules import Annotator


@dataclass(frozen=True)
class OpSpec:
    """How one op partitions."""

    name: str
    annotate: Annotator
    shape_args: bool = False      # its arguments spell out the output shape (view, reshape, expand)


_REGISTRY: Dict[str, OpSpec] = {}


def spec_of(target: str) -> Optional[OpSpec]:
    """The spec registered for call target ``target`` (``None`` when there is none)."""
    return _REGISTRY.get(target)


def register(targets: str, name: str, annotate: Annotator, shape_args: bool = False) -> None:
    """Register ``annotate`` under ``name`` for each of the space-separated call ``targets``
    (a later registration of a target replaces an earlier one)."""
    spec = OpSpec(name, annotate, shape_args)
    for t in targets.split():
        _REGISTRY[t] = spec
