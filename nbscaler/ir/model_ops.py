"""Annotations for the ops real model families call beyond the basics of ``registry``.

- ``addmm`` / ``baddbmm``: GPT-2's ``Conv1D`` is ``addmm(bias, x, weight)`` with the weight stored
  ``(in, out)``, so it splits like a linear with the weight transposed.
- ``F.pad``, ``torch.gather``, ``topk``, ``sort``, ``F.one_hot``: the touched (or new) axis stays
  whole, the others pass through (Hugging Face's causal-LM loss pads the labels; BERT gathers its token-type ids).
- Pooling (ResNet, MobileNetV3): batch and channels split, the pooled window stays whole.
- ``hardswish``, ``hardsigmoid``, ``relu6``, ...: elementwise.

Some ops run whole on every device **on purpose** (``whole``): a mixture-of-experts router's
``histc`` counts tokens per expert over the whole batch, and ``torch._grouped_mm`` with the sorted
token order and ``x[tensor]`` gathers that follow from it only make sense on the whole routing
table. Splitting the experts themselves would need expert parallelism (an all-to-all of tokens),
which no built-in policy does yet; so these ops are registered, run replicated, and warn nothing.
"""

from __future__ import annotations

from typing import List, Optional

from nbscaler.ir.annotation import OpAnnotation
from nbscaler.ir.graph import IRNode
from nbscaler.ir.op_specs import register
from nbscaler.ir.shape_rules import arg, elementwise, fixed, fresh, indexing


def _addmm_like(node: IRNode, batch: bool) -> OpAnnotation:
    """``bias + a @ b``: ``[b] m k+, [b] k+ n -> [b] m n``, the bias broadcast against the output."""
    bias, a, b = node.inputs[0], node.inputs[1], node.inputs[2]
    out = node.output_tensors[0]
    lead = ("b",) if batch else ()
    out_names = lead + ("m", "n")
    frozen: set = set()
    bias_names = []
    off = len(out_names) - bias.ndim
    for j, size in enumerate(bias.shape):
        i = off + j
        if i >= 0 and size == out.shape[i]:
            bias_names.append(out_names[i])
        else:
            bias_names.append(f"bc{j}")
            frozen.add(f"bc{j}")
    return OpAnnotation.build([tuple(bias_names), lead + ("m", "k"), lead + ("k", "n")], [out_names],
                              [bias.shape, a.shape, b.shape], [out.shape], reduce={"k"}, frozen=frozen)


def addmm(node: IRNode) -> OpAnnotation:
    return _addmm_like(node, batch=False)


def baddbmm(node: IRNode) -> OpAnnotation:
    return _addmm_like(node, batch=True)


