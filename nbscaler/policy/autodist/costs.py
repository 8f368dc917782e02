"""What one choice costs: an op's time on its share, the collectives an edge then needs, the bytes kept.

A *choice* for an op is ``None`` (every device runs it whole) or the name of an annotated dim to
split it along. Its costs come from the cost model, never from a guess of its own:

- **op time**: the profiler (``nbscaler.cost.profile``) times the op at the local shapes the choice
  gives it, forward plus backward, once per distinct call (cached on disk, so a model's repeated
  blocks are profiled once);
- **edge time**: the producer's output layout and the consumer's requirement give the collectives,
  each on the local bytes it reads, by the rules lowering applies (``nbscaler.comm.layout``:
  ``effective_requirement``, ``keeps_partial_grad``, ``local_steps``), timed by the alpha-beta model
  (``nbscaler.cost.comm_model``);
- **bytes**: the weights the op reads, with their gradients and optimizer state, at the size the
  choice stores them, and its output, roughly what autograd saves. The search only uses these to
  trade time for memory; whether a plan fits is then checked with the exact memory model.
"""

from __future__ import annotations

import math

from functools import lru_cache
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from nbscaler.comm.layout import (Layout, LocalStep, effective_requirement, input_requirement, keeps_partial_grad,
                                  local_shape, local_steps, output_layout)
from nbscaler.cost.comm_model import CommModel
from nbscaler.cost.memory import optimizer_state_bytes
from nbscaler.cost.local import OpCall
from nbscaler.cost.profile import OpProfiler
from nbscaler.ir.graph import IRGraph, IRNode, IRTensor, Placement, requires_grad_of
from nbscaler.layouts import Collective, LayoutKind

Choice = Optional[str]


