"""Annotators of the layers' ops: matrix products, linear and convolution layers, normalization,
embedding, attention and losses. Each says which axes split cleanly (batch, heads, output
features), which leave partial sums (a split contraction), and which must stay whole (a normalised
or attended axis). The shape-only ops and the tools these use live in ``shape_rules``, and what
routed-experts ops are and how plans split them in ``expert_rules``.
"""

from __future__ import annotations

from typing import Dict, Optional, Set, Tuple

from nbscaler.blocks import MIRRORED
from nbscaler.ir.annotation import OpAnnotation
from nbscaler.ir.expert_rules import expert_splits
from nbscaler.ir.graph import CONTEXT_KIND, Axis, IRGraph, IRNode, Placement, fed_by_inputs
from nbscaler.ir.shape_rules import arg, elementwise, fixed, fresh


def matmul(node: IRNode) -> OpAnnotation:
    """``a @ b`` with broadcast batch axes; 1-D operands as numpy defines them."""
    a, b = node.inputs[0], node.inputs[1]
    out = node.output_tensors[0]
    a_core = ("m", "k") if a.ndim >= 2 else ("k",)
    b_core = ("k", "n") if b.ndim >= 2 else ("k",)
    nb = max(a.ndim - len(a_core), b.ndim - len(b_core))
    batch = fresh("b", nb)
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
    return fixed("* k+, n k+" + (", n" if has_bias else "") + " -> * n")(node)


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
    return fixed(text)(node)


def grouped_conv(node: IRNode, groups: int) -> OpAnnotation:
    """A convolution in ``groups`` independent groups of channels (depthwise when every channel is
    its own group, as in MobileNet): ``n g s^.., g ci^ k^.. -> n g t^..``.

    ``g`` names the channel axes of input, weight (its output channels) and output, split in whole
    groups: ``n`` devices each convolve ``groups // n`` groups, with no partial sums, and the call
    on a device says ``groups // n`` (``nbscaler.comm.arguments.local_call``).
    """
    x, w, out = node.inputs[0], node.inputs[1], node.output_tensors[0]
    nsp = w.ndim - 2
    batched = x.ndim == nsp + 2
    lead = ("n",) if batched else ()
    sp, ks, osp = fresh("s", nsp), fresh("k", nsp), fresh("t", nsp)
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
    return fixed(text)(node)


def batch_norm(node: IRNode) -> OpAnnotation:
    """Per-channel statistics over the batch and spatial axes. In training the spatial axes stay
    whole; the batch axis may split, and generated code then calls ``comm.batch_norm``, which
    computes the statistics of the whole batch across the devices (``sync_batch_norm``)."""
    training = arg(node, 5, "training", False)
    x = node.inputs[0]
    mark = "^" if training else ""
    sp = " ".join(f"s{i}{mark}" for i in range(x.ndim - 2))
    params = "".join(", c" for _ in node.inputs[1:])
    return fixed(f"n c {sp}{params} -> n c {sp}")(node)


def sync_batch_norm(node: IRNode) -> bool:
    """Whether ``node`` is a training-mode batch_norm split along its batch: its statistics must
    then be summed across the devices."""
    place = node.placement
    return (node.op == "batch_norm" and bool(arg(node, 5, "training", False))
            and place is not None and place.split == "n")


def embedding(node: IRNode) -> OpAnnotation:
    """A lookup in a table whose rows are the vocabulary. A plain lookup (no ``padding_idx``,
    ``max_norm``, ``scale_grad_by_freq`` or ``sparse``) may split the rows across devices: each
    looks up the tokens its rows hold and gives zeros for the others, so the outputs are partial
    sums (``vocab_parallel``; Megatron-LM's VocabParallelEmbedding). Otherwise the rows stay whole."""
    plain = all(arg(node, i, name, default) == default for i, name, default in
                ((2, "padding_idx", None), (3, "max_norm", None), (5, "scale_grad_by_freq", False), (6, "sparse", False)))
    return fixed("*, v+ d -> * d" if plain else "*, v^ d -> * d")(node)


def vocabulary_lookups(graph: IRGraph) -> Set[str]:
    """The embeddings of ``graph`` whose ids come from the data (the token ids): lookups in a
    vocabulary, which a tensor-parallel plan splits by rows. A table the model indexes itself
    (learned positions from ``torch.arange``, BERT's token types from a buffer) is small, and
    splitting it too would leave a second partial sum to all-reduce where the stream starts; it
    stays whole, as Megatron-LM keeps its position embedding."""
    data = fed_by_inputs(graph)
    return {n.name for n in graph.nodes if n.op == "embedding" and id(n.inputs[0]) in data}


