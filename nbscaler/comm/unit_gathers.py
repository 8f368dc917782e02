"""Where ZeRO stage 3 gathers and frees each unit's parameters in a rank's program.

``policy.shard_units`` says which unit each parameter belongs to (``graph.meta[SHARD_UNITS]``).
This pass reads a lowered section and puts, for each unit whose parameters the section reads:

- ``Unshard(unit, prefetch)`` just before the first instruction that reads one of them, naming the
  unit the section gathers next, whose all-gather the runtime starts at once so that it overlaps
  this unit's compute (FSDP's forward prefetch);
- ``Reshard(unit, outputs)`` just after the last one, when the unit is *released after its
  forward*: ``ComputeConfig.zero_reshard_after_forward`` is on, the unit is not ``REST_UNIT``, and
  no other unit's parameters are read between its first and last reader (else the unit stays
  gathered through the forward, as FSDP keeps its root). ``outputs`` are the values made inside
  the unit that later instructions read: the runtime passes them through a hook that gathers the
  unit again when the backward reaches it.

Every unit, released after its forward or not, is freed again once the backward has made and
reduce-scattered its gradients (``nbscaler.runtime.fsdp``).
"""

from __future__ import annotations

from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple, TypeVar

from nbscaler.comm.program import (Call, Fetch, Instruction, LocalWeight, Origin, Receive, Recompute, Reshard,
                                   Return, Section, Send, Unshard, Value)
from nbscaler.ir.graph import REST_UNIT, SHARD_RESHARD, SHARD_UNITS
from nbscaler.ir.shape_rules import VIEW_OPS


def unit_table(weights: List[LocalWeight]) -> Dict[str, Tuple[str, ...]]:
    """Unit -> the names of this rank's parameters in it, units in the order their first parameter
    comes in the weight table (the runtime's order); ``{}`` without ZeRO-3."""
    table: Dict[str, List[str]] = {}
    for w in weights:
        if w.kind == "param" and w.unit is not None:
            table.setdefault(w.unit, []).append(w.name)
    return {unit: tuple(names) for unit, names in table.items()}


def _fetch_values(fetches: Tuple[Fetch, ...]) -> Iterator[Tuple[Value, Value]]:
    for f in fetches:
        for c in f.steps:
            yield c.src, c.dst


def made_by(ins: Instruction) -> Iterator[Value]:
    """The values an instruction makes (its collectives' results included)."""
    if isinstance(ins, Receive):
        yield ins.value
    elif isinstance(ins, Call):
        yield from (dst for _, dst in _fetch_values(ins.fetches))
        yield from ins.outputs
    elif isinstance(ins, Recompute):
        yield from (dst for _, dst in _fetch_values(ins.fetches))
        for call in ins.body:
            yield from made_by(call)
    elif isinstance(ins, (Send, Return)):
        yield from (dst for _, dst in _fetch_values(ins.fetches))


def read_by(ins: Instruction) -> Iterator[Value]:
    """The values an instruction reads (its collectives' sources included)."""
    if isinstance(ins, Call):
        yield from (src for src, _ in _fetch_values(ins.fetches))
        yield from ins.inputs
    elif isinstance(ins, Recompute):
        yield from (src for src, _ in _fetch_values(ins.fetches))
        yield from ins.inputs
        for call in ins.body:
            yield from read_by(call)
    elif isinstance(ins, Send):
        yield from (src for src, _ in _fetch_values(ins.fetches))
        yield ins.value
    elif isinstance(ins, Return):
        yield from (src for src, _ in _fetch_values(ins.fetches))
        yield from ins.values.values()


def units_read(ins: Instruction, units_of: Dict[str, str]) -> Set[str]:
    """The units whose parameters ``ins`` reads."""
    return {units_of[v.tensor.name] for v in read_by(ins)
            if v.origin == Origin.WEIGHT and v.tensor.name in units_of}


