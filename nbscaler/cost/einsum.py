"""What an ``einsum`` computes, read from its equation: its axes, its FLOPs, its operands.

``torch.einsum`` is not in the op registry (it runs whole on every device), so its annotation
says nothing; its equation says everything the cost model needs. Each letter names an axis; a
letter on the left that the output lacks is summed. torch contracts the operands left to right,
two at a time (without ``opt_einsum``), each pair keeping the letters a later operand or the
output still needs; contracting a pair costs one multiply and one add per point of the space of
their letters (one multiply when nothing is summed). ``...`` stands for the broadcast leading axes.

>>> einsum_flops("bik,bkj->bij", [(8, 64, 32), (8, 32, 16)])
524288.0
"""

from __future__ import annotations

import math
import string
from typing import Dict, List, Sequence, Tuple

EINSUM_TARGET = "torch.einsum"


def _expand(term: str, ndim: int, spare: str) -> str:
    """``term`` with ``...`` replaced by the last of the ``spare`` letters it spans (broadcasting
    aligns the axes ``...`` stands for from the right)."""
    if "..." not in term:
        return term
    own = ndim - (len(term) - 3)
    return term.replace("...", spare[len(spare) - own:])


def einsum_axes(equation: str, shapes: Sequence[Sequence[int]]) -> Tuple[List[str], str, Dict[str, int]]:
    """The letters of each operand, of the output, and each letter's size (the largest: a size-1
    axis broadcasts), ``...`` spelt out and an implicit output (no ``->``) made explicit."""
    eq = equation.replace(" ", "")
    lhs, _, rhs = eq.partition("->")
    terms = lhs.split(",")
    span = max((len(s) - (len(t) - 3) for t, s in zip(terms, shapes) if "..." in t), default=0)
    spare = "".join(c for c in string.ascii_letters if c not in eq)[:span]      # letters "..." stands for
    inputs = [_expand(t, len(s), spare) for t, s in zip(terms, shapes)]
    sizes: Dict[str, int] = {}
    for term, shape in zip(inputs, shapes):
        for letter, n in zip(term, shape):
            sizes[letter] = max(sizes.get(letter, 1), n)
    if "->" in eq:
        output = rhs.replace("...", spare)
    else:                           # numpy's rule: the letters seen once, in alphabetical order
        letters = lhs.replace("...", "").replace(",", "")
        output = spare + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    return inputs, output, sizes


def einsum_flops(equation: str, shapes: Sequence[Sequence[int]]) -> float:
    """Forward FLOPs of ``torch.einsum(equation, *operands)`` on operands of ``shapes``: its pairwise
    contractions left to right; one operand alone is a sum or a permutation (one FLOP an input element)."""
    inputs, output, sizes = einsum_axes(equation, shapes)
    if len(inputs) == 1:
        return float(math.prod(sizes[c] for c in inputs[0]))
    flops, held = 0.0, inputs[0]
    for i, term in enumerate(inputs[1:], start=1):
        later = set(output).union(*inputs[i + 1:])
        letters = set(held) | set(term)
        kept = {c for c in letters if c in later}
        space = math.prod(sizes[c] for c in letters)
        flops += space * (2 if letters - kept else 1)
        held = "".join(sorted(kept))
    return float(flops)


def einsum_contracts(equation: str, shapes: Sequence[Sequence[int]]) -> bool:
    """Whether the einsum is a matrix product: two of its operands share a summed letter and each
    has a letter the other lacks (``bik,bkj->bij``; not a dot product ``i,i->`` nor a scaled sum)."""
    inputs, output, _ = einsum_axes(equation, shapes)
    for i, a in enumerate(inputs):
        for b in inputs[i + 1:]:
            summed = (set(a) & set(b)) - set(output)
            if summed and set(a) - set(b) and set(b) - set(a):
                return True
    return False
