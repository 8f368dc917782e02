"""The moments of a training step, and the gradients and activations a rank holds at each.

``nbscaler.columns.StepMoment`` names the moments. This pass walks one rank's step through them:
its blocks (one forward and one backward without a pipeline, the schedule's blocks with one), then
the optimizer step. Activations follow the blocks: a forward adds what its stage saves, its
backward frees it; when a zero-bubble schedule splits the backward, its ``B`` (input gradients)
frees nothing and makes no weight gradient, and its ``W`` does both, as a whole backward would. Gradients follow the runtime's reducers (``nbscaler.runtime.reducer`` and
``nbscaler.runtime.zero``):

- without ZeRO, and under ZeRO stage 1 until the optimizer steps, a backward gives every parameter
  it reaches a gradient, and later backwards add into it;
- under ZeRO stages 2 and 3, a bucket's (stage 3: a unit's) gradients are reduce-scattered into
  this rank's shard as soon as the backward has made all of them, and freed; the backward makes
  gradients in the reverse of parameter order;
- the optimizer step: under ZeRO every bucket still holding full gradients is reduce-scattered (in
  order, each freed as its shard gets its slice); without ZeRO the synchronisation gives every
  parameter a gradient and, with master copies (bf16 parameters, fp32 masters), moves each
  bucket's gradients onto the masters in their dtype, freeing the parameters' own.

``MemoryMeter`` (``nbscaler.runtime.memory``) counts at the same moments on a running rank.
"""

from __future__ import annotations

import functools
from typing import Dict, List, Optional, Set, Tuple

from nbscaler.columns import Held, StepMoment
from nbscaler.cost.gathered import GatheredUnits
from nbscaler.cost.ranks import LocalWeight
from nbscaler.schedule import PipelineGeometry


class Gradients:
    """The gradient bytes of one rank as its step goes on.

    Args:
        buckets: the reducer's buckets of the rank's parameters (``cost.memory.buckets``).
        shard_bytes: per bucket, the gradient bytes of what the optimizer updates in its place: this
            rank's ZeRO shard or, without ZeRO, the master copies (empty: the parameters themselves).
        zero_stage: 0 without ZeRO, else 1, 2 or 3 (gradients as under 2, in units).
        order: the parameters in their order, where the buckets do not keep it (ZeRO-3's units).
        paths: a ``GradientPaths`` to share with other steps on the same buckets (a sweep's
            configurations of one device differ only in the order their backwards come).
    """

    def __init__(self, buckets: List[List[LocalWeight]], shard_bytes: List[int], zero_stage: int,
                 order: Optional[List[LocalWeight]] = None, paths: Optional["GradientPaths"] = None):
        self.buckets, self.shard_bytes, self.zero_stage = buckets, shard_bytes, zero_stage
        # every parameter with its bucket, in parameter order: the buckets' own, but for ZeRO-3's units
        index = {w.name: i for i, b in enumerate(buckets) for w in b}
        self.order = ([(w, index[w.name]) for w in order if w.name in index] if order is not None
                      else [(w, i) for i, b in enumerate(buckets) for w in b])
        self.paths = paths if paths is not None else GradientPaths()
        self.state = 0                        # the state reached so far (``GradientPaths.states``)

    @property
    def held(self) -> int:
        """The gradient bytes held now."""
        return self.paths.states[self.state][2]

    def backward(self, stage: Optional[int]) -> int:
        """Run the backward of ``stage`` (``None``: the whole model); returns the most held during it.

        Without ZeRO stage 2 a backward only gives gradients: it holds the most once it has made
        them. Under stage 2, a bucket's gradients are reduce-scattered as soon as all are made, so
        the most comes during the backward."""
        known = self.paths.moves.get((self.state, stage))      # asked per block of long pipelines
        if known is not None:
            self.state, most = known
            return most
        return self._go(stage, lambda walk: walk.backward(stage))

    def step(self, all_params: List[LocalWeight]) -> int:
        """Run the optimizer step; returns the most held during it and after it."""
        return self._go("step", lambda walk: walk.step(all_params))

    def _go(self, move, walked) -> int:
        """Move from the current state by ``move``, walked only the first time the shared paths see it
        from this state: every later step that reaches the same state the same way reads the answer."""
        key = (self.state, move)
        if key not in self.paths.moves:
            walk = _Walk(self, *self.paths.states[self.state])
            most = walked(walk)
            after = (walk.full, walk.shards, walk.held)
            same = after == self.paths.states[self.state]
            if not same:
                self.paths.states.append(after)
            self.paths.moves[key] = (self.state if same else len(self.paths.states) - 1, most)
        self.state, most = self.paths.moves[key]
        return most


