"""Dimension annotations: how an op's tensors line up, and so how the op may be split.

An annotation names every dimension of every tensor the op reads and writes, einops style::

    linear:   '* k+, n k+ -> * n'
    softmax:  '* d^ -> * d^'

- The same name in two places means the same axis: splitting ``n`` into 4 parts splits the weight's
  dim 0 and the output's last dim into 4 matching slices.
- ``+`` marks a *reduction* axis: it is absent from the output, and splitting it leaves each device
  with a partial sum of the output (``k`` above).
- ``^`` marks an axis that must never be split (the softmax axis, a kernel window, ...).
- ``*`` stands for whatever leading axes the tensor has; they become ``*0``, ``*1``, ... and match
  across tensors from the left.

An input axis may hold several equal *blocks* of one name side by side: ``qkv.split(C, dim=2)``
reads an axis of ``3C`` that is three blocks of ``C`` (q, k and v), and writes each block as its own
tensor. ``grouped[(i, name)] = 3`` says so; splitting ``name`` then needs that input split *strided*
(each device holds its share of every block: its own heads of q, k and v), as Megatron splits a fused
qkv projection.

``OpAnnotation.split_layouts(name)`` answers the one question partitioning asks: if this op is split
along ``name``, which dimension of each input and output is split, and are outputs partial?

>>> a = OpAnnotation.parse('* k+, n k+ -> * n', [(8, 3, 16), (32, 16)], [(8, 3, 32)])
>>> a.inputs
[('*0', '*1', 'k'), ('n', 'k')]
>>> a.split_dims('n')
([None, 0], [2])
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

Shape = Tuple[int, ...]
DimNames = Tuple[str, ...]


class AnnotationError(ValueError):
    """An annotation string that does not fit the tensors it describes."""


def _parse_side(text: str, ntensors: int) -> List[List[str]]:
    side = text.strip()
    if not side:        # nothing named: no tensors, or one 0-dim tensor (a scalar loss)
        return [[] for _ in range(ntensors)] if ntensors <= 1 else []
    return [part.split() for part in side.split(",")]


@dataclass
class OpAnnotation:
    """Names for every dimension of an op's tensor inputs (in flattened argument order) and outputs."""

    inputs: List[Optional[DimNames]]
    outputs: List[Optional[DimNames]]
    reduce: FrozenSet[str] = frozenset()
    frozen: FrozenSet[str] = frozenset()
    sizes: Dict[str, int] = field(default_factory=dict)
    grouped: Dict[Tuple[int, str], int] = field(default_factory=dict)   # (input index, name) -> blocks

    # -- construction -----------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str, in_shapes: Sequence[Optional[Shape]],
              out_shapes: Sequence[Optional[Shape]]) -> "OpAnnotation":
        """Read an annotation string against concrete shapes (``None`` for a non-tensor slot)."""
        if "->" not in text:
            raise AnnotationError(f"annotation {text!r} needs '->' between inputs and outputs")
        lhs, rhs = text.split("->")
        sides = (_parse_side(lhs, len(in_shapes)), _parse_side(rhs, len(out_shapes)))
        reduce, frozen = set(), set()
        resolved: List[List[Optional[DimNames]]] = [[], []]
        for side, shapes, out in zip(sides, (in_shapes, out_shapes), resolved):
            if len(side) != len(shapes):
                raise AnnotationError(
                    f"annotation {text!r} names {len(side)} tensors on one side, the op has {len(shapes)}")
            for tokens, shape in zip(side, shapes):
                if shape is None:
                    out.append(None)
                    continue
                names: List[str] = []
                fixed = [t for t in tokens if t != "*"]
                nstar = len(shape) - len(fixed)
                if "*" not in tokens and nstar != 0:
                    raise AnnotationError(f"annotation {' '.join(tokens)!r} has {len(fixed)} dims, tensor has {len(shape)}")
                if nstar < 0:
                    raise AnnotationError(f"annotation {' '.join(tokens)!r} has more dims than the tensor {tuple(shape)}")
                for tok in tokens:
                    if tok == "*":
                        names.extend(f"*{i}" for i in range(nstar))
                        continue
                    name = tok.rstrip("+^")
                    if tok.endswith("+"):
                        reduce.add(name)
                    if tok.endswith("^"):
                        frozen.add(name)
                    names.append(name)
                out.append(tuple(names))
        return cls.build(resolved[0], resolved[1], in_shapes, out_shapes, reduce, frozen)

    @classmethod
    def build(cls, inputs: List[Optional[DimNames]], outputs: List[Optional[DimNames]],
              in_shapes: Sequence[Optional[Shape]], out_shapes: Sequence[Optional[Shape]],
              reduce=(), frozen=(), sizes: Optional[Dict[str, int]] = None,
              grouped: Optional[Dict[Tuple[int, str], int]] = None) -> "OpAnnotation":
        """Make an annotation from name tuples; sizes are read from the shapes and checked.

        ``sizes`` gives the split granularity of names whose dims differ in size on purpose, as in
        a reshape ``(h d) -> h d`` where ``h`` may be split ``n`` ways only if ``n`` divides both.
        """
        frozen = set(frozen)
        if sizes is not None:
            return cls(list(inputs), list(outputs), frozenset(reduce), frozenset(frozen), dict(sizes),
                       dict(grouped or {}))
        sizes = {}
        for names_list, shapes in ((inputs, in_shapes), (outputs, out_shapes)):
            for names, shape in zip(names_list, shapes):
                if names is None or shape is None:
                    continue
                for name, size in zip(names, shape):
                    if sizes.setdefault(name, size) != size:
                        # Broadcasting of a size-1 axis: that axis cannot be split consistently.
                        frozen.add(name)
                        sizes[name] = max(sizes[name], size)
        return cls(list(inputs), list(outputs), frozenset(reduce), frozenset(frozen), sizes, dict(grouped or {}))

    # -- questions partitioning asks ----------------------------------------------------------
    def names(self) -> List[str]:
        seen: Dict[str, None] = {}
        for names in self.inputs + self.outputs:
            for n in names or ():
                seen.setdefault(n)
        return list(seen)

    def can_split(self, name: str, parts: int) -> Optional[str]:
        """``None`` when splitting ``name`` into ``parts`` is valid, else the reason it is not."""
        if name not in self.sizes:
            return f"the op has no dimension named {name!r} (it has {', '.join(self.names()) or 'none'})"
        if name in self.frozen:
            return f"dimension {name!r} must not be split (marked '^')"
        if self.sizes[name] % parts:
            return f"dimension {name!r} has size {self.sizes[name]}, not divisible by {parts}"
        if name not in self.reduce:
            for names in self.outputs:
                if names is not None and name not in names:
                    return f"dimension {name!r} vanishes from an output without being a sum ('+')"
        if all(names is None or name not in names for names in self.inputs):
            return f"dimension {name!r} is not read from any input"
        return None

    def split_dims(self, name: str) -> Tuple[List[Optional[int]], List[Optional[int]]]:
        """For a split along ``name``: the split dim of each input and output (``None``: not split)."""
        def dims(side):
            return [names.index(name) if names is not None and name in names else None for names in side]
        return dims(self.inputs), dims(self.outputs)

    def splittable(self, parts: int) -> List[str]:
        return [n for n in self.names() if self.can_split(n, parts) is None]

    def __str__(self) -> str:
        def fmt(names):
            if names is None:
                return "-"
            return " ".join(n + ("+" if n in self.reduce else "^" if n in self.frozen else "") for n in names)
        return ", ".join(map(fmt, self.inputs)) + " -> " + ", ".join(map(fmt, self.outputs))
