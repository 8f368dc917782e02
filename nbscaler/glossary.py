"""The words the views print for splits and layouts, each with a readable name and the names
Megatron-LM and PyTorch give the same thing: the one table ``docs/glossary.md`` is written from.

A **split label** is the name, in an op's annotation (``nbscaler.ir``), of the dimension a policy
split the op along (``plan.ops.split``): ``n`` in ``F.linear``'s ``'* k+, n k+ -> * n'``.
Most labels are the op's own (``n``, ``k``, ``v``, ``c``, ``h``); the rest are positional and
numbered (``d1``: the op's dim 1, ``*0``: the first of the leading dims a linear broadcasts over),
so the same number names the same axis whatever the op. A **layout** (``nbscaler.layouts``'s
``LayoutKind``) says what each device holds of a tensor (``plan.storage``, the collectives table's
``have`` and ``want``).

``split_name(label, op)`` is the readable name of a split (``'column-parallel'``),
``split_text`` the same with the label beside it (``'column-parallel (n)'``) for the views, and
both name a split of context parallelism by what it cuts when given its ``context``
(``nbscaler.ir.layer_rules.context_splits``: ``'sequence (context parallel, mirrored chunks)'``), and
``layout_name`` / ``layout_text`` the same for a layout (``'S(0)'`` -> ``'split on dim 0'``).
``markdown()`` writes the glossary page (``python -m nbscaler.glossary > docs/glossary.md``).

This module imports nothing of nbscaler but ``layouts``, so every layer may import it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import List, Optional, Tuple

from nbscaler.layouts import EXPERT_SPLIT, Collective, LayoutKind

__all__ = ["CONTEXT_SPLITS", "EXPERT_ALL_TO_ALLS", "EXPERT_SPLITS", "GLOSSARY_URL", "LAYOUTS", "SPLITS", "Term",
           "context_name", "expert_name", "experts_text", "layout_name", "layout_text", "markdown", "split_name",
           "split_term", "split_text"]

GLOSSARY_URL = "https://github.com/nbscaler/nbscaler/blob/main/docs/glossary.md"
"""Where the views' headers send a reader who asks what a label means (``docs/glossary.md``)."""

REPLICATED = "replicated"
"""What a view writes for an op that no policy split (``split`` is ``None``)."""


@dataclass(frozen=True)
class Term:
    """One label: its readable ``name``, what it means, and the names Megatron-LM and PyTorch
    (``torch.distributed.tensor`` and its ``parallel`` styles) give the same thing.

    ``ops``: the ops (``plan.ops.op``) the entry is for, empty for any op; a label whose meaning
    depends on its op (``n`` of a linear, of a convolution) has one entry per meaning."""

    label: str
    name: str
    meaning: str
    megatron: str
    pytorch: str
    ops: Tuple[str, ...] = ()


_DATA = "for data parallelism, each rank takes a slice of the batch"
_DATA_TORCH = "`DistributedDataParallel`; as a placement, `Shard(0)` of the batch"

