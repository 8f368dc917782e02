"""Annotators computed from shapes: how the ops that move, select, combine or broadcast elements
line up their dimensions (elementwise arithmetic, reductions, reshapes, permutations, indexing,
splits and joins), and the small tools every annotator uses.

An annotator reads one recorded call (``IRNode``: its arguments and the shapes of its tensors) and
returns its ``OpAnnotation``, or ``None`` when the call cannot be split (it then runs whole). The
registry (``nbscaler.ir.registry``) says which annotator each torch function uses; the layers'
ops (matmul, convolution, normalization, attention, losses) have theirs in ``layer_rules``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

from nbscaler.blocks import normalize
from nbscaler.ir.annotation import OpAnnotation
from nbscaler.ir.graph import IRNode

VIEW_OPS = frozenset({"reshape", "transpose", "getitem", "split", "expand"})
"""The registry's ops whose result may share its input's storage (a view): what frees the input
frees the view (ZeRO-3's release, ``comm.unit_gathers``), and what splits the view by its first axis
can split the input alike (Hugging Face's experts' chunk and transposes, ``expert_weight_views``)."""

Annotator = Callable[[IRNode], Optional[OpAnnotation]]


def fixed(text: str) -> Annotator:
    """An annotator from one annotation string."""
    def annotate(node: IRNode) -> OpAnnotation:
        return OpAnnotation.parse(text, [t.shape for t in node.inputs],
                                  [t.shape for t in node.output_tensors])
    return annotate


def arg(node: IRNode, pos: int, name: str, default: Any = None) -> Any:
    """A call argument by position or keyword."""
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[pos] if len(node.args) > pos else default


def fresh(prefix: str, n: int) -> Tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(n))


def norm_dims(dims, ndim: int) -> List[int]:
    if dims is None:
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return [d % ndim if ndim else 0 for d in dims]


def elementwise(node: IRNode, frozen_dims: Tuple[int, ...] = ()) -> OpAnnotation:
    """Broadcasting arithmetic: tensors align from the right; a broadcast size-1 axis is its own."""
    out_shape = node.output_tensors[0].shape
    rank = len(out_shape)
    names = fresh("d", rank)
    frozen = {names[d % rank] for d in frozen_dims} if rank else set()
    ins = []
    for k, t in enumerate(node.inputs):
        off = rank - t.ndim
        dims = []
        for j, size in enumerate(t.shape):
            i = off + j
            if 0 <= i < rank and size == out_shape[i]:
                dims.append(names[i])
            else:
                own = f"b{k}_{j}"         # broadcast: an axis of this input alone
                frozen.add(own)
                dims.append(own)
        ins.append(tuple(dims))
    outs = [names if t.shape == out_shape else fresh(f"o{i}_", t.ndim)
            for i, t in enumerate(node.output_tensors)]
    return OpAnnotation.build(ins, outs, [t.shape for t in node.inputs],
                              [t.shape for t in node.output_tensors], frozen=frozen)


def along_dim(pos: int, name: str, default: Any = -1) -> Annotator:
    """Elementwise over every axis but one that must stay whole (softmax, cumsum, ...)."""
    def annotate(node: IRNode) -> OpAnnotation:
        dim = arg(node, pos, name, default)
        return elementwise(node, frozen_dims=(dim,) if dim is not None else ())
    return annotate


def reduction(kind: str, pos: int = 1, name: str = "dim") -> Annotator:
    """sum (splitting a summed axis leaves partial sums) or mean/max/... (summed axes stay whole)."""
    def annotate(node: IRNode) -> OpAnnotation:
        x = node.inputs[0]
        dims = set(norm_dims(arg(node, pos, name), x.ndim))
        keep = bool(arg(node, pos + 1, "keepdim", False))
        ins = tuple(f"r{i}" if i in dims else f"d{i}" for i in range(x.ndim))
        out_names = []
        for i in range(x.ndim):
            if i not in dims:
                out_names.append(f"d{i}")
            elif keep:
                out_names.append(f"k{i}")
        outs = [tuple(out_names) if t.ndim == len(out_names) else fresh("o", t.ndim) for t in node.output_tensors]
        red = {f"r{i}" for i in dims}
        return OpAnnotation.build([ins], outs, [x.shape], [t.shape for t in node.output_tensors],
                                  reduce=red if kind == "sum" else (), frozen=() if kind == "sum" else red)
    return annotate


def reshape(node: IRNode) -> OpAnnotation:
    """Group input and output axes whose sizes multiply to the same number.

    In each group the outermost axis on each side shares a name: splitting ``(h d)`` into ``n``
    contiguous chunks is splitting ``h`` into ``n`` chunks, valid when ``n`` divides both sizes.
    Inner axes of a merged or split group stay whole.
    """
    a, b = node.inputs[0].shape, node.output_tensors[0].shape
    ia, ib, names_a, names_b, sizes, grouped = 0, 0, [], [], {}, {}
    g = 0
    while ia < len(a) or ib < len(b):
        if ia < len(a) and a[ia] == 1 and not (ib < len(b) and b[ib] == 1):
            names_a.append(f"one_a{ia}"); sizes[f"one_a{ia}"] = 1; ia += 1; continue
        if ib < len(b) and b[ib] == 1 and not (ia < len(a) and a[ia] == 1):
            names_b.append(f"one_b{ib}"); sizes[f"one_b{ib}"] = 1; ib += 1; continue
        if ia >= len(a) or ib >= len(b):      # trailing size-1 axes handled above; nothing else fits
            break
        first = f"g{g}"
        sizes[first] = math.gcd(a[ia], b[ib])
        pa, pb = a[ia], b[ib]
        names_a.append(first); names_b.append(first)
        ia += 1; ib += 1
        while pa != pb:
            if pa < pb:
                names_a.append(f"g{g}_a{ia}"); sizes[f"g{g}_a{ia}"] = 1; pa *= a[ia]; ia += 1
            else:
                names_b.append(f"g{g}_b{ib}"); sizes[f"g{g}_b{ib}"] = 1; pb *= b[ib]; ib += 1
        if _fused_blocks_axis(names_a, names_b, first, b):
            grouped[(0, first)] = _name_heads(names_b, first, b, sizes)
        g += 1
    inner = {n for n in names_a + names_b if "_a" in n or "_b" in n or n.startswith("one")}
    return OpAnnotation.build([tuple(names_a)], [tuple(names_b)], [a], [b], frozen=inner, sizes=sizes,
                              grouped=grouped)


FUSED_BLOCKS = (2, 3)
"""Sizes of a leading block axis that a reshape reads as fused projections (k and v, or q, k and v)."""


def _fused_blocks_axis(names_a: List[str], names_b: List[str], first: str, b) -> bool:
    """Whether the group ``first`` unflattens one input axis into ``(blocks, heads, head_dim...)``
    with a small leading ``blocks`` axis: a fused qkv output viewed as ``(B, T, 3, nh, hs)``, as timm's
    attention does before ``permute`` and ``unbind``."""
    if names_a[-1] != first:                     # more than one input axis in the group
        return False
    j = names_b.index(first)
    return (j + 2 < len(names_b) and names_b[j + 1] == f"{first}_b{j + 1}" and names_b[j + 2].startswith(first)
            and b[j] in FUSED_BLOCKS and b[j + 1] > 1)


def _name_heads(names_b: List[str], first: str, b, sizes: Dict[str, int]) -> int:
    """Rename the group so that the heads axis carries its splittable name and the leading block
    axis stays whole: splitting the heads then reads the input as ``blocks`` equal blocks, strided
    (each device holds its own heads of q, k and v). Returns the number of blocks."""
    j = names_b.index(first)
    blocks = b[j]
    names_b[j], names_b[j + 1] = f"{first}_blocks", first        # '_b': kept whole (see ``inner``)
    sizes[f"{first}_blocks"], sizes[first] = 1, b[j + 1]
    return blocks


def permutation(node: IRNode) -> OpAnnotation:
    """transpose / permute / t / .T / .mT: the same axes in another order."""
    x = node.inputs[0]
    names = list(fresh("d", x.ndim))
    if node.target in ("Tensor.permute", "torch.permute"):
        order = node.args[1:] if len(node.args) > 1 and isinstance(node.args[1], int) else arg(node, 1, "dims")
        out = [names[d % x.ndim] for d in order]
    elif node.target in ("Tensor.transpose", "torch.transpose", "Tensor.swapaxes", "torch.swapaxes"):
        i, j = arg(node, 1, "dim0") % x.ndim, arg(node, 2, "dim1") % x.ndim
        out = list(names); out[i], out[j] = out[j], out[i]
    else:   # t, T, mT: the last two axes (or the only one)
        out = list(names)
        if x.ndim >= 2:
            out[-1], out[-2] = out[-2], out[-1]
        if node.target == "Tensor.T":
            out = names[::-1]
    return OpAnnotation.build([tuple(names)], [tuple(out)], [x.shape], [node.output_tensors[0].shape])


def indexing(node: IRNode) -> Optional[OpAnnotation]:
    """``x[...]`` with ints, slices, None and Ellipsis; anything else (tensor indices) is opaque."""
    x = node.inputs[0]
    if len(node.inputs) != 1:
        return None
    index = node.args[1]
    index = index if isinstance(index, tuple) else (index,)
    if any(not isinstance(i, (int, slice, type(None), type(Ellipsis))) or isinstance(i, bool) for i in index):
        return None
    nreal = sum(1 for i in index if isinstance(i, (int, slice)))
    expanded: List[Any] = []
    for i in index:
        if i is Ellipsis:
            expanded.extend([slice(None)] * (x.ndim - nreal))
        else:
            expanded.append(i)
    expanded.extend([slice(None)] * (x.ndim - sum(1 for i in expanded if i is not None)))
    ins, outs, frozen, d = [], [], set(), 0
    for k, i in enumerate(expanded):
        if i is None:
            outs.append(f"new{k}")
        elif isinstance(i, int):
            ins.append(f"i{d}"); frozen.add(f"i{d}"); d += 1
        elif i == slice(None) or (isinstance(i, slice) and i.indices(x.shape[d]) == (0, x.shape[d], 1)):
            ins.append(f"d{d}"); outs.append(f"d{d}"); d += 1      # the whole axis (``x[:, -0:]`` too)
        else:
            ins.append(f"s{d}"); outs.append(f"t{d}"); frozen.update({f"s{d}", f"t{d}"}); d += 1
    out_t = node.output_tensors[0]
    return OpAnnotation.build([tuple(ins)], [tuple(outs)], [x.shape], [out_t.shape], frozen=frozen)


def _same_but(shape, other, dim: int) -> bool:
    """Whether ``shape`` equals ``other`` except along ``dim``."""
    return len(shape) == len(other) and all(a == b for i, (a, b) in enumerate(zip(shape, other)) if i != dim)


def split_like(node: IRNode) -> OpAnnotation:
    """split / chunk / unbind: the split axis stays whole, the others pass through to every piece."""
    x = node.inputs[0]
    default_pos = {"Tensor.unbind": 1, "torch.unbind": 1}.get(node.target, 2)
    dim = arg(node, default_pos, "dim", 0) % x.ndim
    names = list(fresh("d", x.ndim))
    pieces = node.output_tensors
    if len(pieces) > 1 and all(_same_but(t.shape, x.shape, dim) and t.shape[dim] for t in pieces):
        # Blocks (a fused qkv; unequal with grouped-query attention): each output is one block of
        # the axis, so splitting the block axis 'h' splits every block the same way: the input
        # strided (``nbscaler.blocks``), each output contiguously.
        names[dim] = "h"
        sizes = dict(zip(names, x.shape))
        sizes["h"] = math.gcd(*(t.shape[dim] for t in pieces))
        grouped = {(0, "h"): normalize([t.shape[dim] for t in pieces])}
        return OpAnnotation.build([tuple(names)], [tuple(names)] * len(pieces), [x.shape],
                                  [t.shape for t in pieces], sizes=sizes, grouped=grouped)
    names[dim] = "cut"
    outs = []
    for t in node.output_tensors:
        o = list(names)
        if t.ndim == x.ndim:
            o[dim] = f"piece{len(outs)}"
        else:
            o.pop(dim)
        outs.append(tuple(o))
    frozen = {"cut"} | {f"piece{i}" for i in range(len(outs))}
    return OpAnnotation.build([tuple(names)], outs, [x.shape], [t.shape for t in node.output_tensors], frozen=frozen)


def concat(node: IRNode) -> OpAnnotation:
    """cat / stack: inputs share every axis except the one they are joined along."""
    stack = node.target in ("torch.stack",)
    out = node.output_tensors[0]
    dim = arg(node, 1, "dim", 0) % out.ndim
    base = list(fresh("d", out.ndim))
    ins = []
    for k, t in enumerate(node.inputs):
        names = list(base)
        if not stack and t.ndim != out.ndim:      # torch.cat skips legacy empty 1-D tensors (an empty KV cache)
            ins.append((f"empty{k}",))
            continue
        if stack:
            names.pop(dim)
        else:
            names[dim] = f"part{k}"
        ins.append(tuple(names))
    base[dim] = "joined"
    frozen = {"joined"} | {f"part{k}" for k in range(len(ins))} | {f"empty{k}" for k in range(len(ins))}
    filled = [k for k, t in enumerate(node.inputs) if t.ndim == out.ndim and t.shape[dim]]
    if not stack and len(filled) == 1:
        # every other input is empty along ``dim`` (a KV cache before its first update): the op
        # passes one input through, so the joined axis splits as that input's does
        ins[filled[0]] = tuple(base)
        frozen.discard("joined")
    return OpAnnotation.build(ins, [tuple(base)], [t.shape for t in node.inputs], [out.shape], frozen=frozen)


def repeat_interleave(node: IRNode) -> Optional[OpAnnotation]:
    x = node.inputs[0]
    dim = arg(node, 2, "dim")
    if dim is None or len(node.inputs) != 1:
        return None
    dim %= x.ndim
    names = list(fresh("d", x.ndim))
    out = node.output_tensors[0]
    sizes = {n: s for n, s in zip(names, x.shape)}
    return OpAnnotation.build([tuple(names)], [tuple(names)], [x.shape], [out.shape], sizes=sizes)


def widen(node: IRNode) -> OpAnnotation:
    """expand / repeat: axes that keep their size pass through; new or widened axes stay whole."""
    x, out = node.inputs[0], node.output_tensors[0]
    off = out.ndim - x.ndim
    out_names = [f"new{i}" for i in range(off)]
    in_names, frozen = [], set(out_names)
    for j, size in enumerate(x.shape):
        if size == out.shape[off + j]:
            in_names.append(f"d{j}"); out_names.append(f"d{j}")
        else:
            in_names.append(f"narrow{j}"); out_names.append(f"wide{j}"); frozen |= {f"narrow{j}", f"wide{j}"}
    return OpAnnotation.build([tuple(in_names)], [tuple(out_names)], [x.shape], [out.shape], frozen=frozen)


def constructor(node: IRNode) -> OpAnnotation:
    """Tensor factories read no tensor: nothing to split, but no warning either."""
    outs = [fresh("c", t.ndim) for t in node.output_tensors]
    return OpAnnotation.build([], outs, [], [t.shape for t in node.output_tensors],
                              frozen={n for o in outs for n in o})


def triangle(node: IRNode) -> OpAnnotation:
    return elementwise(node, frozen_dims=(-1, -2))
