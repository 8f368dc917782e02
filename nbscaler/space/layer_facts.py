"""The per-op facts a sweep prices configurations from, read once off a placed two-layer copy.

For one micro-batch size, tensor-parallel size and recomputation, ``LayerFacts`` holds, for each
op of the two-layer copy (``planning.stack``) and each tensor-parallel index of the devices that
run it, what ``cost.timing.section_time`` and the memory model add up for a section: the op's
forward and backward seconds on the target (a recomputed op's forward again in its backward),
those of the tensor-parallel collectives before it, the bytes it saves for the backward, its
local FLOPs (and those it runs again when recomputed). A stage of the full model sums these over
the ops it holds (``planning.stack.repeat_counts``); nothing is traced, placed or replayed again.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Set, Tuple

import numpy as np

from nbscaler.comm.layout import output_layout
from nbscaler.comm.lower import SectionLowering
from nbscaler.comm.program import Section
from nbscaler.comm.stages import stage_carries
from nbscaler.cost.flops import node_flops
from nbscaler.cost.local import run_local
from nbscaler.cost.memory import feeding_no_weight
from nbscaler.cost.ranks import LocalWeight, local_weights
from nbscaler.cost.roofline import RooflineOps
from nbscaler.ir.graph import IRNode, requires_grad_of
from nbscaler.layouts import LayoutKind
from nbscaler.space.op_ledger import SAVED_TAIL, TP_BWD, TP_FWD, Kinds, OpLedger
from nbscaler.planning.step import compute_dtype, micro_batch_tokens
from nbscaler.planning.stack import Expansion, Stack


@dataclass
class LayerFacts:
    """What one op of the copy costs on each tensor-parallel index (``matrix[i]``: ops x facts),
    the weights each index stores (``weights[i]``, with the copy's ops that read each one), the
    ops' FLOPs for staging, and the bytes a pipeline cut at each place of the copy carries."""

    expansion: Expansion
    matrix: List[np.ndarray]
    weights: List[List[Tuple[LocalWeight, Tuple[int, ...]]]]
    flops: np.ndarray                  # node_flops of every full-model op, for stage_cuts
    graph: object                      # the copy's training graph, for what a cut carries
    tokens: Optional[int]              # tokens in one micro-batch (None: no sequence input)
    compute_dtype: object
    replay: Tuple                      # (storage, op index, profiler, comm): for stage_start
    memo: "PlacementMemo"
    """What does not depend on the target, kept with the placement for its facts on every target."""

    def __post_init__(self) -> None:
        self._starts: Dict[int, List[np.ndarray]] = {}
        self._ends: Dict[int, List[np.ndarray]] = {}
        # tensor-parallel index -> the first index whose facts and weights are the same but for
        # which slice of a split weight each holds (the members of a group differ only where a
        # collective keeps another piece or first_only): what it replays and holds costs the same
        if self.memo.same_weights is None:              # not the target's: kept with the placement
            held = [[(dataclasses.replace(w, index=0), readers) for w, readers in ws] for ws in self.weights]
            self.memo.same_weights = [[j for j in range(i + 1) if held[j] == held[i]] for i in range(len(held))]
        self.alike = [next(j for j in same if np.array_equal(self.matrix[j], self.matrix[i]))
                      for i, same in enumerate(self.memo.same_weights)]

    @property
    def tp(self) -> int:
        return len(self.matrix)

    def carried(self, cut: int) -> Tuple[int, int]:
        """Bytes and tensors a pipeline cut before full-model op ``cut`` sends on
        (``comm.stages.stage_carries``), read off the same place of the copy."""
        place = self.expansion.copy_position(cut)
        tensors = self._crossing(place)
        return sum(t.nbytes for t in tensors), len(tensors)

    def _crossing(self, place: int) -> List:
        """The tensors a cut before the copy's op ``place`` sends on (``_carried``), kept in
        the placement's memo: they do not depend on the target."""
        crossing = self.memo.crossing
        if place not in crossing:
            crossing[place] = _carried(self.graph, place)
        return crossing[place]

    def stage_start(self, cut: int) -> List[np.ndarray]:
        """What a stage starting at full-model op ``cut`` adds to the sum of its ops' facts, per
        tensor-parallel index: the tensors it receives are its own storages, so the first layer
        after the cut saves those (Llama's rotary tables) that, in one forward, an earlier layer
        had saved already. Read off the copy replayed from the same place with those tensors
        received (``cost.local.run_local``), beside the copy replayed whole, over one layer's ops."""
        return [rows.sum(axis=0) for rows in self.stage_start_rows(cut)]

    def stage_start_rows(self, cut: int) -> List[np.ndarray]:
        """``stage_start`` op by op, per tensor-parallel index: row ``k`` is what full-model op
        ``cut + k`` adds (ops x facts, over the layer after the cut), so that a script of the
        stage's ops (ZeRO stage 3's) puts each op's share where that op runs."""
        place = self.expansion.copy_position(cut)
        if place not in self._starts:
            storage, index, profiler, comm = self.replay
            span = slice(place, min(place + self.expansion.size, len(self.expansion.nodes)))
            starts: List[np.ndarray] = []
            for device in range(self.tp):
                if self.alike[device] != device:         # its group's first alike device replays for it
                    starts.append(starts[self.alike[device]])
                    continue
                rows = self._ledger(span, device).rows(self.memo.kinds, profiler, comm)
                starts.append((rows - self.matrix[device])[span])
            self._starts[place] = starts
        return self._starts[place]

    def stage_end(self, cut: int) -> List[np.ndarray]:
        """What a stage ending before full-model op ``cut`` adds to the sum of its ops' facts, per
        tensor-parallel index: the collectives that make what it sends whole (under sequence
        parallelism the residual stream leaves a stage as a slice of the sequence, all-gathered
        before the send). Read off the copy's layer before the same place, replayed as a stage
        that ends there: its collectives that feed no op of it, the same on every device (each
        runs on the whole stage group); none where every tensor crossing the cut is whole on the
        devices that make it (as without sequence parallelism)."""
        place = self.expansion.copy_position(cut)
        if place not in self._ends:
            sent = np.zeros(SAVED_TAIL + 1)
            if not all(_made_whole(t) for t in self._crossing(place)):
                span = slice(max(0, place - self.expansion.size), place)
                sent = _sent(self._replayed(span, 0, self.replay[0]), self.replay[3])
            self._ends[place] = [sent] * self.tp
        return self._ends[place]

    def _ledger(self, span: slice, device: int) -> OpLedger:
        """The ``OpLedger`` of ``device``'s run of the copy from ``span``'s start, kept in the memo."""
        key = (span.start, span.stop, device)
        ledgers = self.memo.span_ledgers
        if key not in ledgers:
            storage, index, profiler, _ = self.replay
            count = len(self.expansion.nodes)
            ledgers[key] = OpLedger.of(self._replayed(span, device, storage), index, count, count - 1,
                                       self.memo.kinds, profiler.key, self.memo.placed.no_weight)
        return ledgers[key]

    def _replayed(self, span: slice, device: int, storage):
        """``device``'s run of the copy from ``span``'s start as a stage (``_replay_span``), kept in
        the memo: which ops and collectives run does not depend on the target, only their seconds."""
        key = (span.start, span.stop, device)
        spans = self.memo.spans
        if key not in spans:
            shapes = {w.name: w.shape for w, _ in self.weights[device]}
            spans[key] = _replay_span(self.graph, span, device, storage, shapes)
        return spans[key]




def _sent(run, comm) -> np.ndarray:
    """The facts of ``run``'s collectives that no op of it consumes (what its stage sends)."""
    found = np.zeros(SAVED_TAIL + 1)
    for c in run.collectives:
        if c.node is None:
            f, b = c.seconds(comm)
            found[TP_FWD] += f
            found[TP_BWD] += b
    return found


def read_facts(plan, stack: Stack, profiler: RooflineOps, comm, memo: Optional["PlacementMemo"] = None,
               kinds: Optional[Kinds] = None) -> LayerFacts:
    """``LayerFacts`` of a placed two-layer copy (``plan``: one pipeline stage over its ``tp``
    devices) on the target whose op and collective costs are ``profiler`` and ``comm``. ``memo``:
    the ``LayerFacts.memo`` of the same placement's facts on another target, to reuse: on another
    target only the ops' and collectives' seconds are read again. ``kinds``: the table of distinct
    ops and collectives the ledgers of other placements share (``space.op_ledger``)."""
    if memo is None:
        placed = _placement_facts(plan, stack)
        kinds = kinds if kinds is not None else Kinds()
        count = len(placed.expansion.nodes)
        ledgers = [OpLedger.of(plan.local_runs[d][0], placed.index, count, count - 1, kinds, profiler.key,
                               placed.no_weight) for d in range(plan.config.plan_ngpus)]
        memo = PlacementMemo(placed, kinds, ledgers)
    placed = memo.placed
    matrix = [ledger.rows(memo.kinds, profiler, comm) for ledger in memo.ledgers]
    return LayerFacts(placed.expansion, matrix, placed.weights, placed.flops, plan.graph, placed.tokens,
                      placed.compute_dtype, (plan.storage, placed.index, profiler, comm), memo)


class _Placed(NamedTuple):
    """What ``read_facts`` reads off a placement whatever the target."""

    expansion: Expansion
    index: Dict[str, int]                # op name -> its row
    no_weight: Set[str]                  # the loss's tail (``_loss_tail``)
    weights: List[List[Tuple[LocalWeight, Tuple[int, ...]]]]
    flops: np.ndarray
    tokens: Optional[int]
    compute_dtype: object


@dataclass(eq=False)
class PlacementMemo:
    """What one placement of the copy knows whatever the target, kept for its facts on every
    target: what ``read_facts`` reads off it (``placed``), the table of distinct op and collective
    kinds its ledgers share (``kinds``) and each device's ledger of the copy (``ledgers``); filled
    as they are first asked for, the tensor-parallel indexes alike in their weights
    (``same_weights``), the tensors a cut at each place of the copy sends (``crossing``), the copy
    replayed from a place as a stage (``spans``, with their ``span_ledgers``), what
    ``pricing.Staged`` keeps per stage count (``staged``) and the number naming the weights the
    devices hold (``weights_id``)."""

    placed: "_Placed"
    kinds: Kinds
    ledgers: List[OpLedger]
    same_weights: Optional[List[List[int]]] = None
    crossing: Dict[int, List] = field(default_factory=dict)
    spans: Dict[Tuple[int, int, int], Any] = field(default_factory=dict)
    span_ledgers: Dict[Tuple[int, int, int], OpLedger] = field(default_factory=dict)
    staged: Dict[int, Dict[Tuple, Any]] = field(default_factory=dict)
    weights_id: Optional[int] = None


def _placement_facts(plan, stack: Stack) -> _Placed:
    """``_Placed`` of ``plan``: its ops expanded to the stack's depth, each device's weights with the
    ops that read them, the full model's op FLOPs (for ``stage_cuts``), the tokens of a micro-batch."""
    graph = plan.graph
    expansion = Expansion(stack, graph.nodes)
    index = {n.name: k for k, n in enumerate(graph.nodes)}
    weights = [_readers(graph, local_weights(plan.placed, d), index)
               for d in range(plan.config.plan_ngpus)]
    flops = np.array([node_flops(n) for n in graph.nodes])[expansion.template]
    return _Placed(expansion, index, _loss_tail(graph), weights, flops, micro_batch_tokens(plan), compute_dtype(plan))


def _loss_tail(graph) -> Set[str]:
    """The ops of ``graph`` that feed no op reading a trained weight (``cost.memory.feeding_no_weight``)."""
    grad = requires_grad_of(graph)
    return feeding_no_weight(graph.nodes, lambda n: any(t.is_weight and grad.get(id(t), False) for t in n.inputs))


def _readers(graph, weights: List[LocalWeight], index: Dict[str, int]) -> List[Tuple[LocalWeight, Tuple[int, ...]]]:
    """Each weight with the ops of the copy that read it."""
    reads: Dict[str, List[int]] = {}
    for n in graph.nodes:
        for t in n.inputs:
            if t.is_weight:
                reads.setdefault(t.name, []).append(index[n.name])
    return [(w, tuple(reads.get(w.name, ()))) for w in weights]


def _replay_span(graph, span: slice, device: int, storage, shapes: Dict[str, Tuple[int, ...]]):
    """``device``'s run of ``graph``'s ops in ``span`` as a pipeline stage that receives what
    crosses into it, lowered as a stage of a rank's program is (its weights at their local
    ``shapes``); the ops before the span are stage 0, those after it stage 2."""
    stage_of = _cut_stages(graph, span.start, span.stop)
    carries = stage_carries(graph, 3, stage_of)
    section = Section("_span", "train", graph, device, 1, carries[0], carries[1], stage_of=stage_of)
    SectionLowering(section, storage, requires_grad_of(graph), shapes).run()
    return run_local(section)


def _carried(graph, cut: int) -> List:
    """The tensors ``stage_carries`` sends across a cut of ``graph`` before op ``cut``."""
    return stage_carries(graph, 2, _cut_stages(graph, cut, len(graph.nodes)))[0]


def _cut_stages(graph, start: int, stop: int) -> Callable[[IRNode], int]:
    """Each node's stage when ``graph`` is cut before ops ``start`` and ``stop``: 0, 1 or 2 (the
    graph's own stages are left as they are)."""
    position = {id(n): k for k, n in enumerate(graph.nodes)}
    return lambda n: 0 if position[id(n)] < start else 1 if position[id(n)] < stop else 2


def _made_whole(t) -> bool:
    """Whether the op that makes ``t`` leaves it whole on each of its devices."""
    outs = [id(o) for o in t.producer.output_tensors]
    return output_layout(t.producer, outs.index(id(t))).kind == LayoutKind.REPLICATED