def pad(node: IRNode) -> OpAnnotation:
    """``F.pad(x, (left, right, top, bottom, ...))``: padded axes (counted from the last) stay whole."""
    x, out = node.inputs[0], node.output_tensors[0]
    amounts = list(arg(node, 1, "pad"))
    padded = {x.ndim - 1 - i // 2 for i, p in enumerate(amounts) if p}
    ins = tuple(f"p{i}" if i in padded else f"d{i}" for i in range(x.ndim))
    outs = tuple(f"q{i}" if i in padded else f"d{i}" for i in range(x.ndim))
    frozen = {f"p{i}" for i in padded} | {f"q{i}" for i in padded}
    return OpAnnotation.build([ins], [outs], [x.shape], [out.shape], frozen=frozen)


def gather(node: IRNode) -> OpAnnotation:
    """``torch.gather(x, dim, index)``: the output has the index's shape; along ``dim`` the source
    stays whole, and the index (with the output) may split along any axis."""
    x, index = node.inputs[0], node.inputs[1]
    dim = arg(node, 1, "dim") % x.ndim
    x_names, i_names, frozen = [], [], {"src"}
    for i in range(x.ndim):
        if i == dim:
            x_names.append("src"); i_names.append("pick")
        elif index.shape[i] == x.shape[i]:
            x_names.append(f"d{i}"); i_names.append(f"d{i}")
        else:
            x_names.append(f"x{i}"); i_names.append(f"i{i}"); frozen.add(f"x{i}")
    return OpAnnotation.build([tuple(x_names), tuple(i_names)], [tuple(i_names)],
                              [x.shape, index.shape], [node.output_tensors[0].shape], frozen=frozen)


def select_along(node: IRNode) -> OpAnnotation:
    """topk / sort: every output has the input's axes, the one searched along stays whole."""
    x = node.inputs[0]
    pos = 2 if node.target.endswith("topk") else 1
    dim = arg(node, pos, "dim", -1) % x.ndim
    names = list(fresh("d", x.ndim))
    ins, outs = list(names), list(names)
    ins[dim], outs[dim] = "within", "picked"
    return OpAnnotation.build([tuple(ins)], [tuple(outs)] * len(node.output_tensors), [x.shape],
                              [t.shape for t in node.output_tensors], frozen={"within", "picked"})


def one_hot(node: IRNode) -> OpAnnotation:
    """``F.one_hot(x, classes)``: the input's axes pass through, the new last axis of classes stays whole."""
    x = node.inputs[0]
    names = fresh("d", x.ndim)
    return OpAnnotation.build([names], [names + ("class",)], [x.shape], [node.output_tensors[0].shape],
                              frozen={"class"})


def pooling(spatial: int):
    """Pooling over the last ``spatial`` axes: batch and channels split, the window stays whole."""
    def annotate(node: IRNode) -> OpAnnotation:
        x = node.inputs[0]
        lead = " ".join(["n", "c"][2 - (x.ndim - spatial):])
        win = " ".join(f"s{i}^" for i in range(spatial))
        pooled = " ".join(f"t{i}^" for i in range(spatial))
        outs = ", ".join(f"{lead} {pooled}" for _ in node.output_tensors)   # max pool's indices too
        return fixed(f"{lead} {win} -> {outs}")(node)
    return annotate


def whole(node: IRNode) -> OpAnnotation:
    """Runs whole on every device on purpose: every axis of every tensor stays whole."""
    def names(k, t):
        return tuple(f"w{k}_{j}" for j in range(t.ndim))
    ins = [names(k, t) for k, t in enumerate(node.inputs)]
    outs = [names(len(ins) + k, t) for k, t in enumerate(node.output_tensors)]
    frozen = {n for side in ins + outs for n in side}
    return OpAnnotation.build(ins, outs, [t.shape for t in node.inputs], [t.shape for t in node.output_tensors],
                              frozen=frozen)


def getitem(node: IRNode) -> Optional[OpAnnotation]:
    """``x[...]``: basic indexing splits (``shape_rules.indexing``); tensor indices run whole."""
    return indexing(node) or whole(node)


_ELEMENTWISE: List[str] = ["hardswish", "hardsigmoid", "relu6", "hardtanh", "softplus", "selu", "celu",
                           "silu_", "relu_", "gelu_", "logsigmoid", "tanhshrink", "softsign"]

register("torch.addmm Tensor.addmm", "addmm", addmm)
register("torch.baddbmm Tensor.baddbmm", "baddbmm", baddbmm)
register("torch.nn.functional.pad", "pad", pad)
register("torch.gather Tensor.gather", "gather", gather)
register("torch.topk Tensor.topk torch.sort Tensor.sort torch.argsort Tensor.argsort", "select", select_along)
register("torch.nn.functional.one_hot", "one_hot", one_hot)
register(" ".join(f"torch.nn.functional.{n}" for n in _ELEMENTWISE), "elementwise", elementwise)
for _dims in (1, 2, 3):
    register(" ".join(f"torch.nn.functional.{kind}_pool{_dims}d" for kind in
                       ("max", "avg", "adaptive_avg", "adaptive_max", "lp")), "pool", pooling(_dims))
# Mixture-of-experts routing: replicated on purpose (see the module docstring).
register("torch.histc Tensor.histc torch._grouped_mm torch.bincount Tensor.bincount "
          "Tensor.__setitem__", "routing", whole)
register("Tensor.__getitem__", "getitem", getitem)