def vocab_split(node: IRNode, place: Optional[Placement] = None) -> Optional[Tuple[Optional[Axis], Placement]]:
    """``(axis, one-axis placement)`` along which ``node`` is split by vocabulary (``vocab_parallel``;
    the axis is ``None`` unless it is placed over a grid), or ``None``."""
    place = place or node.placement
    if place is None:
        return None
    return next(((a, p) for a, p in place.views() if (node.op, p.split) in (("embedding", "v"), ("loss", "c"))), None)


def vocab_parallel(node: IRNode, place: Optional[Placement] = None) -> bool:
    """Whether ``node`` is split by vocabulary (under ``place``, by default its own): an embedding by
    its table's rows, or a cross-entropy by its classes (the columns of the logits a column-parallel
    output head leaves). Every device then reads the token ids whole, and generated code calls
    ``nbscaler.runtime.vocab.vocab_embedding`` or ``vocab_cross_entropy`` with the first vocabulary
    entry it holds (``vocab_share``)."""
    return vocab_split(node, place) is not None


def context_split(node: IRNode, place: Optional[Placement] = None) -> Optional[Tuple[str, Optional[Axis], Placement]]:
    """``(what it calls, axis, one-axis placement)`` of a split along the tokens (``context_parallel``),
    or ``None``."""
    place = place or node.placement
    if place is None:
        return None
    for axis, p in place.views():
        if (node.op, p.split) == ("attention", "t"):
            return "attention", axis, p
        if (node.op, p.split) == ("loss", "n") and "n" in node.annotation.frozen:
            return "loss", axis, p
    return None


def context_parallel(node: IRNode, place: Optional[Placement] = None) -> Optional[str]:
    """What a split along the tokens calls in place of ``node``: ``'attention'`` for an attention split
    along its queries (context parallelism, ``nbscaler.runtime.context.context_attention``), ``'loss'``
    for a mean cross-entropy split along its tokens, by context parallelism or by the batch split
    (``nbscaler.runtime.losses.split_cross_entropy``), else ``None``."""
    found = context_split(node, place)
    return found[0] if found else None


def context_group(node: IRNode, device: Optional[int] = None) -> Tuple[int, ...]:
    """The devices ``node``'s split along the tokens runs over with ``device`` (by default its first):
    all of its devices, or over a grid (tensor parallelism inside) ``device``'s context-parallel group."""
    _, axis, _ = context_split(node)
    place = node.placement
    return place.group_of(axis, place.devices[0] if device is None else device)


def vocab_group(node: IRNode, device: int) -> Tuple[int, ...]:
    """The devices ``node``'s split by vocabulary runs over with ``device``: all of its devices, or
    over a grid ``device``'s tensor-parallel group."""
    axis, _ = vocab_split(node)
    return node.placement.group_of(axis, device)


def context_ring(node: IRNode, place: Optional[Placement] = None) -> bool:
    """Whether ``node`` is an attention whose keys and values stay split and pass round a ring."""
    return context_parallel(node, place) == "attention" and node.meta.get(CONTEXT_KIND) == "ring"


def counted_tokens_bytes(node: IRNode) -> int:
    """The bytes a loss split along its tokens all-reduces inside its call: the group's count of
    counted tokens, one int64 (``nbscaler.runtime.losses.split_cross_entropy``); 0 for any other op."""
    found = context_split(node)
    return 8 if found and found[0] == "loss" and found[2].parts > 1 else 0


CONTEXT_SEQUENCE = "sequence"
"""What ``context_splits`` gives an op split along the sequence that is neither attention nor the loss."""


def context_splits(graph: IRGraph) -> Dict[str, str]:
    """Op name -> how context parallelism split it, for every op it cut along the sequence
    (``blocks='mirrored'``): an attention's and a loss's ``context_kind`` (``'ring'`` or
    ``'all_gather'``), ``CONTEXT_SEQUENCE`` for any other op. Empty without context parallelism.
    The views name these splits by what they cut (``nbscaler.glossary.split_name``)."""
    out: Dict[str, str] = {}
    for node in graph.nodes:
        place = node.placement
        if place is not None and place.split is not None and place.blocks == MIRRORED:
            out[node.name] = str(node.meta.get(CONTEXT_KIND, CONTEXT_SEQUENCE)) if context_parallel(node) \
                else CONTEXT_SEQUENCE
    return out