SPLITS: Tuple[Term, ...] = (
    Term("n", "column-parallel", "a linear's output features (the weight's rows): each device computes a "
         "slice of the output's last axis", "`ColumnParallelLinear`", "`ColwiseParallel`", ("linear", "addmm", "baddbmm")),
    Term("k", "row-parallel, partial sums", "a linear's input features (the weight's columns), a reduced "
         "axis: each device holds partial sums that an all-reduce (or a reduce-scatter) completes",
         "`RowParallelLinear`", "`RowwiseParallel`; its output is `Partial()`"),
    Term("m", "row split", "the rows of a matmul's left operand: each device computes a slice of "
         "the output's rows", "none of its own (a slice of the sequence in sequence parallelism)", "`Shard(-2)`"),
    Term("v", "vocabulary-parallel", "an embedding table's rows, the vocabulary: each device looks up "
         "the tokens its rows hold and gives zeros for the rest, so the output is a partial sum",
         "`VocabParallelEmbedding`", "`RowwiseParallel` on an `nn.Embedding`"),
    Term("c", "vocabulary-parallel loss", "a cross-entropy's classes (the vocabulary the column-parallel "
         "output head left split): each device reduces its classes, and the loss sums them",
         "`vocab_parallel_cross_entropy`", "`loss_parallel()`", ("loss",)),
    Term("c", "channel split, partial sums", "a convolution's input channels, reduced: each device holds "
         "partial sums, as a row-parallel linear does", "none (no convolutions)", "`RowwiseParallel`-like, `Partial()`",
         ("conv",)),
    Term("c", "channel split", "a batch norm's channels: each device normalises its channels",
         "none (no batch norm)", "`Shard(1)`", ("batch_norm",)),
    Term("o", "column-parallel (channels)", "a convolution's output channels: each device computes a "
         "slice of them", "none (no convolutions)", "`ColwiseParallel`-like, `Shard(1)`"),
    Term("n", "batch-split", "the samples of a convolution, batch norm or loss: " + _DATA,
         "data parallelism", _DATA_TORCH, ("conv", "batch_norm", "loss")),
    Term("h", "head-split", "attention heads (or the fused query, key and value blocks, split the same "
         "way): each device runs its heads whole", "tensor-parallel attention (`num_attention_heads` "
         "divided over the tensor-parallel ranks)", "`ColwiseParallel` on q, k, v and local heads"),
    Term("*0", "batch-split", "the first leading dim an op broadcasts over (a linear's, an "
         "embedding's, a norm's `*`): the batch, " + _DATA, "data parallelism", _DATA_TORCH),
    Term("*1", "sequence-sharded", "the second leading dim: the sequence of a `[batch, seq, hidden]` "
         "tensor; the norms, dropouts and residual adds between tensor-parallel linears",
         "sequence parallelism (`--sequence-parallel`)", "`SequenceParallel`; `Shard(1)`"),
    Term("d0", "batch-split", "dim 0 of an elementwise, transpose or shape op: the batch, " + _DATA,
         "data parallelism", _DATA_TORCH),
    Term("g0", "batch-split", "group 0 of a view or reshape (the dims it keeps or merges): the "
         "batch. " + _DATA, "data parallelism", _DATA_TORCH),
    Term("b0", "batch-split", "batch dim 0 of a matmul or attention: the batch, " + _DATA,
         "data parallelism", _DATA_TORCH),
    Term("d1", "dim 1", "dim 1 of an elementwise, transpose or shape op; it follows the split of the op "
         "before it: the sequence of `[batch, seq, hidden]` (sequence-sharded), or the heads of "
         "`[batch, heads, seq, head_dim]` (head-split). `d2`, `d3`, ... are dims 2, 3, ...",
         "sequence parallelism, or the heads of tensor-parallel attention", "`Shard(1)` (`Shard(d)` for `dd`)"),
    Term("g1", "group 1", "group 1 of a view or reshape; as `d1`, it carries the split of the op before it "
         "(the heads when `[batch, seq, heads * head_dim]` becomes `[batch, seq, heads, head_dim]`: "
         "`g2`). `g2`, `g3`, ... are groups 2, 3, ...", "tensor-parallel attention's heads",
         "`Shard(d)` of the group's first dim"),
    Term("b1", "batch dim 1", "batch dim 1 of a matmul or attention: the heads of "
         "`[batch, heads, seq, head_dim]` (head-split). `b2`, ... are batch dims 2, ...",
         "tensor-parallel attention's heads", "`Shard(1)`"),
)
"""Every split label the shipped rules write, with its meaning. A positional family (``d``, ``g``,
``b``, ``*``) lists its dim 0 and dim 1; ``split_term`` answers a higher dim from dim 1's entry."""

LAYOUTS: Tuple[Term, ...] = (
    Term(LayoutKind.REPLICATED.value, "replicated", "every device holds the whole tensor",
         "replicated (each tensor-parallel rank a full copy)", "`Replicate()`"),
    Term("S(d)", "split on dim d", "device `i` holds slice `i` along dim `d` (`S(0, 3 blocks)`: slice "
         "`i` of each of 3 blocks, a fused qkv weight)", "partitioned (`partition_dim`)", "`Shard(d)`"),
    Term(LayoutKind.PARTIAL.value, "partial sums", "the tensor is the sum of what the devices hold (a split "
         "reduced axis, before its all-reduce)", "a row-parallel linear's output before "
         "`reduce_from_tensor_model_parallel_region`", "`Partial()`"),
    Term(LayoutKind.SUM_GRAD.value, "sum-gradient", "replicated forward, but each device computes part of "
         "the gradient, so the backward sums it over the group (a column-parallel linear's input; a "
         "data-parallel weight)", "the *f* operator, `copy_to_tensor_model_parallel_region`",
         "`Replicate()` whose gradient is `Partial()`"),
    Term(LayoutKind.FIRST_ONLY.value, "first-only", "the value counts on the first device only, the others hold "
         "zeros (a row-parallel linear's bias, which would otherwise be added once per device)",
         "a row-parallel linear's bias, added after the all-reduce", "`Partial()` with the value on one rank"),
)
"""Every layout word of ``nbscaler.layouts.LayoutKind``, with ``S(d)`` for ``SPLIT``."""

