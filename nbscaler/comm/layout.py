"""Layouts of a tensor over the devices of a group, and the collectives that change them.

After partitioning, each device of a group holds some piece of every tensor (the terms are
``nbscaler.layouts.LayoutKind``'s). Three layouts cover what a producer leaves behind:

- ``R``: replicated, every device holds the whole tensor;
- ``S(d)``: split, device ``i`` holds slice ``i`` along dim ``d``; ``S(d, 3 blocks)`` is strided: dim
  ``d`` is three equal blocks side by side (q, k and v of a fused projection) and device ``i`` holds
  slice ``i`` of each, concatenated (its own heads of q, k and v);
- ``P``: partial, the tensor is the *sum* of what the devices hold (a split reduction axis).

A consumer asks for one of four *requirements*: ``R``, ``S(d)``, and two that only matter for the
backward pass:

- ``R*`` (replicated, partial gradients): the op is split along an axis this input does not have,
  e.g. the input ``x`` of a column-parallel linear. Each device then computes only part of ``x``'s
  gradient, so the conversion sums gradients in the backward pass (Megatron's *f* operator).
- ``V`` (value on the first device only): the op is split along a reduction axis this input lacks,
  e.g. the bias of a row-parallel linear. Adding it on every device would count it ``n`` times, so
  the first device adds it and the others add zeros.

``conversion(have, want)`` gives the steps, each a differentiable collective in
``nbscaler.runtime.collectives`` whose backward is the matching collective. The gradient of an
``R`` tensor is full on every device, of ``S(d)`` split like the tensor, and of ``P`` full.

>>> conversion(Layout.split(2), Layout.replicated())
[Step(fn='all_gather', dim=2)]
>>> conversion(Layout.partial(), Layout.split(0))
[Step(fn='reduce_scatter', dim=0)]
>>> conversion(Layout.split(1), Layout("R*"))
[Step(fn='all_gather_sum_grad', dim=1)]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence, Tuple

from nbscaler.blocks import Blocks, combine, describe, is_strided
from nbscaler.ir.graph import Axis, IRNode, Placement
from nbscaler.ir.expert_rules import EXPERT_WEIGHTS, expert_hidden_parts, expert_parallel, expert_tensor_parallel
from nbscaler.ir.layer_rules import context_ring, vocab_parallel
from nbscaler.layouts import Collective, LayoutKind

R, S, P, SUM_GRAD, FIRST_ONLY = LayoutKind


@dataclass(frozen=True)
class Layout:
    kind: LayoutKind
    dim: Optional[int] = None
    blocks: Blocks = 1            # S only: blocks along dim, each split across the devices
    inner: Optional["InnerCut"] = None   # S only: each part cut again (experts by hidden unit)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", LayoutKind(self.kind))     # 'R*' given as text reads as SUM_GRAD

    @classmethod
    def replicated(cls) -> "Layout":
        return cls(R)

    @classmethod
    def split(cls, dim: int, blocks: Blocks = 1) -> "Layout":
        return cls(S, dim, blocks)

    @classmethod
    def partial(cls) -> "Layout":
        return cls(P)

    @classmethod
    def grid(cls, outer: "Layout", inner: "Layout", parts: int) -> "Layout":
        """The layout over a grid of groups of ``parts`` neighbours: ``outer`` across the groups,
        ``inner`` inside each."""
        return cls(outer.kind, outer.dim, outer.blocks, InnerCut(inner.dim, parts, inner.blocks, inner.kind))

    @property
    def outer(self) -> "Layout":
        """This layout across the groups of a grid (itself when it is not over a grid)."""
        return Layout(self.kind, self.dim, self.blocks)

    @property
    def inner_layout(self) -> "Layout":
        """This layout inside each group of a grid."""
        return Layout(self.inner.kind, self.inner.dim, self.inner.blocks)

    def __str__(self) -> str:
        if self.inner is not None:
            return f"{self.outer}x{self.inner_layout}"
        if self.kind != S:
            return str(self.kind)
        return f"S({self.dim}, {describe(self.blocks)})" if is_strided(self.blocks) else f"S({self.dim})"

    @property
    def label(self) -> str:
        """A suffix for variable names in generated code: what the collective made of the tensor
        (``full``, ``split1``, ``sum_grad``: whole here, its gradient summed over the group;
        ``split1_full`` over a grid: the first across the groups, the second inside each)."""
        if self.inner is not None:
            return f"{self.outer.label}_{self.inner_layout.label}"
        strided = "x" + "_".join(map(str, self.blocks if isinstance(self.blocks, tuple) else [self.blocks]))
        strided = strided if is_strided(self.blocks) else ""
        return {R: "full", P: "partial", SUM_GRAD: "sum_grad", FIRST_ONLY: "first_only"}.get(self.kind,
                                                                                          f"split{self.dim}{strided}")


@dataclass(frozen=True)
class InnerCut:
    """The layout inside each group of ``parts`` neighbouring devices, over a grid: the layout's own
    kind, dim and blocks say how the groups share the tensor, these how the devices of a group
    share their group's part. Split twice (``kind`` ``S``), device ``i`` of ``n`` holds part
    ``i // parts`` of ``n // parts`` along the layout's ``dim``, and of that part, part
    ``i % parts`` along ``dim`` here (in ``blocks``): expert weights under expert parallelism with
    tensor parallelism inside each expert, or an activation of tensor parallelism inside context
    parallelism. Conversions change one axis at a time, each over its own sub-group (``grid_legs``)."""

    dim: Optional[int]
    parts: int
    blocks: Blocks = 1
    kind: LayoutKind = S


@dataclass(frozen=True)
class Step:
    """One collective: ``fn`` names a function of ``nbscaler.runtime.collectives``, run over the
    fetch's devices (over a grid, the sub-group of one axis)."""

    fn: Collective
    dim: Optional[int] = None
    dim2: Optional[int] = None
    blocks: Blocks = 1


