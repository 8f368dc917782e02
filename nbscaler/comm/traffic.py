"""Every collective a plan runs, with the bytes each device sends: a pass over a placed graph.

Each rank's program (``comm.lower``) holds its layout conversions. This pass gathers those of
every rank, in graph order, and lists them as ``CommStep`` rows, so the views, the cost model and
autodist can count what crosses between devices without reading generated code. Each forward step gets a row; when its backward is a collective too (the gradient
of a ``chunk`` is an all-gather, of a ``sum_grad`` an all-reduce), that gets a row of its own.

Bytes are those each device of the group *sends* with ring algorithms, for a tensor of ``T`` bytes
over ``n`` devices (``nbscaler.layouts.COLLECTIVES`` holds these shares):

=========================  ==========================  =====================================
collective                 forward, per device         backward, per device
=========================  ==========================  =====================================
``all_gather``             ``(n-1)/n * T``             none (keep the slice)
``all_gather_sum_grad``    ``(n-1)/n * T``             ``(n-1)/n * T`` (reduce-scatter)
``chunk``                  0 (keep the slice)          ``(n-1)/n * T`` (all-gather)
``all_reduce``             ``2 (n-1)/n * T``           none (pass through)
``reduce_scatter``         ``(n-1)/n * T``             ``(n-1)/n * T`` (all-gather)
``all_to_all``             ``(n-1)/n^2 * T``           ``(n-1)/n^2 * T``
``sum_grad``               0 (pass through)            ``2 (n-1)/n * T`` (all-reduce)
``first_only``             0                           none
``ring_pass``              ``(n-1)/n * T``             ``(2n-1)/n * T`` (blocks and gradients)
``send_recv``              ``T`` (to the next stage)   ``T`` (the gradient, back)
=========================  ==========================  =====================================

Those are the bytes of the ideal collectives. A backend that runs one as another
(``nbscaler.layouts.EMULATED``: torch's gloo runs a reduce-scatter as an all-reduce) sends what it
runs instead, so for a ``backend`` each row's bytes are those of what it runs, which ``runs`` names.

>>> steps = collective_steps(plan.programs.distinct(), plan.graph, "nccl")  # doctest: +SKIP
>>> steps[0]                                                      # doctest: +SKIP
CommStep(tensor='gelu_2', producer='gelu_2', consumer='linear_3', collective='sum_grad', phase='B', ...)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

from nbscaler.comm.layout import Layout, Step, input_requirement, local_shape
from nbscaler.comm.program import Convert, Fetch, RankProgram, Section, Send
from nbscaler.ir.graph import IRGraph, IRNode, IRTensor, requires_grad_of
from nbscaler.ir.expert_rules import exchanged_bytes, exchanged_counts_bytes, expert_parallel
from nbscaler.ir.layer_rules import context_group, context_parallel, context_ring, counted_tokens_bytes
from nbscaler.layouts import COLLECTIVES, Collective, LayoutKind, runs, wire_factor

@dataclass(frozen=True)
class CommStep:
    """One collective on one edge of the graph (or one stage crossing of a pipeline)."""

    tensor: str
    producer: Optional[str]           # the node that made the tensor; None for inputs and weights
    consumer: Optional[str]           # the node that needs it; None for the module's outputs
    consumer_index: Optional[int]     # that node's index in the graph
    have: str                         # layout before, e.g. 'S(1)', 'P'
    want: str                         # layout the consumer asks for, e.g. 'R', 'R*'
    collective: str                   # a function of nbscaler.runtime.collectives, or 'send_recv'
    phase: str                        # 'F' or 'B'
    devices: Tuple[int, ...]          # the plan devices taking part
    tensor_bytes: int                 # the whole tensor
    bytes_per_device: int             # what each device of the group sends
    stage: Optional[int] = None       # pipeline stage that runs it (for send_recv: the sending stage)
    runs: Optional[str] = None        # the primitive that crosses the links as the backend runs it; None: local


def collective_steps(programs: Iterable[RankProgram], graph: IRGraph,
                     backend: Optional[str] = None) -> List[CommStep]:
    """The collectives of one placed graph, in the order generated code runs their forwards, with
    the bytes ``backend`` sends for each (``None``: the ideal collectives').

    ``programs`` are rank programs of the plan (``comm.lower``) that run, together, every node of
    ``graph`` (all of them, or ``RankPrograms.distinct()``); their sections hold every conversion. Each layout of a tensor is counted once per section (stage), on the
    first reader that asks for it (by graph order), with that reader's group.
    """
    by_stage: Dict[Optional[int], Dict[int, Section]] = {}
    for program in programs:
        for sec in program.sections:
            if sec.graph is graph:
                by_stage.setdefault(sec.stage, {})[sec.device] = sec
    index = {id(n): i for i, n in enumerate(graph.nodes)}
    stages = sorted(by_stage, key=lambda s: -1 if s is None else s)
    groups = {s: _group(graph, s) for s in stages}
    steps: List[CommStep] = []
    for k, stage in enumerate(stages):
        last = k == len(stages) - 1
        steps += _stage_steps(list(by_stage[stage].values()), graph, index, stage,
                              None if stage is None or last else groups[stages[k + 1]], backend)
    return steps


def _group(graph: IRGraph, stage: Optional[int]) -> Tuple[int, ...]:
    return tuple(sorted({d for n in graph.nodes if stage is None or n.stage == stage for d in n.placement.devices}))


def _stage_steps(sections: List[Section], graph: IRGraph, index: Dict[int, int], stage: Optional[int],
                 next_group: Optional[Tuple[int, ...]], backend: Optional[str]) -> List[CommStep]:
    """The rows of one stage: every conversion of its sections in graph order, each once."""
    grad = requires_grad_of(graph, inputs_as_traced=True)      # what the runtime sends for a batch like the traced one
    nodes = len(graph.nodes)
    ordered = []
    for sec in sections:
        for f in sec.fetches():
            at = index[id(f.consumer)] if f.consumer is not None else nodes + f.position
            ordered.append(((at, f.position, 0), f))
        sends = [ins for ins in sec.instructions if isinstance(ins, Send)]
        ordered += [((nodes + k, k, 1), send) for k, send in enumerate(sends)]     # after the k-th output's fetch
    # inside the call: a ring, an exchange, a count; over a grid, once per context-parallel group
    inside = sorted({(n, context_group(n, sec.device) if context_parallel(n) else ())
                     for sec in sections for n in sec.graph.nodes
                     if (context_ring(n) or expert_parallel(n) or counted_tokens_bytes(n)) and
                     (stage is None or n.stage == stage)}, key=lambda item: (index[id(item[0])], item[1]))
    ordered += [((index[id(n)], -1, 2), (n, group)) for n, group in inside]
    ordered.sort(key=lambda item: item[0])
    seen: set = set()
    steps: List[CommStep] = []
    for _, item in ordered:
        if isinstance(item, tuple):
            node, group = item
            if context_ring(node):
                steps += _ring_rows(node, group, stage, index, grad, backend)
            elif expert_parallel(node):
                steps += _expert_rows(node, stage, index, grad, backend)
            else:
                steps += _count_rows(node, group, stage, index, grad, backend)
        elif isinstance(item, Send):
            if ("send", id(item.tensor)) not in seen:
                seen.add(("send", id(item.tensor)))
                steps += _send(item.tensor, _group(graph, stage), next_group, stage, grad)
        elif (id(item.tensor), item.want, item.devices) not in seen:        # each group's once
            seen.add((id(item.tensor), item.want, item.devices))
            steps += [row for c in item.steps
                      for row in _rows(item, c.step, stage, index, grad, backend, _group_bytes(c, len(item.devices)))]
    return steps


#: The collectives whose input is a device's slice of the tensor their group moves (the rest read it whole).
_READS_A_SLICE = (Collective.ALL_GATHER, Collective.ALL_GATHER_SUM_GRAD, Collective.ALL_TO_ALL)


def _group_bytes(c: Convert, n: int) -> int:
    """The bytes of the tensor one collective's group of ``n`` moves, from the local piece it reads:
    the whole tensor, or over a grid the part the other axis leaves each group."""
    local = math.prod(c.src.shape) * c.src.tensor.dtype.itemsize
    return local * n if c.step.fn in _READS_A_SLICE else local


def _rows(f: Fetch, step: Step, stage: Optional[int], index: Dict[int, int], grad: Dict[int, bool],
          backend: Optional[str], nbytes: Optional[int] = None) -> List[CommStep]:
    """The forward row of one collective, and its backward's when that is a collective too;
    ``nbytes``: the tensor its group moves (by default the whole of ``f``'s)."""
    t, n, spec = f.tensor, len(f.devices), COLLECTIVES[step.fn]
    nbytes = t.nbytes if nbytes is None else nbytes
    row = dict(tensor=t.name, producer=t.producer.name if t.producer is not None else None,
               consumer=f.consumer.name if f.consumer is not None else None,
               consumer_index=index.get(id(f.consumer)) if f.consumer is not None else None,
               have=str(f.have), want=str(f.want), devices=tuple(f.devices), tensor_bytes=nbytes, stage=stage)
    out = [CommStep(collective=step.fn, phase="F", **_sent(spec.forward_share(n) * nbytes, spec.priced_as, n, backend),
                    **row)]
    if spec.backward is not None and grad.get(id(t), False):
        primitive = COLLECTIVES[spec.backward].priced_as
        out.append(CommStep(collective=spec.backward, phase="B",
                            **_sent(spec.backward_share(n) * nbytes, primitive, n, backend), **row))
    return out


def _ring_rows(node: IRNode, group: Tuple[int, ...], stage: Optional[int], index: Dict[int, int],
               grad: Dict[int, bool], backend: Optional[str]) -> List[CommStep]:
    """The ring passes of a context-parallel attention over ``group``: its keys and values, each
    passed on by every device (over a grid, the heads of one tensor-parallel place)."""
    out: List[CommStep] = []
    for i, t in ((1, node.inputs[1]), (2, node.inputs[2])):
        want = input_requirement(node, i)
        split = Layout.split(node.annotation.inputs[1].index("s"), node.placement.blocks)
        fetch = Fetch(t, split, split, group, node, i, ())
        held = local_shape(t.shape, want, len(node.placement.devices))      # this device's block
        out += _rows(fetch, Step(Collective.RING_PASS), stage, index, grad, backend,
                     math.prod(held) * t.dtype.itemsize * len(group))
    return out


def _expert_rows(node: IRNode, stage: Optional[int], index: Dict[int, int], grad: Dict[int, bool],
                 backend: Optional[str]) -> List[CommStep]:
    """The all-to-alls of an expert-parallel op: under dropless routing the per-expert counts, then
    its rows out to their experts' devices and back, forward, and their gradients the other ways,
    backward (each ``(n-1)/n`` of the bytes)."""
    n, rows = node.placement.parts, exchanged_bytes(node)
    row = dict(tensor=node.inputs[0].name, producer=node.inputs[0].producer.name if node.inputs[0].producer else None,
               consumer=node.name, consumer_index=index.get(id(node)), have=str(LayoutKind.SPLIT),
               want=str(LayoutKind.SPLIT), collective=Collective.EXPERT_EXCHANGE, devices=tuple(node.placement.devices),
               tensor_bytes=rows, stage=stage)
    sent = _sent(COLLECTIVES[Collective.EXPERT_EXCHANGE].forward_share(n) * rows, Collective.ALL_TO_ALL, n, backend)
    phases = ("F", "B") if grad.get(id(node.inputs[0]), False) else ("F",)
    out = [CommStep(phase=phase, **sent, **row) for phase in phases for _ in ("out", "back")]
    counts = exchanged_counts_bytes(node)
    if counts:
        row.update(collective=Collective.EXPERT_COUNTS, tensor_bytes=counts)
        spec = COLLECTIVES[Collective.EXPERT_COUNTS]
        out.insert(0, CommStep(phase="F", **_sent(spec.forward_share(n) * counts, spec.priced_as, n, backend), **row))
    return out


def _count_rows(node: IRNode, group: Tuple[int, ...], stage: Optional[int], index: Dict[int, int],
                grad: Dict[int, bool], backend: Optional[str]) -> List[CommStep]:
    """The all-reduce of the token count a loss split along its tokens runs inside its call, over ``group``."""
    nbytes, n = counted_tokens_bytes(node), len(group)
    row = dict(tensor=node.inputs[1].name, producer=node.inputs[1].producer.name if node.inputs[1].producer else None,
               consumer=node.name, consumer_index=index.get(id(node)), have=str(LayoutKind.SPLIT),
               want=str(LayoutKind.SPLIT), collective=Collective.TOKEN_COUNT, devices=group,
               tensor_bytes=nbytes, stage=stage)
    spec = COLLECTIVES[Collective.TOKEN_COUNT]
    return [CommStep(phase="F", **_sent(spec.forward_share(n) * nbytes, spec.priced_as, n, backend), **row)]


def _sent(ideal: float, primitive: Optional[Collective], n: int, backend: Optional[str]) -> Dict[str, object]:
    """A row's ``bytes_per_device`` and ``runs``: the ``ideal`` bytes of ``primitive`` (``None``:
    local), or those of what ``backend`` runs for it."""
    if primitive is None or n <= 1:
        return dict(bytes_per_device=round(ideal), runs=None)
    return dict(bytes_per_device=round(ideal * wire_factor(backend, primitive, n)), runs=str(runs(backend, primitive)))


def _send(t: IRTensor, group: Tuple[int, ...], next_group: Tuple[int, ...], stage: int,
          grad: Dict[int, bool]) -> List[CommStep]:
    """``t`` crosses from ``stage`` to the next: each device sends it whole to its counterpart."""
    row = dict(tensor=t.name, producer=t.producer.name if t.producer is not None else None, consumer=None,
               consumer_index=None, have=str(LayoutKind.REPLICATED), want=str(LayoutKind.REPLICATED),
               collective=Collective.SEND_RECV, tensor_bytes=t.nbytes, bytes_per_device=t.nbytes,
               runs=str(Collective.SEND_RECV))
    out = [CommStep(phase="F", stage=stage, devices=group, **row)]
    if grad.get(id(t), False):            # the gradient goes back from the next stage
        out.append(CommStep(phase="B", stage=stage + 1, devices=next_group, **row))
    return out
