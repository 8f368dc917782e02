"""Context parallelism's collectives on a timeline: each attention's ring passes, or its keys' all-gathers.

A context-parallel attention (``nbscaler.attention.context_attention``) reads the other devices'
keys and values one of two ways (``pas_config['context_parallel_kind']``):

- ``ring``: the keys and values stay split and pass round the group inside the call. The forward
  computes ``n`` blocks and passes the keys and values on between them, ``n-1`` steps; the
  backward passes each block again with its gradients, ``n`` steps, the last bringing this
  device's gradients home. The passes are the traffic table's ``ring_pass`` rows
  (``nbscaler.comm.traffic``): priced here as the all-gather that moves the same bytes (``(n-1)/n``
  of the keys' and values' bytes forward, ``(2n-1)/n`` backward), that time split over the steps
  by what each carries (a forward step one block of keys and values; a backward step the block and
  its gradients, the last one only the gradients). They start where the attention does in its
  forward or backward, one after the other, and after the passes of the attention before. The ring
  passes while the attention computes, and the step's blocks add only what that compute does not
  hide and the backward's last pass, home (``ring_exposed``): where the passes take longer than the
  compute, the drawing shows them running past it.
- ``all_gather``: the keys and values are all-gathered before the call (``comm.all_gather_sum_grad``),
  their gradients reduce-scattered after its backward; the step model counts these in the block,
  which waits for them.

Where the attention sits in its block: the share of the block's ops and collectives (as
``cost.timing.section_time`` adds them) that run before it, in the forward's order, or in the
backward's, which is the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from nbscaler.attention.online import ring_source
from nbscaler.cost.local import LocalRun
from nbscaler.ir.graph import IRNode
from nbscaler.ir.layer_rules import context_group, context_parallel, context_ring
from nbscaler.layouts import Collective
from nbscaler.schedule import CollectiveBlock, TimedBlock


@dataclass(frozen=True)
class ContextCall:
    """One collective of a context-parallel attention in one block of a section: ``kind``, its
    label, when it starts as a share of the block (``at``) and how many seconds it lasts; ``waits``:
    whether the block waits for it (the keys' all-gathers) or it runs while the attention computes
    (the ring)."""

    phase: str
    kind: str
    label: str
    at: float
    seconds: float
    waits: bool
    context: bool = True        # False: an expert-parallel op's all-to-all (``cost.expert_calls``)


def where(node: IRNode) -> str:
    """How a label names an attention: its module, else its op name."""
    return node.module_path or node.name


def ring_seconds(node: IRNode, comm) -> Tuple[float, float]:
    """Forward and backward seconds of ``node``'s ring passes on ``comm``'s model: each of its keys
    and values priced as the all-gather that moves the ``ring_pass`` row's bytes."""
    ranks = context_group(node)
    n = len(ranks)
    fwd = bwd = 0.0
    for t in node.inputs[1:3]:
        block = t.nbytes // n                                  # this device's rows
        fwd += comm.forward(Collective.RING_PASS, block, n, ranks=ranks)
        bwd += comm.backward(Collective.RING_PASS, block, n, ranks=ranks)
    return fwd, bwd


def ring_exposed(op, comm, time_op: Callable, again: bool = True) -> Tuple[float, float]:
    """Forward and backward seconds a ring attention's passes add to its op (zeros for any other
    op), by the overlap rule of ``nbscaler.attention``: the forward passes the next block while it
    computes on the one in hand, so of its ``n-1`` passes what ``(n-1)/n`` of the attention's forward
    does not cover is exposed. The backward passes a block on while its share computes, and the
    block's gradients too, received from the previous device: of its ``2n-1`` passes (``n-1`` of
    blocks, ``n`` of gradients) the last, home, waits alone, and of the others what ``(n-1)/n`` of
    the attention's backward does not cover. A recomputed ring's forward counts again in the
    backward (unless ``again`` is False: a caller that adds it itself). ``time_op``: an op's forward
    and backward seconds (``profiler.time``)."""
    if not context_ring(op.node):
        return 0.0, 0.0
    passes_f, passes_b = ring_seconds(op.node, comm)
    n = len(context_group(op.node))
    compute_f, compute_b = time_op(op)
    exposed_f = max(0.0, passes_f - compute_f * (n - 1) / n)
    home = passes_b / (2 * n - 1)
    exposed_b = home + max(0.0, passes_b - home - compute_b * (n - 1) / n)
    return exposed_f, exposed_b + (exposed_f if again and op.recomputed else 0.0)


def rings_seconds(run: LocalRun, comm, time_op: Callable) -> Tuple[float, float]:
    """What the rings of a section's attentions add to its time (``ring_exposed``, summed)."""
    fwd = bwd = 0.0
    for op in run.ops:
        f, b = ring_exposed(op, comm, time_op)
        fwd, bwd = fwd + f, bwd + b
    return fwd, bwd


def ring_steps(node: IRNode, device: int) -> Tuple[List[str], List[str], List[float]]:
    """The labels of ``node``'s forward and backward ring steps on plan ``device``, and the share
    of the backward's time each backward step takes (by the blocks it carries)."""
    devices = context_group(node, device)
    n, i, at = len(devices), devices.index(device), where(node)
    forward = [f"ring step {k}/{n - 1} of {at}: keys and values of device {devices[ring_source(i, k, n)]}"
               for k in range(1, n)]
    backward = [f"ring step {k}/{n} of {at} (backward): keys, values and their gradients of device "
                f"{devices[ring_source(i, k, n)]}" for k in range(1, n)]
    backward.append(f"ring step {n}/{n} of {at} (backward): the gradients of its own keys and values, home")
    shares = [2.0 / (2 * n - 1)] * (n - 1) + [1.0 / (2 * n - 1)]
    return forward, backward, shares


Item = Tuple[str, Any, float, float]
"""One thing a section does: ``('op', OpCall, ...)`` or ``('collective', CollectiveCall, ...)``, its
forward and backward seconds (a recomputed one's forward again in its backward)."""


def forward_items(run: LocalRun, time_op: Callable, comm) -> List[Item]:
    """What one section does in the forward's order, each op after the collectives that fetch its
    inputs (an op's own, such as an expert exchange, among them), outputs' fetches last; the
    backward runs them in the reverse order. ``time_op`` and ``comm`` as ``section_calls`` takes them."""
    fetched: Dict[Optional[str], list] = {}
    for c in run.collectives:
        fetched.setdefault(c.node, []).append(c)
    items: List[Item] = []
    for op in run.ops:
        for c in fetched.pop(op.node.name, []):
            items.append(("collective", c, *c.seconds(comm)))
        f, b = time_op(op)
        items.append(("op", op, f, b + (f if op.recomputed else 0.0)))
    for calls in fetched.values():
        for c in calls:
            items.append(("collective", c, *c.seconds(comm)))
    return items


def section_calls(run: LocalRun, time_op: Callable, comm) -> List[ContextCall]:
    """The context-parallel collectives of one section (``run``: a device's forward, or one stage of
    it), each placed as a share of its forward or backward block (module docstring).

    ``time_op``: forward and backward seconds of an op (``profiler.time``); ``comm``: the model
    that prices collectives (``CommModel`` or, on a target, ``NcclModel``)."""
    attentions = {op.node.name: op.node for op in run.ops if context_parallel(op.node) == "attention"}
    if not attentions:
        return []
    items = forward_items(run, time_op, comm)
    total_f = sum(f for _, _, f, _ in items) or 1.0
    total_b = sum(b for _, _, _, b in items) or 1.0
    out: List[ContextCall] = []
    done_f = 0.0
    for k, (what, item, f, b) in enumerate(items):
        after_b = sum(x[3] for x in items[k + 1:])           # the backward reaches this item after those
        node = attentions.get(item.node.name) if what == "op" else attentions.get(item.node)
        if node is not None and what == "op" and context_ring(node):
            fwd_s, bwd_s = ring_seconds(node, comm)
            forward, backward, shares = ring_steps(node, run.device)
            out += [ContextCall("F", Collective.RING_PASS, label, done_f / total_f, fwd_s / len(forward), False)
                    for label in forward]
            out += [ContextCall("B", Collective.RING_PASS, label, after_b / total_b, bwd_s * share, False)
                    for label, share in zip(backward, shares)]
        elif node is not None and what == "collective" and item.fn == Collective.ALL_GATHER_SUM_GRAD:
            role = {node.inputs[1].name: "keys", node.inputs[2].name: "values"}.get(item.tensor, item.tensor)
            group = list(item.devices)
            out.append(ContextCall("F", Collective.ALL_GATHER, f"{role} of {where(node)}, all-gathered over {group}",
                                   done_f / total_f, f, True))
            out.append(ContextCall("B", Collective.REDUCE_SCATTER, f"gradients of the {role} of {where(node)}, "
                                   f"reduce-scattered over {group}", after_b / total_b, b, True))
        done_f += f
    return out


def timeline_calls(blocks: Sequence[TimedBlock], calls_of: Callable[[int, int], List[ContextCall]]
                   ) -> List[CollectiveBlock]:
    """``CollectiveBlock``s of context (and expert) parallelism for ``blocks``: ``calls_of(rank, stage)``
    gives the section's ``ContextCall``s. A ring's steps run one after the other on the rank's link, from
    where the attention starts or, when the passes before it have not ended (an attention returns
    only once its ring has), from their end."""
    out: List[CollectiveBlock] = []
    link: Dict[int, float] = {}                             # rank -> when its last ring step ends
    for blk in sorted(blocks, key=lambda b: (b.rank, b.t_start)):
        if blk.phase not in ("F", "B"):
            continue
        for call in sorted((c for c in calls_of(blk.rank, blk.stage) if c.phase == blk.phase), key=lambda c: c.at):
            start = blk.t_start + call.at * (blk.t_end - blk.t_start)
            if not call.waits:
                start = max(start, link.get(blk.rank, start))
                link[blk.rank] = start + call.seconds
            out.append(CollectiveBlock(blk.rank, blk.stage, blk.micro, blk.phase, str(call.kind), call.label, start,
                                       start + call.seconds, call.seconds if call.waits else 0.0,
                                       context=call.context))
    return out