def section_reads(body: Sequence[Instruction], units_of: Dict[str, str]) -> List[Set[str]]:
    """The units each instruction of ``body`` reads: their parameters, or views of them. A view (a
    chunk, a transpose: ``VIEW_OPS``) shares its parameter's storage, so the unit stays gathered
    until the view's last reader, as Hugging Face's experts read theirs (``nbscaler.experts.huggingface``)."""
    views: Dict[int, str] = {}                  # id of a view's tensor -> the unit of the parameter it shows
    reads = []
    for ins in body:
        reads.append(units_read(ins, units_of) | {views[id(v.tensor)] for v in read_by(ins) if id(v.tensor) in views})
        for call in ([ins] if isinstance(ins, Call) else list(ins.body) if isinstance(ins, Recompute) else []):
            if call.node.op not in VIEW_OPS:
                continue
            shown = [units_of.get(v.tensor.name) if v.origin == Origin.WEIGHT else views.get(id(v.tensor))
                     for v in call.inputs]
            unit = next((u for u in shown if u is not None), None)
            for v in call.outputs if unit is not None else ():
                views[id(v.tensor)] = unit
    return reads


T = TypeVar("T")


def with_gathers(body: Sequence[T], reads: Sequence[Set[str]], reshard_after_forward: bool,
                 gather: Callable[[str, Optional[str]], T], release: Callable[[str, int, int], T]) -> List[T]:
    """``body`` with each unit's gather and release put where the module docstring says, the one
    rule the lowering (``insert_unit_gathers``) and the time model (``cost.fsdp``) both follow.

    ``reads[i]``: the units ``body[i]`` reads; ``gather(unit, prefetch)`` makes what goes just
    before the unit's first reader (``prefetch``: the unit first read next, or ``None``);
    ``release(unit, first, last)`` what goes just after its last reader, for a unit released after
    its forward (``first`` and ``last``: the indexes of its first and last readers in ``body``)."""
    span: Dict[str, Tuple[int, int]] = {}
    for i, units in enumerate(reads):
        for u in units:
            span[u] = (span[u][0] if u in span else i, i)
    order = sorted(span, key=lambda u: span[u][0])
    released = {u for u in order if reshard_after_forward and u != REST_UNIT
                and not any(set(reads[i]) - {u} for i in range(span[u][0], span[u][1] + 1))}
    starts: Dict[int, List[str]] = {}
    ends: Dict[int, List[str]] = {}
    for u in order:
        starts.setdefault(span[u][0], []).append(u)
        if u in released:
            ends.setdefault(span[u][1], []).append(u)
    out: List[T] = []
    for i, item in enumerate(body):
        for u in starts.get(i, []):
            after = order.index(u) + 1
            out.append(gather(u, order[after] if after < len(order) else None))
        out.append(item)
        for u in ends.get(i, []):
            out.append(release(u, *span[u]))
    return out


def insert_unit_gathers(section: Section) -> None:
    """Put each unit's ``Unshard`` and ``Reshard`` into ``section.instructions`` (module docstring);
    nothing without ZeRO stage 3 (no ``SHARD_UNITS`` in the graph's meta)."""
    units_of = section.graph.meta.get(SHARD_UNITS)
    if not units_of:
        return
    body = section.instructions
    section.instructions = with_gathers(
        body, section_reads(body, units_of), section.graph.meta.get(SHARD_RESHARD, True),
        lambda unit, prefetch: Unshard(unit, prefetch),
        lambda unit, first, last: Reshard(unit, _leaving(body, first, last)))


def _leaving(body: List[Instruction], first: int, last: int) -> Tuple[Value, ...]:
    """The values made in ``body[first:last + 1]`` that a later instruction reads, in the order made."""
    made: List[Value] = []
    for ins in body[first:last + 1]:
        made += [v for v in made_by(ins) if v.origin in (Origin.MADE, Origin.CONVERTED)]
    later = {id(v) for ins in body[last + 1:] for v in read_by(ins)}
    seen: Set[int] = set()
    out = []
    for v in made:
        if id(v) in later and id(v) not in seen:
            seen.add(id(v))
            out.append(v)
    return tuple(out)