_CONTEXT_KINDS = {"ring": "ring", "all_gather": "all-gather"}
"""How a context-parallel attention's kind reads (``nbscaler.layouts.ContextKind``)."""
_CP_MEGATRON = "context parallelism (`--context-parallel-size`)"
_CP_TORCH = "`torch.distributed.tensor.experimental.context_parallel`"

CONTEXT_SPLITS: Tuple[Term, ...] = (
    Term("any", "sequence (context parallel, mirrored chunks)", "any op that reads the sequence under "
         "`context_parallel`: each device runs it on its two chunks of the sequence, `i` and `2n-1-i` of `2n` "
         "(`nbscaler.blocks.MIRRORED`), so a causal mask gives every device the same work", _CP_MEGATRON,
         _CP_TORCH + " (its load-balanced `Shard(1)`)"),
    Term("t", "queries (context parallel, ring)", "an attention split by its queries: each device attends "
         "from its chunks to every key, the keys and values passed round the devices one block a step",
         "context parallelism's ring (`--cp-comm-type p2p`, the default)",
         _CP_TORCH + " with `set_rotate_method('alltoall')`", ("attention",)),
    Term("t", "queries (context parallel, all-gather)", "an attention split by its queries: each device "
         "gathers every key and value whole, then attends from its chunks", "context parallelism with "
         "all-gathered keys (`--cp-comm-type all_gather`)", _CP_TORCH + " with `set_rotate_method('allgather')`",
         ("attention",)),
    Term("n", "tokens (context parallel)", "a mean cross-entropy split by its tokens: each device's part of "
         "the mean (its sum over the group's token count)", "the loss of context parallelism's sequence "
         "shards", "none of its own (each rank's loss over its shard of the sequence)", ("loss",)),
)
"""The names of context parallelism's splits (``context_name``): what they cut, whatever the label."""


def context_name(op: Optional[str], context: str) -> str:
    """The readable name of a split of context parallelism of op ``op``: ``context`` is its kind for
    an attention (``'ring'``: ``'queries (context parallel, ring)'``), anything for another op
    (``nbscaler.ir.layer_rules.context_splits``)."""
    if op == "attention":
        return f"queries (context parallel, {_CONTEXT_KINDS.get(context, context)})"
    if op == "loss":
        return "tokens (context parallel)"
    return "sequence (context parallel, mirrored chunks)"


_EP_MEGATRON = "expert parallelism (`--expert-model-parallel-size`)"
_EP_TORCH = "none of its own (`all_to_all_single` around the experts; torchtitan's `ExpertParallel`)"
_EXPERT_OPS = ("dropless_experts", "capacity_experts")

EXPERT_SPLITS: Tuple[Term, ...] = (
    Term("n", "tokens (expert parallel, dropless)", "a routed-experts op under `expert_parallel`: each device "
         "routes its share of the tokens and holds `E/n` of the experts; every (token, expert) pair goes to its "
         "expert's device and back (all-to-alls whose sizes follow the routing, after one of the counts)",
         _EP_MEGATRON + " with `--moe-token-dispatcher-type alltoall`", _EP_TORCH, _EXPERT_OPS[:1]),
    Term("n", "tokens (expert parallel, capacity)", "the same with capacity routing: each device fills every "
         "expert's fixed-size buffers, and the other devices' experts' share travels in all-to-alls of equal sizes",
         _EP_MEGATRON + " with `--moe-expert-capacity-factor`", _EP_TORCH, _EXPERT_OPS[1:]),
)
"""The names of expert parallelism's splits (``expert_name``): what they cut, whatever the label."""