class GradientPaths:
    """What the steps of one set of buckets have walked: every gradient state reached
    (``states[i]``: the parameters holding a full gradient and their bytes, the buckets whose shard
    has one, the bytes held), state 0 the empty start, and the moves between them (``moves[(i,
    move)]``: the state a backward of a stage, or the optimizer step, leads to from state ``i``, with
    the most held on the way). A state is known by the moves that led to it, so equal states reached
    by different orders are walked once each; a move that changes nothing leads back to its state."""

    def __init__(self):
        self.states: List[Tuple[Dict[str, int], Set[int], int]] = [({}, set(), 0)]
        self.moves: Dict[Tuple[int, object], Tuple[int, int]] = {}


class _Walk:
    """One move of ``Gradients``, walked on copies of the state it starts from."""

    def __init__(self, grads: Gradients, full: Dict[str, int], shards: Set[int], held: int):
        self.buckets, self.shard_bytes, self.zero_stage = grads.buckets, grads.shard_bytes, grads.zero_stage
        self.order = grads.order
        self.full: Dict[str, int] = dict(full)     # parameter -> bytes of its .grad
        self.shards: Set[int] = set(shards)         # buckets whose shard has a gradient
        self.held = held

    @staticmethod
    def _reaches(w: LocalWeight, stage: Optional[int]) -> bool:
        return w.trained and (stage is None or stage in w.stages)

    def _make(self, w: LocalWeight) -> None:
        if w.name not in self.full:           # a later backward adds into the same tensor
            self.full[w.name] = w.nbytes
            self.held += w.nbytes

    def _reduce(self, index: int) -> None:
        """Reduce-scatter bucket ``index``: its full gradients go, its shard's slice stays."""
        for w in self.buckets[index]:
            self.held -= self.full.pop(w.name, 0)
        if index not in self.shards:
            self.shards.add(index)
            self.held += self.shard_bytes[index]

    def backward(self, stage: Optional[int]) -> int:
        """The backward makes gradients in the reverse of parameter order; under stages 2 and 3 a
        bucket is reduced as soon as it holds all of its gradients (a ZeRO-3 unit's parameters
        need not be consecutive: the embeddings and the head)."""
        most = self.held
        during = self.zero_stage >= 2
        for w, index in reversed(self.order):
            if not self._reaches(w, stage):
                continue
            self._make(w)
            if during and all(x.name in self.full for x in self.buckets[index]):
                most = max(most, self.held)
                self._reduce(index)
        return max(most, self.held) if during else self.held

    def step(self, all_params: List[LocalWeight]) -> int:
        most = self.held
        if self.zero_stage:
            for index, bucket in enumerate(self.buckets):
                if self.zero_stage == 1 or any(w.name in self.full for w in bucket) or index not in self.shards:
                    self._reduce(index)
                    most = max(most, self.held)
        else:
            for w in all_params:
                self._make(w)
            for index in range(len(self.shard_bytes)):      # onto the master copies
                self._reduce(index)
            most = max(most, self.held)
        return most


def step_moments(gradients: Gradients, params: List[LocalWeight], saved: Dict[Optional[int], int],
                 geometry: Optional[PipelineGeometry], device: int,
                 held_for_w: Optional[Dict[Optional[int], int]] = None,
                 units: Optional[GatheredUnits] = None) -> List[Held]:
    """What plan ``device`` holds at each moment of a training step, in order.

    ``saved`` is what one forward of each stage saves for the backward (key ``None`` without a
    pipeline); ``held_for_w``, where the schedule splits the backward, how much of it ``B`` leaves
    for ``W`` (``cost.memory.held_for_weights``; default all); ``gradients`` starts the step empty
    (gradients set to ``None`` before it); ``units``, under ZeRO stage 3, the gathered parameters
    (``cost.gathered``), also starting the step with none.
    """
    return [Held(*m) for m in zip(*_moments(gradients, params, saved, geometry, device, held_for_w, units))]