def local_shape(shape: Sequence[int], layout: Layout, parts: int) -> Tuple[int, ...]:
    """The shape of one device's piece of a tensor of ``shape`` in ``layout`` over ``parts`` devices."""
    if layout.inner is not None:        # the groups' part, then each device's share of it
        shape = local_shape(shape, layout.outer, parts // layout.inner.parts)
        return local_shape(shape, layout.inner_layout, layout.inner.parts)
    shape = list(shape)
    if layout.kind == S:
        shape[layout.dim] //= parts
    return tuple(shape)


def output_layout(node: IRNode, index: int, place: Optional[Placement] = None) -> Layout:
    """The layout ``node`` leaves its ``index``-th tensor output in (under ``place``, by default
    the node's own placement: a search can ask about placements it is only considering)."""
    place = place or node.placement
    if place is not None and place.inner is not None:       # over a grid: each axis by the rules of one
        return Layout.grid(*(output_layout(node, index, place.axis_view(a)) for a in Axis), place.inner.parts)
    if place is None or place.split is None:
        return Layout.replicated()
    _, out_dims = node.annotation.split_dims(place.split)
    if out_dims[index] is not None:
        return Layout.split(out_dims[index], place.blocks)
    return Layout.partial()


def input_requirement(node: IRNode, index: int, place: Optional[Placement] = None) -> Layout:
    """What ``node`` needs of its ``index``-th tensor input (under ``place``, as above)."""
    place = place or node.placement
    if place is not None and place.inner is not None:       # over a grid: each axis by the rules of one
        return Layout.grid(*(input_requirement(node, index, place.axis_view(a)) for a in Axis), place.inner.parts)
    if place is None or place.split is None:
        return Layout.replicated()
    if vocab_parallel(node, place) and not node.inputs[index].dtype.is_floating_point:
        return Layout.replicated()      # token ids: each device looks every one up in its share of the vocabulary
    if expert_parallel(node) and index in EXPERT_WEIGHTS:
        return expert_weight_layout(node, index)    # this device's experts; its tokens' pairs travel to theirs
    if context_ring(node, place) and index in (1, 2):
        return Layout.split(node.annotation.inputs[index].index("s"), place.blocks)    # keys, values: round a ring
    in_dims, _ = node.annotation.split_dims(place.split)
    if in_dims[index] is not None:
        return Layout.split(in_dims[index], combine(place.blocks, node.annotation.grouped.get((index, place.split), 1)))
    if expert_tensor_parallel(node):
        return Layout(SUM_GRAD)         # a factor of every part of the experts' sum, not a term of it
    return Layout(FIRST_ONLY) if place.split in node.annotation.reduce else Layout(SUM_GRAD)


def expert_weight_layout(node: IRNode, index: int) -> Layout:
    """How expert-parallel ``node`` reads its ``index``-th input, an experts' weight: split by expert
    (dim 0), and each device's experts cut again by hidden unit where tensor parallelism runs
    inside them (``expert_hidden_parts``)."""
    parts = expert_hidden_parts(node)
    if parts == 1:
        return Layout.split(0)
    hidden = node.annotation.inputs[EXPERT_WEIGHTS[0]][-1]
    return Layout(S, 0, 1, InnerCut(node.annotation.inputs[index].index(hidden), parts))


def effective_requirement(want: Layout, carries_grad: bool) -> Layout:
    """What a reader asking for ``want`` gets of a tensor that carries a gradient or not: a
    sum-gradient request (``R*``) of a tensor without one is plain ``R``, since there is nothing
    to sum."""
    if want.inner is not None:
        return Layout.grid(effective_requirement(want.outer, carries_grad),
                           effective_requirement(want.inner_layout, carries_grad), want.inner.parts)
    return Layout.replicated() if want.kind == SUM_GRAD and not carries_grad else want


def on_grid(layout: Layout, parts: int) -> Layout:
    """``layout`` over a grid of groups of ``parts`` neighbours: itself if it is over one already;
    whole (or whole with a summed gradient) over every device is the same on both axes. Raises
    ``ValueError`` for a split over every device, which is no grid layout."""
    if layout.inner is not None:
        return layout
    if layout.kind not in (R, SUM_GRAD):
        raise ValueError(f"{layout} over every device of a grid has no layout per axis; convert it to R first")
    return Layout.grid(layout, layout, parts)


def grid_legs(have: Layout, want: Layout) -> List[Tuple["Axis", Layout, Layout]]:
    """The conversion of a tensor over a grid, one axis at a time: ``(axis, from, to)`` for each axis
    whose layout changes, inside the groups first (a partial sum all-reduced over the few
    neighbours before anything crosses the groups), then across them."""
    parts = (have.inner or want.inner).parts
    have, want = on_grid(have, parts), on_grid(want, parts)
    mid = Layout.grid(have.outer, want.inner_layout, parts)
    return [(axis, a, b) for axis, a, b in ((Axis.INNER, have, mid), (Axis.OUTER, mid, want)) if a != b]


def keeps_partial_grad(want: Layout, is_param: bool, partial_grads: bool) -> bool:
    """Whether a weight its readers want as ``want`` is stored whole with a *partial* gradient on
    each device (``R*``), summed by the reducer after the backward rather than inside it: a
    parameter read ``R*``, unless ``partial_grads=False`` (ZeRO stage 2)."""
    return want.kind == SUM_GRAD and is_param and partial_grads


def conversion(have: Layout, want: Layout) -> List[Step]:
    """The collectives that turn layout ``have`` into requirement ``want`` (empty when equal)."""
    if have == want:
        return []
    if have.inner is not None and want.inner is not None:      # one axis of a grid (``grid_legs``)
        if have.inner_layout == want.inner_layout:
            return conversion(have.outer, want.outer)
        if have.outer == want.outer:
            return conversion(have.inner_layout, want.inner_layout)
        raise ValueError(f"{have} to {want} changes both axes of a grid: convert one at a time (grid_legs)")
    if have.inner is not None or want.inner is not None:
        raise ValueError(f"no conversion from {have} to {want}: convert over a grid one axis at a time (grid_legs)")
    strided = is_strided(have.blocks) or is_strided(want.blocks)
    if have.kind == S and want.kind == S and not strided:
        return [Step(Collective.ALL_TO_ALL, dim=want.dim, dim2=have.dim)]
    # A weight stored R* (see storage_layouts) is whole on every device: its gradient sum is the reducer's.
    to_full: List[Step] = {R: [], SUM_GRAD: [], S: [Step(Collective.ALL_GATHER, dim=have.dim, blocks=have.blocks)],
                           P: [Step(Collective.ALL_REDUCE)]}[have.kind]
    if want.kind == R:
        return to_full
    if want.kind == S:
        if have.kind == P and not strided:
            return [Step(Collective.REDUCE_SCATTER, dim=want.dim)]
        return to_full + [Step(Collective.CHUNK, dim=want.dim, blocks=want.blocks)]
    if want.kind == SUM_GRAD:
        if have.kind == S:             # the gradient's sum and this device's slice of it: a reduce-scatter
            return [Step(Collective.ALL_GATHER_SUM_GRAD, dim=have.dim, blocks=have.blocks)]
        return to_full + [Step(Collective.SUM_GRAD)]
    if want.kind == FIRST_ONLY:
        return to_full + [Step(Collective.FIRST_ONLY)]
    raise ValueError(f"no conversion from {have} to {want}")


class LocalStep(NamedTuple):
    """One collective of a conversion with the local shapes it reads and makes on a device."""

    step: Step
    src_shape: Tuple[int, ...]
    dst_shape: Tuple[int, ...]


def local_steps(have: Layout, want: Layout, shape: Sequence[int], n: int) -> List[LocalStep]:
    """The steps of ``conversion(have, want)`` over ``n`` devices at local shapes, from a tensor
    whose local piece in ``have`` has ``shape``: each step reads what the one before made."""
    out: List[LocalStep] = []
    src = tuple(shape)
    for step in conversion(have, want):
        dst = step_shape(step, src, n)
        out.append(LocalStep(step, src, dst))
        src = dst
    return out


def step_shape(step: Step, shape: Sequence[int], n: int) -> Tuple[int, ...]:
    """The local shape one collective over ``n`` devices makes of a local input of ``shape``."""
    out = list(shape)
    if step.fn in (Collective.ALL_GATHER, Collective.ALL_GATHER_SUM_GRAD):
        out[step.dim] *= n
    elif step.fn in (Collective.CHUNK, Collective.REDUCE_SCATTER):
        out[step.dim] //= n
    elif step.fn == Collective.ALL_TO_ALL:
        out[step.dim], out[step.dim2] = out[step.dim] // n, out[step.dim2] * n
    return tuple(out)


def storage_layouts(graphs, partial_grads: bool = True) -> dict:
    """How each weight is stored on the devices of its consumers.

    - ``S(d)`` when every consumer in every graph wants the same slice on the same devices (a
      tensor-parallel weight);
    - ``R*`` for a parameter every consumer wants as ``R*`` on the same devices (its op splits the
      batch, as under ``data``; over a grid, ``R*`` across the groups: context parallelism): each device keeps the whole parameter and a *partial* gradient,
      which the reducer sums after the backward, bucketed with the others, rather than one
      all-reduce per use inside it (the weight spec says ``partial_grads=True``). With
      ``partial_grads=False`` (ZeRO stage 2) such a parameter is stored ``R``;
    - else ``R`` (whole on each device; consumers convert from there).
    """
    wants: dict = {}
    params = set()
    for graph in graphs:
        for node in graph.nodes:
            for i, t in enumerate(node.inputs):
                if t.is_weight:
                    wants.setdefault(t.name, set()).add((input_requirement(node, i), node.placement.devices))
                    if t.kind == "param":
                        params.add(t.name)
    layouts = {}
    for name, reqs in wants.items():
        want, _ = next(iter(reqs))
        single = len(reqs) == 1 and (want.kind == S or keeps_partial_grad(want, name in params, partial_grads))
        layouts[name] = _stored(want) if single else Layout.replicated()
    return layouts


def _stored(want: Layout) -> Layout:
    """How a weight all of whose readers want ``want`` is stored: as they want it (over a grid,
    ``R*`` on both axes is a partial gradient on every device, which the reducer sums), except over
    a grid where its readers add it once per group (``V``) or sum its gradient inside the group alone
    (``R*`` inside, not across): it is held whole inside each group, and each reader's conversion
    does that."""
    if want.inner is None or want.inner.kind in (R, S) or want.inner.kind == want.kind == SUM_GRAD:
        return want
    return Layout.grid(want.outer, Layout.replicated(), want.inner.parts)