class ChoiceCosts:
    """Costs of the choices for the ops of one graph on one group of ``devices``."""

    def __init__(self, graph: IRGraph, devices: Sequence[int], profiler: OpProfiler, comm: CommModel,
                 state_factor: float, partial_grads: bool = True):
        self.graph, self.devices, self.profiler, self.comm = graph, tuple(devices), profiler, comm
        self.partial_grads = partial_grads          # a parameter read R* leaves its gradient sum to the reducer
        self.n = len(self.devices)
        self.grad = requires_grad_of(graph)
        self.state_factor = state_factor            # optimizer-state bytes per parameter byte
        self.readers: Dict[int, int] = {}                           # tensor -> how many ops read it
        self._switch: Dict[Tuple, float] = {}
        self.reads: Dict[int, List[Tuple[int, int]]] = {}            # producer -> (reader position, bytes)
        self.order = {id(n): i for i, n in enumerate(graph.nodes)}
        for i, node in enumerate(graph.nodes):
            for t in node.inputs:
                self.readers[id(t)] = self.readers.get(id(t), 0) + 1
                if t.producer is not None:
                    self.reads.setdefault(id(t.producer), []).append((i, t.nbytes))
        self._op: Dict[Tuple[int, Choice], float] = {}
        self._edge: Dict[Tuple[int, int, int, Choice], float] = {}
        self.layouts: List[Layout] = []                 # layouts are passed around as indices here:
        self._layout_ids: Dict[Layout, int] = {}        # the search hashes millions of states of them

    def layout_id(self, layout: Layout) -> int:
        if layout not in self._layout_ids:
            self._layout_ids[layout] = len(self.layouts)
            self.layouts.append(layout)
        return self._layout_ids[layout]

    def place(self, choice: Choice) -> Placement:
        return Placement(self.devices, choice if self.n > 1 else None)

    def choices(self, node: IRNode, pin: Optional[str]) -> List[Choice]:
        """Replicate, or any annotated dim that splits evenly; narrowed by a constraint."""
        splits = node.annotation.splittable(self.n) if node.annotation is not None and self.n > 1 else []
        if pin == "replicate":
            return [None]
        if pin is not None and pin in splits:
            return [pin]
        return [None] + splits

    def op_seconds(self, node: IRNode, choice: Choice) -> float:
        """Forward plus backward seconds of ``node`` on one device's share under ``choice``."""
        key = (id(node), choice)
        if key not in self._op:
            place = self.place(choice)
            saved, node.placement = node.placement, place        # call_args reads the placement
            try:
                fwd, bwd = self.profiler.time(self._call(node, place))
            finally:
                node.placement = saved
            self._op[key] = fwd + (bwd if any(self.grad.get(id(t), False) for t in node.inputs) else 0.0)
        return self._op[key]

    def _call(self, node: IRNode, place: Placement) -> OpCall:
        ins = tuple((local_shape(t.shape, input_requirement(node, i, place), place.parts), t.dtype,
                     self.grad.get(id(t), False)) for i, t in enumerate(node.inputs))
        outs = tuple((local_shape(t.shape, output_layout(node, i, place), place.parts), t.dtype)
                     for i, t in enumerate(node.output_tensors))
        return OpCall(node, ins, outs, 0)

    def edge_seconds(self, have: int, node: IRNode, index: int, choice: Choice) -> float:
        """Seconds of the collectives that bring input ``index`` of ``node`` from layout ``have`` (an
        index from ``layout_id``) to what ``choice`` needs, forward and backward."""
        key = (have, id(node), index, choice)
        if key not in self._edge:
            self._edge[key] = self._edge_seconds(self.layouts[have], node, index, choice)
        return self._edge[key]

    def _edge_seconds(self, have: Layout, node: IRNode, index: int, choice: Choice) -> float:
        t = node.inputs[index]
        grad = self.grad.get(id(t), False)
        want = effective_requirement(input_requirement(node, index, self.place(choice)), grad)
        if keeps_partial_grad(want, t.kind == "param", self.partial_grads):
            # summed after the backward in the reducer's buckets: its bytes, no latency of its own
            return 2 * (self.n - 1) / self.n * t.nbytes * self.comm.beta_s_per_byte
        return _conversion_seconds(self.comm, have, want, t, self.n, grad)

    def source_layout(self, t: IRTensor, choice_of_producer: Choice) -> int:
        """The layout (id) tensor ``t`` is available in: its producer's output under its choice,
        or replicated for graph inputs (weights are stored as their readers want them: free)."""
        if t.producer is None:
            return self.layout_id(Layout.replicated())
        index = t.producer.output_tensors.index(t)
        return self.layout_id(output_layout(t.producer, index, self.place(choice_of_producer)))

    def regret_bound(self, open_nodes: Sequence[IRNode], after: IRNode) -> float:
        """The most that changing the layouts of the open ops' outputs can save on their reads
        after ``after``: one all-reduce, forward and backward, per remaining read."""
        done = self.order[id(after)]
        return sum(2 * self.comm.forward(Collective.ALL_REDUCE, nbytes, self.n)
                   for node in open_nodes for position, nbytes in self.reads.get(id(node), ()) if position > done)

    def switch_seconds(self, node: IRNode, have: Tuple[int, ...], want: Tuple[int, ...], after: IRNode) -> float:
        """An upper bound on what bringing ``node``'s outputs from layouts ``have`` to ``want`` costs
        its remaining reads after ``after``: every output converted at each of them."""
        key = (id(node), have, want, id(after))
        if key not in self._switch:
            done = self.order[id(after)]
            remaining = sum(1 for position, _ in self.reads.get(id(node), ()) if position > done)
            try:
                once = sum(_conversion_seconds(self.comm, self.layouts[a], self.layouts[b], t, self.n,
                                               self.grad.get(id(t), False))
                           for a, b, t in zip(have, want, node.output_tensors) if a != b)
            except ValueError:                   # no collective makes ``want`` (e.g. partial sums)
                once = math.inf
            self._switch[key] = remaining * once if remaining else 0.0
        return self._switch[key]

    def output_layouts(self, node: IRNode, choice: Choice) -> Tuple[int, ...]:
        """The layouts (ids) ``choice`` leaves each output of ``node`` in."""
        place = self.place(choice)
        return tuple(self.layout_id(output_layout(node, k, place)) for k in range(len(node.output_tensors)))

    def op_bytes(self, node: IRNode, choice: Choice) -> float:
        """Bytes per device ``choice`` keeps for ``node``: its share of the weights it reads (with
        gradients and optimizer state) and of its outputs (saved for the backward)."""
        place = self.place(choice)
        total = 0.0
        for i, t in enumerate(node.inputs):
            if t.kind == "param":
                share = t.nbytes / (place.parts if input_requirement(node, i, place).kind == LayoutKind.SPLIT else 1)
                total += share * (2 + self.state_factor) / self.readers[id(t)]
        for i, t in enumerate(node.output_tensors):
            if self.grad.get(id(t), False):
                total += t.nbytes / (place.parts if output_layout(node, i, place).kind == LayoutKind.SPLIT else 1)
        return total


@lru_cache(maxsize=None)
def _steps(have: Layout, want: Layout, shape: Tuple[int, ...], n: int) -> List[LocalStep]:
    return local_steps(have, want, local_shape(shape, have, n), n)


def _conversion_seconds(comm: CommModel, have: Layout, want: Layout, t: IRTensor, n: int, grad: bool) -> float:
    """Forward (and, for a tensor with a gradient, backward) seconds of the collectives that turn
    ``t`` from ``have`` into ``want`` over ``n`` devices, each on the local bytes lowering gives it."""
    seconds = 0.0
    for step in _steps(have, want, tuple(t.shape), n):
        local = math.prod(step.src_shape) * t.dtype.itemsize
        seconds += comm.forward(step.step.fn, local, n) + (comm.backward(step.step.fn, local, n) if grad else 0.0)
    return seconds


def optimizer_state_factor(optimizer: type) -> float:
    """Optimizer-state bytes per parameter byte (0 for plain SGD, 2 for Adam's two moments)."""
    numel = 1 << 20
    return optimizer_state_bytes(optimizer, None, numel, torch.float32) / (4 * numel)
