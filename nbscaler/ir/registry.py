"""The op registry: for each torch function, how its dimensions line up.

Each entry maps a call target (``'torch.nn.functional.linear'``, ``'Tensor.view'``, ...) to an
``OpSpec``: a name and a function that reads the recorded call (its arguments and shapes) and returns
the call's ``OpAnnotation``. Most ops use a fixed string (``'* k+, n k+ -> * n'``); shape-dependent
ones (reshape, indexing, broadcasting arithmetic) compute it.

Ops missing here still trace: they become *opaque* nodes that run replicated, with a warning.
``register_op`` adds your own function as a single op:

>>> @register_op('b d+, d+ e -> b e')                        # doctest: +SKIP
... def my_matmul(x, w):
...     return x @ w
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten

from nbscaler.blocks import normalize
from nbscaler.ir.annotation import OpAnnotation
from nbscaler.ir.graph import IRNode

Annotator = Callable[[IRNode], Optional[OpAnnotation]]


@dataclass(frozen=True)
class OpSpec:
    """How one op partitions."""

    name: str
    annotate: Annotator
    shape_args: bool = False      # its arguments spell out the output shape (view, reshape, expand)


_REGISTRY: Dict[str, OpSpec] = {}
USER_OPS: Dict[str, Callable] = {}          # target -> user function registered with register_op


# ------------------------------------------------------------------------------------------------
# Call targets: one readable name per torch callable
# ------------------------------------------------------------------------------------------------
_NAMESPACES = ((F, "torch.nn.functional"), (torch, "torch"), (torch.special, "torch.special"),
               (torch.linalg, "torch.linalg"), (torch.fft, "torch.fft"))


def target_of(func: Callable) -> str:
    """The readable dotted name of a callable that the tracer saw.

    Tensor methods and properties become ``'Tensor.<name>'``; free functions the shortest public
    path (``torch._C._nn.linear`` is ``'torch.nn.functional.linear'``).
    """
    name = getattr(func, "__name__", "")
    if name == "__get__" and hasattr(func, "__self__"):       # a property such as Tensor.T
        return "Tensor." + func.__self__.__name__
    user_target = getattr(func, "_nbscaler_target", None)      # a function made an op by register_op
    if user_target is not None:
        return user_target
    qual = getattr(func, "__qualname__", "")
    if qual.startswith(("TensorBase.", "Tensor.")):
        return "Tensor." + name
    for ns, prefix in _NAMESPACES:
        if getattr(ns, name, None) is func:
            return f"{prefix}.{name}"
    module = getattr(func, "__module__", None) or "torch"
    return f"{module}.{qual or name}"


def spec_of(target: str) -> Optional[OpSpec]:
    return _REGISTRY.get(target)


def _register(targets, name: str, annotate: Annotator, shape_args: bool = False) -> None:
    spec = OpSpec(name, annotate, shape_args)
    for t in targets.split():
        _REGISTRY[t] = spec


def _fixed(text: str) -> Annotator:
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


def _fresh(prefix: str, n: int) -> Tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(n))


def _norm_dims(dims, ndim: int) -> List[int]:
    if dims is None:
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return [d % ndim if ndim else 0 for d in dims]


# ------------------------------------------------------------------------------------------------
# Annotators computed from shapes
# ------------------------------------------------------------------------------------------------
def elementwise(node: IRNode, frozen_dims: Tuple[int, ...] = ()) -> OpAnnotation:
    """Broadcasting arithmetic: tensors align from the right; a broadcast size-1 axis is its own."""
    out_shape = node.output_tensors[0].shape
    rank = len(out_shape)
    names = _fresh("d", rank)
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
                fresh = f"b{k}_{j}"
                frozen.add(fresh)
                dims.append(fresh)
        ins.append(tuple(dims))
    outs = [names if t.shape == out_shape else _fresh(f"o{i}_", t.ndim)
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
        dims = set(_norm_dims(arg(node, pos, name), x.ndim))
        keep = bool(arg(node, pos + 1, "keepdim", False))
        ins = tuple(f"r{i}" if i in dims else f"d{i}" for i in range(x.ndim))
        out_names = []
        for i in range(x.ndim):
            if i not in dims:
                out_names.append(f"d{i}")
            elif keep:
                out_names.append(f"k{i}")
        outs = [tuple(out_names) if t.ndim == len(out_names) else _fresh("o", t.ndim) for t in node.output_tensors]
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
    names = list(_fresh("d", x.ndim))
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
        elif i == slice(None):
            ins.append(f"d{d}"); outs.append(f"d{d}"); d += 1
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
    names = list(_fresh("d", x.ndim))
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
    base = list(_fresh("d", out.ndim))
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
    return OpAnnotation.build(ins, [tuple(base)], [t.shape for t in node.inputs], [out.shape], frozen=frozen)


def repeat_interleave(node: IRNode) -> Optional[OpAnnotation]:
    x = node.inputs[0]
    dim = arg(node, 2, "dim")
    if dim is None or len(node.inputs) != 1:
        return None
    dim %= x.ndim
    names = list(_fresh("d", x.ndim))
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


def matmul(node: IRNode) -> OpAnnotation:
    """``a @ b`` with broadcast batch axes; 1-D operands as numpy defines them."""
    a, b = node.inputs[0], node.inputs[1]
    out = node.output_tensors[0]
    a_core = ("m", "k") if a.ndim >= 2 else ("k",)
    b_core = ("k", "n") if b.ndim >= 2 else ("k",)
    nb = max(a.ndim - len(a_core), b.ndim - len(b_core))
    batch = _fresh("b", nb)
    frozen = set()

    def side(t, core):
        extra = t.ndim - len(core)
        names = []
        for j in range(extra):
            i = nb - extra + j
            bsz = out.shape[i] if i < out.ndim else None
            if t.shape[j] == bsz:
                names.append(batch[i])
            else:
                names.append(f"bc{id(t) % 997}_{j}"); frozen.add(names[-1])
        return tuple(names) + core

    out_names = batch + (("m",) if a.ndim >= 2 else ()) + (("n",) if b.ndim >= 2 else ())
    return OpAnnotation.build([side(a, a_core), side(b, b_core)], [out_names], [a.shape, b.shape],
                              [out.shape], reduce={"k"}, frozen=frozen)


def linear(node: IRNode) -> OpAnnotation:
    has_bias = len(node.inputs) == 3
    return _fixed("* k+, n k+" + (", n" if has_bias else "") + " -> * n")(node)


def conv(node: IRNode) -> OpAnnotation:
    """``conv1d`` / ``conv2d``: ``n c+ s^.., o c+ k^.. -> n o t^..``; grouped ones see ``grouped_conv``."""
    x, w = node.inputs[0], node.inputs[1]
    nsp = w.ndim - 2                # spatial axes, from the kernel
    groups = arg(node, 6, "groups", 1)
    if groups != 1:
        return grouped_conv(node, groups)
    c, o = "c+", "o"
    sp = " ".join(f"s{i}^" for i in range(nsp))
    ks = " ".join(f"k{i}^" for i in range(nsp))
    osp = " ".join(f"t{i}^" for i in range(nsp))
    text = f"n {c} {sp}, {o} {c} {ks}" + (f", {o}" if len(node.inputs) == 3 else "") + f" -> n {o} {osp}"
    if x.ndim == nsp + 1:           # unbatched input
        text = text.replace("n ", "", 1).replace("-> n ", "-> ")
    return _fixed(text)(node)


def grouped_conv(node: IRNode, groups: int) -> OpAnnotation:
    """A convolution in ``groups`` independent groups of channels (depthwise when every channel is
    its own group, as in MobileNet): ``n g s^.., g ci^ k^.. -> n g t^..``.

    ``g`` names the channel axes of input, weight (its output channels) and output, split in whole
    groups: ``n`` devices each convolve ``groups // n`` groups, with no partial sums, and the call
    on a device says ``groups // n`` (``nbscaler.comm.layout.local_call``).
    """
    x, w, out = node.inputs[0], node.inputs[1], node.output_tensors[0]
    nsp = w.ndim - 2
    batched = x.ndim == nsp + 2
    lead = ("n",) if batched else ()
    sp, ks, osp = _fresh("s", nsp), _fresh("k", nsp), _fresh("t", nsp)
    inputs = [lead + ("g",) + sp, ("g", "ci") + ks] + [("g",)] * (len(node.inputs) - 2)
    sizes = {"g": groups, "ci": 1, **dict.fromkeys(sp + ks + osp, 1)}
    if batched:
        sizes["n"] = x.shape[0]
    return OpAnnotation.build(inputs, [lead + ("g",) + osp], [t.shape for t in node.inputs], [out.shape],
                              frozen={"ci", *sp, *ks, *osp}, sizes=sizes)


def normalization(node: IRNode) -> OpAnnotation:
    """layer_norm / rms_norm: the normalised trailing axes stay whole."""
    shape = arg(node, 1, "normalized_shape")
    nnorm = 1 if isinstance(shape, int) else len(shape)
    tail = " ".join(f"n{i}^" for i in range(nnorm))
    params = ", ".join([tail] * (len(node.inputs) - 1))
    text = f"* {tail}" + (f", {params}" if params else "") + f" -> * {tail}"
    return _fixed(text)(node)


def batch_norm(node: IRNode) -> OpAnnotation:
    """Per-channel statistics over the batch and spatial axes. In training the spatial axes stay
    whole; the batch axis may split, and generated code then calls ``comm.batch_norm``, which
    computes the statistics of the whole batch across the devices (``sync_batch_norm``)."""
    training = arg(node, 5, "training", False)
    x = node.inputs[0]
    mark = "^" if training else ""
    sp = " ".join(f"s{i}{mark}" for i in range(x.ndim - 2))
    params = "".join(", c" for _ in node.inputs[1:])
    return _fixed(f"n c {sp}{params} -> n c {sp}")(node)


def sync_batch_norm(node: IRNode) -> bool:
    """Whether ``node`` is a training-mode batch_norm split along its batch: its statistics must
    then be summed across the devices."""
    place = node.placement
    return (node.op == "batch_norm" and bool(arg(node, 5, "training", False))
            and place is not None and place.split == "n")


def embedding(node: IRNode) -> OpAnnotation:
    return _fixed("*, v^ d -> * d")(node)


def attention(node: IRNode) -> OpAnnotation:
    """scaled_dot_product_attention: split batch or heads; sequence and head axes stay whole.

    With ``enable_gqa=True`` the keys and values have fewer heads than the queries (each serves a
    group of them): the heads still split, in as many parts as the key heads allow, since a
    contiguous share of the query heads reads the matching share of the key heads.
    """
    q, k = node.inputs[0], node.inputs[1]
    same = q.shape[-3:-2] == k.shape[-3:-2]
    grouped = not same and bool(arg(node, 7, "enable_gqa", False)) and q.ndim >= 3
    h = "h" if same or grouped else "h^"
    lead = " ".join(f"b{i}" for i in range(q.ndim - 3))
    text = f"{lead} {h} t^ d^, {lead} {h} s^ d^, {lead} {h} s^ e^"
    if len(node.inputs) == 4:       # attn_mask broadcasts against (..., h, t, s)
        mask = node.inputs[3]
        full = [f"b{i}" for i in range(q.ndim - 3)] + [h.rstrip("^"), "t", "s"]
        names = []
        for j, size in enumerate(mask.shape):
            i = len(full) - mask.ndim + j
            want = (list(q.shape[:-2]) + [q.shape[-2], k.shape[-2]])[i]
            names.append(full[i] + ("^" if full[i] in ("t", "s") or h.endswith("^") and full[i] == "h" else "")
                         if size == want else f"m{j}^")
        text += ", " + " ".join(names)
    text = f"{text} -> {lead} {h} t^ e^".replace("  ", " ")
    if not grouped:
        return _fixed(text)(node)
    return _gqa(node, text)


def _gqa(node: IRNode, text: str) -> OpAnnotation:
    """The attention annotation with the heads axis ``h`` sized by the key heads (see ``attention``)."""
    from_shapes = OpAnnotation.parse(text, [t.shape for t in node.inputs], [t.shape for t in node.output_tensors])
    sizes = dict(from_shapes.sizes)
    sizes["h"] = node.inputs[1].shape[-3]
    return OpAnnotation.build(from_shapes.inputs, from_shapes.outputs, [], [], reduce=from_shapes.reduce,
                              frozen=from_shapes.frozen - {"h"}, sizes=sizes)


def loss(node: IRNode) -> OpAnnotation:
    """cross_entropy / nll_loss / mse_loss: a sum splits over samples, a mean stays whole."""
    reduction_kind = arg(node, {"torch.nn.functional.mse_loss": 4}.get(node.target, 5), "reduction", "mean")
    x = node.inputs[0]
    out = node.output_tensors[0]
    if node.target == "torch.nn.functional.mse_loss":
        if reduction_kind == "none":
            return elementwise(node)
        names = _fresh("d", x.ndim)
        mark = "+" if reduction_kind == "sum" else "^"
        side = " ".join(n + mark for n in names)
        return _fixed(f"{side}, {side} -> ")(node)
    # class-index targets: input (N, C, *) or (C,), target (N, *) or ()
    target = node.inputs[1]
    if x.ndim == 1 or target.ndim == x.ndim:        # unbatched, or probabilities as targets
        return elementwise(node, frozen_dims=tuple(range(out.ndim))) if out.ndim else \
            OpAnnotation.build([tuple(f"x{i}" for i in range(t.ndim)) for t in node.inputs], [()],
                               [t.shape for t in node.inputs], [()],
                               frozen={f"x{i}" for i in range(x.ndim)})
    rest = [f"s{i}" for i in range(x.ndim - 2)]
    mark = {"sum": "+", "none": ""}.get(reduction_kind, "^")
    samples = " ".join(n + mark for n in ["n"] + rest)
    weight = ", c^" if len(node.inputs) == 3 else ""
    outs = samples if reduction_kind == "none" else ""
    first = samples.split(" ", 1)
    xin = " ".join([first[0], "c^"] + first[1:])
    return _fixed(f"{xin}, {samples}{weight} -> {outs}")(node)


def constructor(node: IRNode) -> OpAnnotation:
    """Tensor factories read no tensor: nothing to split, but no warning either."""
    outs = [_fresh("c", t.ndim) for t in node.output_tensors]
    return OpAnnotation.build([], outs, [], [t.shape for t in node.output_tensors],
                              frozen={n for o in outs for n in o})


def triangle(node: IRNode) -> OpAnnotation:
    return elementwise(node, frozen_dims=(-1, -2))


# ------------------------------------------------------------------------------------------------
# The table
# ------------------------------------------------------------------------------------------------
def _both(names: str, prefix: str = "torch") -> str:
    """'add mul' -> 'torch.add Tensor.add torch.mul Tensor.mul'."""
    return " ".join(f"{prefix}.{n} Tensor.{n}" for n in names.split())


_UNARY = ("relu gelu silu tanh sigmoid exp log neg abs sqrt rsqrt sin cos sign square reciprocal "
          "float half bfloat16 double to type_as contiguous clone detach clamp clip pow erf "
          "masked_fill logical_not isnan isinf nan_to_num")
_BINARY = ("add sub mul div true_divide floor_divide remainder maximum minimum eq ne lt le gt ge "
           "logical_and logical_or where")
_INPLACE = "add_ sub_ mul_ div_ masked_fill_ clamp_ copy_ fill_ zero_ pow_ relu_"
_DUNDER = ("__add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ __rmul__ __imul__ __truediv__ "
           "__rtruediv__ __itruediv__ __neg__ __pow__ __rpow__ __eq__ __ne__ __lt__ __le__ __gt__ "
           "__ge__ __and__ __or__ __invert__ __mod__ __floordiv__")
INPLACE_TARGETS = {f"Tensor.{n}" for n in _INPLACE.split()} | {"Tensor.__iadd__", "Tensor.__isub__",
                                                                "Tensor.__imul__", "Tensor.__itruediv__",
                                                                "Tensor.__setitem__"}

_register(_both(_UNARY) + " " + _both(_BINARY) + " " + " ".join(f"Tensor.{n}" for n in _INPLACE.split())
          + " " + " ".join(f"Tensor.{n}" for n in _DUNDER.split())
          + " torch.nn.functional.relu torch.nn.functional.gelu torch.nn.functional.silu "
            "torch.nn.functional.tanh torch.nn.functional.sigmoid torch.nn.functional.dropout "
            "torch.nn.functional.leaky_relu torch.nn.functional.mish torch.nn.functional.elu "
            "Tensor.type Tensor.long Tensor.int Tensor.bool torch.ones_like torch.zeros_like "
            "torch.full_like torch.empty_like torch.rand_like torch.randn_like",
          "elementwise", elementwise)
_register("torch.nn.functional.linear", "linear", linear)
_register(_both("matmul bmm mm") + " Tensor.__matmul__ Tensor.__rmatmul__", "matmul", matmul)
_register("torch.nn.functional.conv1d torch.nn.functional.conv2d torch.conv1d torch.conv2d", "conv", conv)
_register("torch.nn.functional.embedding", "embedding", embedding)
_register("torch.nn.functional.layer_norm torch.nn.functional.rms_norm torch.layer_norm torch.rms_norm",
          "norm", normalization)
_register("torch.nn.functional.batch_norm torch.batch_norm", "batch_norm", batch_norm)
_register(_both("softmax log_softmax") + " torch.nn.functional.softmax torch.nn.functional.log_softmax",
          "softmax", along_dim(1, "dim"))
_register(_both("cumsum cumprod"), "scan", along_dim(1, "dim"))
_register(_both("sum nansum"), "sum", reduction("sum"))
_register(_both("mean amax amin max min argmax argmin var std norm logsumexp all any prod"),
          "reduce", reduction("other"))
_register("torch.nn.functional.cross_entropy torch.nn.functional.nll_loss torch.nn.functional.mse_loss",
          "loss", loss)
_register(_both("view reshape flatten unflatten squeeze unsqueeze") + " Tensor.view_as Tensor.reshape_as",
          "reshape", reshape)
# Only view/reshape spell out the shape; the others take axis numbers that a split leaves unchanged.
_register("Tensor.view Tensor.reshape torch.reshape", "reshape", reshape, shape_args=True)
_register(_both("transpose permute t swapaxes") + " Tensor.T Tensor.mT", "transpose", permutation)
_register("Tensor.__getitem__", "getitem", indexing)
_register(_both("split chunk unbind") + " Tensor.tensor_split", "split", split_like)
_register("torch.cat torch.concat torch.concatenate torch.stack", "concat", concat)
_register(_both("repeat_interleave"), "repeat_interleave", repeat_interleave)
_register("Tensor.expand", "expand", widen, shape_args=True)
_register("Tensor.expand_as", "expand", widen)
_register("Tensor.repeat", "repeat", widen)
_register(_both("triu tril"), "triangle", triangle)
_register("torch.nn.functional.scaled_dot_product_attention", "attention", attention)
_register("torch.ones torch.zeros torch.full torch.empty torch.arange torch.linspace torch.eye "
          "torch.tensor torch.as_tensor torch.rand torch.randn torch.randint torch.polar torch.outer",
          "constructor", constructor)


# ------------------------------------------------------------------------------------------------
# User ops
# ------------------------------------------------------------------------------------------------
def register_op(annotation: str, name: Optional[str] = None):
    """Make a function one op of the graph, split according to ``annotation``.

    The decorated function takes part in torch's own ``__torch_function__`` protocol, as the
    functions of ``torch.nn.functional`` do: with a ``TorchFunctionMode`` active (the tracer is
    one) or a tensor subclass that overrides torch functions among its arguments, the call is
    handed to them as one call of the decorated function. The tracer records it as a single node
    instead of looking inside, and code generation calls it by its import path, so it must live in
    an importable module (not a notebook's ``__main__``). The annotation uses the syntax of
    ``OpAnnotation``.

    >>> @register_op('* k+, n k+ -> * n')                       # doctest: +SKIP
    ... def fused_linear(x, w): ...
    """
    def decorate(fn: Callable) -> Callable:
        target = f"{fn.__module__}.{fn.__qualname__}"

        @functools.wraps(fn)
        def op(*args, **kwargs):
            tensors = tuple(x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor))
            if torch.overrides.has_torch_function(tensors) or (
                    not tensors and torch._C._is_torch_function_mode_enabled()):
                return torch.overrides.handle_torch_function(op, tensors, *args, **kwargs)
            return fn(*args, **kwargs)

        op._nbscaler_target = target
        USER_OPS[target] = fn
        _register(target, name or fn.__name__, _fixed(annotation))
        return op
    return decorate


_warned: set = set()


def annotate(node: IRNode) -> Optional[OpAnnotation]:
    """The node's annotation, or ``None`` (with a one-time warning) when the op is unknown."""
    spec = spec_of(node.target)
    if spec is not None:
        try:
            return spec.annotate(node)
        except Exception as err:       # a shape the annotator does not understand: run it whole
            reason = f"its annotation failed ({err})"
    else:
        reason = "it is not in the op registry"
    if node.target not in _warned:
        _warned.add(node.target)
        warnings.warn(f"nbscaler: '{node.target}' ({node.module_path or 'top level'}) runs replicated on every "
                      f"device because {reason}; add it with nbscaler.register_op to let policies split it.",
                      stacklevel=2)
    return None


# The ops of real model families (GPT-2's addmm, pooling, padding, routing, ...) live in their own module.
from nbscaler.ir import model_ops  # noqa: E402,F401  (registers on import)