EXPERT_ALL_TO_ALLS: Tuple[Term, ...] = (
    Term(Collective.EXPERT_EXCHANGE.value, "expert all-to-all (expert parallel)", "an expert-parallel op's rows "
         "sent to the devices that hold their experts, or back home: an all-to-all whose sizes follow the routing "
         "(dropless) or are fixed (capacity); its backward sends the rows' gradients the other way",
         "the `alltoall` token dispatcher's dispatch and combine", "`all_to_all_single` with split sizes"),
    Term(Collective.EXPERT_COUNTS.value, "expert counts (expert parallel)", "under dropless routing, the pairs each "
         "device routes to each expert, sent to every device before the rows so that each knows what it will get",
         "the `alltoall` token dispatcher's exchange of `tokens_per_expert`", "`all_to_all_single` of the counts"),
)
"""The collectives an expert-parallel op runs inside its call, by the name the plan's collectives
table gives them; the timeline's legend names them so (``nbscaler.widgets.palette``)."""


def expert_name(op: Optional[str]) -> str:
    """The readable name of the split of an expert-parallel op ``op`` (``'dropless_experts'``:
    ``'tokens (expert parallel, dropless)'``)."""
    routing = "capacity" if op == _EXPERT_OPS[1] else "dropless"
    return f"tokens (expert parallel, {routing})"


def experts_text(held: range, total: int, top_k: int, routing: str) -> str:
    """How a view names the experts of one op: ``'experts 0–7, top-2, dropless'`` for all of them,
    ``'experts 4..7 of 8, top-2, dropless'`` for the share one device holds
    (``nbscaler.ir.expert_rules.held_experts``)."""
    which = (f"experts {held[0]}\u2013{held[-1]}" if len(held) == total
             else f"experts {held[0]}..{held[-1]} of {total}")
    return f"{which}, top-{top_k}, {routing}"


_POSITIONAL = re.compile(r"^(\*|d|g|b)(\d+)$")


def split_term(label: str, op: Optional[str] = None) -> Optional[Term]:
    """The glossary's entry for split ``label`` of op ``op`` (``None`` for a label it has none for)."""
    found = [t for t in SPLITS if t.label == label and (not t.ops or op in t.ops)]
    if not found:
        positional = _POSITIONAL.match(label)
        if positional and int(positional.group(2)) > 1 and positional.group(1) != "*":
            return split_term(positional.group(1) + "1", op)
        return None
    return sorted(found, key=lambda t: not t.ops)[0]          # an op's own entry before the general one


def split_name(label: Optional[str], op: Optional[str] = None, context: Optional[str] = None) -> str:
    """The readable name of split ``label`` of op ``op``: ``'column-parallel'``, ``'dim 2'``,
    ``'replicated'`` for no split; a label the glossary has no entry for is its own name.
    ``context``: the op's entry of ``parallel_splits`` when context parallelism split it (``context_name``),
    or expert parallelism (``EXPERT_SPLIT``: ``expert_name``)."""
    if not isinstance(label, str):
        return REPLICATED
    if context == EXPERT_SPLIT:
        return expert_name(op)
    if context:
        return context_name(op, context)
    term = split_term(label, op)
    if term is None:
        return f"dim {label[1:]}" if _POSITIONAL.match(label) else label
    positional = _POSITIONAL.match(label)
    if positional and int(positional.group(2)) > 1 and term.label != label:
        return f"{term.name.rsplit(' ', 1)[0]} {positional.group(2)}"
    return term.name


def split_text(label: Optional[str], op: Optional[str] = None, context: Optional[str] = None) -> str:
    """``split_name`` with the label beside it, where a view has room for one word: ``'column-parallel (n)'``,
    ``'sequence (context parallel, mirrored chunks; d1)'``."""
    name = split_name(label, op, context)
    if context and isinstance(label, str):
        return f"{name[:-1]}; {label})"
    return name if not isinstance(label, str) or name == label or name.endswith(f"({label})") else f"{name} ({label})"


_SPLIT_LAYOUT = re.compile(r"^S\((\d+)(.*)\)$")


def layout_name(layout: Optional[str]) -> str:
    """The readable name of a layout as ``str(Layout)`` writes it: ``'R*'`` -> ``'sum-gradient'``,
    ``'S(1)'`` -> ``'split on dim 1'``; an unknown one is its own name."""
    text = str(layout)
    if ")xS(" in text:                          # cut twice: the first, then each part again
        outer, inner = text.split(")xS(", 1)
        return f"{layout_name(outer + ')')}, each part {layout_name('S(' + inner)}"
    split = _SPLIT_LAYOUT.match(text)
    if split:
        return f"split on dim {split.group(1)}" + (f" ({split.group(2).lstrip(', ')})" if split.group(2) else "")
    return next((t.name for t in LAYOUTS if t.label == text), text)