def parallel_splits(graph: IRGraph) -> Dict[str, str]:
    """``context_splits`` and ``expert_splits`` together: every op a view names by what context or
    expert parallelism cut of it, rather than by its split label alone."""
    return {**context_splits(graph), **expert_splits(graph)}


def vocab_share(node: IRNode) -> int:
    """How many vocabulary entries each device of a ``vocab_parallel`` node holds."""
    _, place = vocab_split(node)
    return node.annotation.sizes[place.split] // place.parts


WINDOW_TARGET = "nbscaler.attention.window.sliding_window_attention"
"""The call target of sliding-window attention, an attention op of the graph (``attention``)."""


def window_of(node: IRNode) -> Optional[int]:
    """The window of a ``sliding_window_attention`` node, in keys (``None`` for any other node)."""
    if node.target != WINDOW_TARGET:
        return None
    return node.kwargs["window"] if "window" in node.kwargs else node.args[3]


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
        return fixed(text)(node)
    return _gqa(node, text)


def _gqa(node: IRNode, text: str) -> OpAnnotation:
    """The attention annotation with the heads axis ``h`` sized by the key heads (see ``attention``)."""
    from_shapes = OpAnnotation.parse(text, [t.shape for t in node.inputs], [t.shape for t in node.output_tensors])
    sizes = dict(from_shapes.sizes)
    sizes["h"] = node.inputs[1].shape[-3]
    return OpAnnotation.build(from_shapes.inputs, from_shapes.outputs, [], [], reduce=from_shapes.reduce,
                              frozen=from_shapes.frozen - {"h"}, sizes=sizes)


CROSS_ENTROPY = "torch.nn.functional.cross_entropy"


def loss(node: IRNode) -> OpAnnotation:
    """cross_entropy / nll_loss / mse_loss: a sum splits over samples, a mean stays whole. A plain
    cross-entropy of ``(N, C)`` logits (``vocab_cross_entropy``) also splits its classes ``C``."""
    reduction_kind = arg(node, {"torch.nn.functional.mse_loss": 4}.get(node.target, 6), "reduction", "mean")
    x = node.inputs[0]
    out = node.output_tensors[0]
    if node.target == "torch.nn.functional.mse_loss":
        if reduction_kind == "none":
            return elementwise(node)
        names = fresh("d", x.ndim)
        mark = "+" if reduction_kind == "sum" else "^"
        side = " ".join(n + mark for n in names)
        return fixed(f"{side}, {side} -> ")(node)
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
    classes = "c+" if plain_cross_entropy(node) else "c^"
    xin = " ".join([first[0], classes] + first[1:])
    return fixed(f"{xin}, {samples}{weight} -> {outs}")(node)


def splits_mean_loss(node: IRNode, logits_dim: Optional[int]) -> bool:
    """Whether ``node`` is a plain mean cross-entropy (``plain_cross_entropy``, its ``n`` marked '^')
    whose ``(N, C)`` logits arrive split along dim ``logits_dim``: split along their rows (dim 0), it
    runs each device's part of the mean (``nbscaler.runtime.losses.split_cross_entropy``) rather than
    gathering the logits; the batch split and context parallelism both place it so."""
    return (logits_dim == 0 and node.op == "loss" and node.annotation is not None
            and "n" in node.annotation.frozen and plain_cross_entropy(node))


def plain_cross_entropy(node: IRNode) -> bool:
    """Whether a cross-entropy may split its classes across devices (``vocab_cross_entropy``):
    ``(N, C)`` logits, class indices as targets, no class weights, no label smoothing and no
    legacy ``size_average``/``reduce`` (``reduction`` is one of mean, sum, none). Each
    device's part of the loss is then a partial sum of the whole (``+``)."""
    x, target = node.inputs[0], node.inputs[1]
    return (node.target == CROSS_ENTROPY and x.ndim == 2 and target.ndim == 1 and len(node.inputs) == 2
            and not target.dtype.is_floating_point and arg(node, 7, "label_smoothing", 0.0) == 0.0
            and arg(node, 3, "size_average") is None and arg(node, 5, "reduce") is None)
