"""Strided splits: an axis that is several blocks side by side, each block split across devices.

A fused projection writes q, k and v into one axis. Tensor parallelism splits it by heads, so each
device must hold its share of *every* block (its own heads of q, of k and of v), not one contiguous
slice. ``blocks`` says how the axis is made:

- an ``int`` ``k``: ``k`` equal blocks (``qkv.split(C, dim=2)``: 3);
- a tuple of relative sizes: unequal blocks, e.g. ``(2, 1, 1)`` for grouped-query attention with
  twice as many query heads as key/value heads (``qkv.split([2 * C_kv, C_kv, C_kv], dim=2)``).

``1`` is a plain contiguous split. A tuple whose sizes are all equal is written as its length, and
sizes are kept in lowest terms, so one way of cutting an axis has one spelling.

``MIRRORED`` is context parallelism's load-balanced cut of a sequence: two equal halves, device
``i`` of ``n`` holding slice ``i`` of the first and slice ``n-1-i`` of the second, so that it holds
chunks ``i`` and ``2n-1-i`` of ``2n``. Under a causal mask a late chunk attends to more keys than an
early one; each device then has one of each and the same work.

>>> normalize((4, 2, 2)), normalize((8, 8, 8)), block_sizes(64, (2, 1, 1))
((2, 1, 1), 3, [32, 16, 16])

This module is a leaf (torch only): the IR, the policies, code generation and the runtime all cut
tensors the same way through it.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple, Union

import torch

Blocks = Union[int, Tuple[int, ...], str]

MIRRORED = "mirrored"
"""Two halves, the second cut in reverse device order (see the module docstring)."""


def normalize(blocks: Union[Blocks, Sequence[int]]) -> Blocks:
    """The one spelling of ``blocks``: an int for equal blocks, else relative sizes in lowest terms."""
    if isinstance(blocks, int) or blocks == MIRRORED:
        return blocks
    if isinstance(blocks, str):
        raise ValueError(f"blocks {blocks!r}: give an int, relative sizes, or {MIRRORED!r}")
    sizes = tuple(int(b) for b in blocks)
    if len(set(sizes)) <= 1:
        return len(sizes) or 1
    g = math.gcd(*sizes)
    return tuple(s // g for s in sizes)


def units(blocks: Blocks) -> int:
    """How many equal units the axis is cut into: a strided split over ``n`` devices needs the
    axis divisible by ``n * units(blocks)``."""
    if blocks == MIRRORED:
        return 2
    return blocks if isinstance(blocks, int) else sum(blocks)


def is_strided(blocks: Blocks) -> bool:
    return blocks != 1


def block_sizes(length: int, blocks: Blocks) -> List[int]:
    """The sizes of the blocks of an axis of ``length``."""
    if isinstance(blocks, int) or blocks == MIRRORED:
        return [length // units(blocks)] * units(blocks)
    unit = length // units(blocks)
    return [b * unit for b in blocks]


def combine(outer: Blocks, inner: Blocks) -> Blocks:
    """Blocks of blocks: ``outer`` blocks each made of ``inner`` blocks (only where one is plain or
    both are equal blocks)."""
    if outer == 1 or inner == 1:
        return inner if outer == 1 else outer
    if MIRRORED in (outer, inner):
        raise ValueError(f"blocks {outer} of blocks {inner}: a mirrored sequence is not cut into blocks again")
    if isinstance(outer, int) and isinstance(inner, int):
        return outer * inner
    raise ValueError(f"blocks {outer} of blocks {inner}: nested unequal blocks are not supported")


def divide(have: Blocks, own: Blocks) -> Optional[Blocks]:
    """The blocks left of ``have`` once an op reads ``own`` blocks of them as its pieces (``None``:
    the two do not line up)."""
    if own == 1:
        return have
    if have == own:
        return 1
    if MIRRORED in (have, own):
        return None
    if isinstance(have, int) and isinstance(own, int) and have % own == 0:
        return have // own
    return None


def describe(blocks: Blocks) -> str:
    """``'3 blocks'``, ``'blocks 2:1:1'`` or ``'mirrored halves'``, for messages and plan tables."""
    if blocks == MIRRORED:
        return "mirrored halves"
    return f"{blocks} blocks" if isinstance(blocks, int) else "blocks " + ":".join(map(str, blocks))


def ranges(length: int, blocks: Blocks, parts: int, index: int) -> List[Tuple[int, int]]:
    """The ``[start, stop)`` ranges of an axis of ``length`` that part ``index`` of ``parts`` holds:
    one per block, in order (as ``torch.chunk`` cuts each block). A file read by slices reads these.

    >>> ranges(64, (2, 1, 1), 2, 1)
    [(16, 32), (40, 48), (56, 64)]
    """
    out, start = [], 0
    for b, size in enumerate(block_sizes(length, blocks)):
        step = -(-size // parts)                  # torch.chunk's chunk size
        part = parts - 1 - index if blocks == MIRRORED and b % 2 else index
        lo = min(size, part * step)
        out.append((start + lo, start + min(size, lo + step)))
        start += size
    return out


def take(full: torch.Tensor, dim: int, blocks: Blocks, parts: int, index: int) -> torch.Tensor:
    """Part ``index`` of ``parts`` of each block of ``full`` along ``dim``, concatenated."""
    pieces = [full.narrow(dim, lo, hi - lo) for lo, hi in ranges(full.shape[dim], blocks, parts, index)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def join(slices: Sequence[torch.Tensor], dim: int, blocks: Blocks) -> torch.Tensor:
    """The full tensor from every part's slice, in part order (the inverse of ``take``)."""
    if blocks == 1:
        return torch.cat(list(slices), dim=dim)
    per_slice = [s.split(block_sizes(s.shape[dim], blocks), dim=dim) for s in slices]
    nblocks = len(per_slice[0])
    return torch.cat([p[b] for b in range(nblocks) for p in _in_block_order(per_slice, blocks, b)], dim=dim)


def _in_block_order(per_slice: List, blocks: Blocks, b: int) -> List:
    """The parts' pieces of block ``b`` in the order they lie in it (reversed in a mirrored second half)."""
    return per_slice[::-1] if blocks == MIRRORED and b % 2 else per_slice
