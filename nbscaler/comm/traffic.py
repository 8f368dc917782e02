"""Every collective a plan runs, with the bytes each device sends: a pass over a placed graph.

Code generation turns each change of layout into ``comm.*`` calls (``nbscaler.comm.layout``). This
pass walks the graph the same way, in the same order, and lists those calls as ``CommStep`` rows,
so the views, the cost model and autodist can count what crosses between devices without reading
generated code. Each forward step gets a row; when its backward is a collective too (the gradient
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
``send_recv``              ``T`` (to the next stage)   ``T`` (the gradient, back)
=========================  ==========================  =====================================

>>> steps = collective_steps(graph, storage)                      # doctest: +SKIP
>>> steps[0]
CommStep(tensor='gelu_2', producer='gelu_2', consumer='linear_3', collective='sum_grad', phase='B', ...)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from nbscaler.comm.layout import Layout, Step, conversion, input_requirement, output_layout
from nbscaler.comm.stages import stage_carries
from nbscaler.ir.graph import IRGraph, IRNode, IRTensor, requires_grad_of
from nbscaler.layouts import COLLECTIVES, Collective, LayoutKind

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


def collective_steps(graph: IRGraph, storage: Dict[str, Layout], nstages: Optional[int] = None) -> List[CommStep]:
    """The collectives of one placed graph, in the order generated code runs their forwards.

    ``storage`` gives each weight's stored layout (``storage_layouts``); ``nstages`` is the number
    of pipeline stages (``None`` without a pipeline).
    """
    walk = _LayoutWalk(graph, storage)
    if nstages is None:
        walk.section(graph.nodes, carry_in=(), carry_out=None)
        return walk.steps
    carries = stage_carries(graph, nstages)
    groups = [tuple(sorted({d for n in graph.nodes if n.stage == s for d in n.placement.devices}))
              for s in range(nstages)]
    for stage in range(nstages):
        nodes = [n for n in graph.nodes if n.stage == stage]
        last = stage == nstages - 1
        walk.section(nodes, carry_in=carries[stage - 1] if stage else (), carry_out=None if last else carries[stage],
                     stage=stage, next_group=None if last else groups[stage + 1])
    return walk.steps


class _LayoutWalk:
    """Follows which layouts of each tensor exist, as ``codegen.emitter.ForwardEmitter`` does."""

    def __init__(self, graph: IRGraph, storage: Dict[str, Layout]):
        self.graph, self.storage = graph, storage
        self.grad = requires_grad_of(graph)
        self.steps: List[CommStep] = []
        self.index = {id(n): i for i, n in enumerate(graph.nodes)}

    def section(self, nodes: Sequence[IRNode], carry_in: Sequence[IRTensor], carry_out: Optional[Sequence[IRTensor]],
                stage: Optional[int] = None, next_group: Tuple[int, ...] = ()) -> None:
        """One forward function: the whole graph, or one pipeline stage."""
        self.have: Dict[int, Layout] = {}
        self.known: Dict[int, set] = {}
        for t in list(self.graph.inputs) + list(carry_in):
            self._bind(t, Layout.replicated())
        for t in self.graph.weights.values():
            self._bind(t, self.storage.get(t.name, Layout.replicated()))
        for node in nodes:
            for i, t in enumerate(node.inputs):
                self._fetch(t, input_requirement(node, i), node.placement.devices, node, stage)
            for i, t in enumerate(node.output_tensors):
                self._bind(t, output_layout(node, i))
        group = tuple(sorted({d for n in nodes for d in n.placement.devices}))
        if carry_out is not None:
            for t in carry_out:
                self._fetch(t, Layout.replicated(), group, None, stage)
                self._send(t, group, next_group, stage)
        else:
            for t in self.graph.output_tensors():
                self._fetch(t, Layout.replicated(), group, None, stage)

    def _bind(self, t: IRTensor, layout: Layout) -> None:
        self.have[id(t)] = layout
        self.known[id(t)] = {layout}

    def _fetch(self, t: IRTensor, want: Layout, devices: Tuple[int, ...], consumer: Optional[IRNode],
               stage: Optional[int]) -> None:
        if id(t) not in self.have:
            return                                 # code generation reports the error
        if want.kind == LayoutKind.SUM_GRAD and not self.grad.get(id(t), False):
            want = Layout.replicated()             # no gradient to sum
        if want in self.known[id(t)]:
            return
        have = self.have[id(t)]
        for step in conversion(have, want):
            self._record(t, step, have, want, devices, consumer, stage)
        self.known[id(t)].add(want)

    def _record(self, t: IRTensor, step: Step, have: Layout, want: Layout, devices: Tuple[int, ...],
                consumer: Optional[IRNode], stage: Optional[int]) -> None:
        n, spec = len(devices), COLLECTIVES[step.fn]
        row = dict(tensor=t.name, producer=t.producer.name if t.producer is not None else None,
                   consumer=consumer.name if consumer is not None else None,
                   consumer_index=self.index.get(id(consumer)) if consumer is not None else None,
                   have=str(have), want=str(want), devices=tuple(devices), tensor_bytes=t.nbytes, stage=stage)
        self.steps.append(CommStep(collective=step.fn, phase="F",
                                   bytes_per_device=round(spec.forward_share(n) * t.nbytes), **row))
        if spec.backward is not None and self.grad.get(id(t), False):
            self.steps.append(CommStep(collective=spec.backward, phase="B",
                                       bytes_per_device=round(spec.backward_share(n) * t.nbytes), **row))

    def _send(self, t: IRTensor, group: Tuple[int, ...], next_group: Tuple[int, ...], stage: int) -> None:
        """``t`` crosses from ``stage`` to the next: each device sends it whole to its counterpart."""
        row = dict(tensor=t.name, producer=t.producer.name if t.producer is not None else None, consumer=None,
                   consumer_index=None, have=str(LayoutKind.REPLICATED), want=str(LayoutKind.REPLICATED),
                   collective=Collective.SEND_RECV,
                   tensor_bytes=t.nbytes, bytes_per_device=t.nbytes)
        self.steps.append(CommStep(phase="F", stage=stage, devices=group, **row))
        if self.grad.get(id(t), False):            # the gradient goes back from the next stage
            self.steps.append(CommStep(phase="B", stage=stage + 1, devices=next_group, **row))