def step_peak(gradients: Gradients, params: List[LocalWeight], saved: Dict[Optional[int], int],
              geometry: Optional[PipelineGeometry], device: int,
              held_for_w: Optional[Dict[Optional[int], int]] = None, units: Optional[GatheredUnits] = None) -> Held:
    """The first of ``step_moments(...)`` holding the most, without making a ``Held`` of every moment:
    a sweep asks it of every device of many configurations, whose long pipelines have thousands."""
    moments, grads, live, gathered = _moments(gradients, params, saved, geometry, device, held_for_w, units)
    totals = [g + a + u for g, a, u in zip(grads, live, gathered)]
    k = totals.index(max(totals))                       # the first of the largest
    return Held(moments[k], grads[k], live[k], gathered[k])


#: How a block moves the step's bytes (``_blocks``): a forward, the block that releases what its
#: forward saved, and the ``B`` of a split backward (input gradients only).
_FORWARD, _RELEASE, _INPUT_GRADS = range(3)


@functools.lru_cache(maxsize=1024)
def _blocks(geometry: Optional[PipelineGeometry], device: int) -> Tuple[Tuple[int, Optional[int]], ...]:
    """The kind and stage of each block ``device`` runs, in order (one forward and one backward of
    the whole model without a pipeline)."""
    if geometry is None:
        return (_FORWARD, None), (_RELEASE, None)
    release = geometry.schedule.release_phase
    return tuple((_FORWARD if b.phase == "F" else _RELEASE if b.phase == release else _INPUT_GRADS, b.stage)
                 for b in geometry.schedule.blocks_of(geometry.pipeline_device(device)))


def _moments(gradients: Gradients, params: List[LocalWeight], saved: Dict[Optional[int], int],
             geometry: Optional[PipelineGeometry], device: int, held_for_w: Optional[Dict[Optional[int], int]],
             units: Optional[GatheredUnits] = None) -> Tuple[List[StepMoment], List[int], List[int], List[int]]:
    """``step_moments``' moments as four lists, in order: the moment, its gradient bytes, its
    activation bytes, ZeRO-3's gathered bytes. A forward adds what its stage saves; the block that
    releases it (``B``, or ``W`` where the backward is split) frees it, or what ``B`` left of it; a
    split backward's ``B`` frees what ``W`` does not read and marks no moment (no weight gets a
    gradient). Under ZeRO-3 a forward's moment is its fullest (``GatheredUnits.forward``), a
    backward's gathered bytes the most it gathers at once."""
    split = geometry is not None and geometry.schedule.release_phase != "B"
    kept = saved if held_for_w is None else held_for_w
    moments: List[StepMoment] = []
    grads: List[int] = []
    live: List[int] = []
    gathered: List[int] = []
    now, held = 0, gradients.held
    for kind, stage in _blocks(geometry, device):       # a sweep walks thousands of blocks: kept tight
        if kind == _FORWARD:
            part, units_held = units.forward(stage, saved[stage]) if units is not None else (saved[stage], 0)
            moments.append(StepMoment.FORWARD)
            grads.append(held)
            live.append(now + part)
            gathered.append(units_held)
            now += saved[stage]
        elif kind == _RELEASE:
            moments.append(StepMoment.BACKWARD)
            grads.append(gradients.backward(stage))
            live.append(now)
            gathered.append(units.backward(stage, after_inputs=split) if units is not None else 0)
            held = gradients.held
            now -= kept[stage] if split else saved[stage]
        else:
            now -= saved[stage] - kept[stage]
            if units is not None:
                units.input_backward(stage)
    moments.append(StepMoment.STEP)
    grads.append(gradients.step(params))
    live.append(now)
    gathered.append(units.step() if units is not None else 0)
    return moments, grads, live, gathered