def layout_text(layout: Optional[str]) -> str:
    """``layout_name`` with the short form beside it: ``'sum-gradient (R*)'``."""
    name = layout_name(layout)
    return name if name == str(layout) else f"{name} ({layout})"


def legend(labels: List[Tuple]) -> str:
    """One line naming the ``(label, op)`` splits a view shows: ``'n column-parallel · k row-parallel ...'``
    (``(label, op, context)`` for splits of context parallelism, as ``split_name`` takes them)."""
    seen = {}
    for label, op, *context in labels:
        if isinstance(label, str):
            seen.setdefault(label, split_name(label, op, *context))
    return " · ".join(f"{label} {name}" for label, name in sorted(seen.items()))


def _row(t: Term, label: str) -> str:
    where = f" (on {', '.join(t.ops)})" if t.ops else ""
    return f"| `{label}`{where} | {t.name} | {t.meaning} | {t.megatron} | {t.pytorch} |"


def markdown() -> str:
    """The glossary page, ``docs/glossary.md``: both tables, every label of ``SPLITS`` and ``LAYOUTS``."""
    head = "| label | readable name | what it means | Megatron-LM | PyTorch |\n| --- | --- | --- | --- | --- |"
    return "\n".join([
        "# Glossary: splits and layouts", "",
        "The plan tables, the graph view, the reports and the walkthroughs name how an op is split and how a",
        "tensor is laid out with short labels. The views print the readable name with the label beside it",
        "(`column-parallel (n)`); this page says what each one means, and what Megatron-LM and PyTorch call it.",
        "It is written from `nbscaler/glossary.py` (`python -m nbscaler.glossary > docs/glossary.md`), and",
        "the test suite checks that the two agree.", "",
        "## Split labels", "",
        "An op's split label (`plan.ops.split`) is the name, in the op's annotation, of the dimension the",
        "policy split it along: `F.linear` is `'* k+, n k+ -> * n'`, so split `n` is column-parallel and",
        "split `k` (marked `+`, a reduced axis; the graph view writes `k+`) leaves partial sums. An op",
        "with no split runs whole on every device: `replicated`. Numbered labels are positional (`d2`:",
        "the op's dim 2), and carry the split of the op before them.", "",
        head, *[_row(t, t.label) for t in SPLITS], "",
        "## Layouts", "",
        "What each device holds of a tensor (`plan.storage` for the weights; `have` and `want` in the",
        "collectives table, where a collective turns one into the other; `nbscaler.layouts`).", "",
        head, *[_row(t, t.label) for t in LAYOUTS], "",
        "## Context parallelism", "",
        "Under `context_parallel` (`docs/policies.md`) every op that reads the sequence is cut along it in",
        "mirrored chunks, whatever its label says of its own axes: the views name such a split by what it",
        "cuts, with the label after a semicolon (`sequence (context parallel, mirrored chunks; d1)`).", "",
        head, *[_row(t, t.label) for t in CONTEXT_SPLITS], "",
        "## Expert parallelism", "",
        "Under `expert_parallel` (`docs/policies.md`) a routed-experts op is split by its tokens and its experts",
        "over the same devices: the views name it by what it cuts (`tokens (expert parallel, dropless; n)`), its",
        "box by the experts it holds (`experts 4..7 of 8, top-2, dropless`), and its weights' layout `S(0)` is",
        "split over the expert group by experts. With `expert_tensor_parallel` the devices are expert groups,",
        "each cutting its experts by hidden unit: the layout `S(0)xS(d)` (`split on dim 0, each part split on",
        "dim d`) is split by expert over the groups and each part again over the group's devices along the",
        "hidden dim `d`, and the box adds the hidden units a device holds.", "",
        head, *[_row(t, t.label) for t in EXPERT_SPLITS], "",
        "The memory view draws the experts' part of each rank's parameters, gradients and optimizer state",
        "as `expert weights`, `expert gradients` and `expert optimizer state`; `RoutingView(log, plan)` draws a real",
        "routing per step, its **busiest over mean** the step's calls' busiest rank (or expert) over the mean.", "",
        "Its all-to-alls, as the plan's collectives table names them and the timeline draws them in each",
        "rank's collectives lane:", "",
        head, *[_row(t, t.label) for t in EXPERT_ALL_TO_ALLS], "",
    ])


if __name__ == "__main__":
    print(markdown(), end="")
