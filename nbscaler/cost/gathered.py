"""ZeRO stage 3's gathered parameters through a training step, as the runtime gathers and frees them.

``nbscaler.runtime.fsdp`` keeps each unit's parameters as shards and all-gathers the whole unit
(flat, padded to a multiple of the ZeRO group, in the parameters' dtype) where the forward reaches
it. This pass follows the same rules on the events the replay recorded (``LocalRun.units``: each
``Unshard`` and ``Reshard`` with the bytes the forward had saved by then):

- forward: ``Unshard(unit, prefetch)`` gathers the unit and starts the prefetched one;
  ``Reshard(unit)`` frees the unit, unless a backward of it has begun and not yet reduced its
  gradients. Saved bytes only grow during a forward, so the most it holds is at one of the moments
  just before a unit is freed, or at its end;
- backward: autograd reaches the units in the reverse of the order the forward gathered them. A
  unit the forward freed is gathered again first, and the unit gathered before it (in the order of
  the whole module) is prefetched; once the backward has made the unit's gradients they are
  reduced and the unit is freed, unless the forward kept it gathered and other forwards still
  need it (``ShardedUnits.forwards``). A split backward gathers at ``B`` and reduces at ``W``;
- the optimizer step: everything is freed before it (``ShardedUnits.sync``).

The meter (``runtime.memory.MemoryMeter``) reads a backward's gathered bytes as the most held since
its previous count, the last tensor the forward saved; ``since`` keeps the same figure here.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Tuple

from nbscaler.cost.local import UnitEvent


class GatheredUnits:
    """ZeRO-3's gathered bytes on one rank as its step goes on.

    Args:
        unit_bytes: each unit's gathered bytes (``cost.memory.unit_bytes``).
        events: per stage (``None`` without a pipeline), the forward's ``UnitEvent``s.
        completes: the units whose gradients one backward of their stage makes in full (so the
            runtime reduces and frees them); the others stay gathered until the optimizer step.
    """

    def __init__(self, unit_bytes: Dict[str, int], events: Dict[Optional[int], Sequence[UnitEvent]],
                 completes: Set[str]):
        self.unit_bytes, self.events, self.completes = unit_bytes, events, completes
        self.gathered: Set[str] = set()
        self.forwards: Dict[str, int] = {u: 0 for u in unit_bytes}
        self.backing: Dict[str, int] = {u: 0 for u in unit_bytes}
        self.released: Set[str] = set()
        self.order: List[str] = []
        self.since = 0                       # the most held since the meter's last count

    @property
    def held(self) -> int:
        """Bytes gathered now."""
        return sum(self.unit_bytes[u] for u in self.gathered)

    def _gather(self, unit: Optional[str]) -> None:
        if unit is not None:
            self.gathered.add(unit)
            self.since = max(self.since, self.held)

    def forward(self, stage: Optional[int], saved: int) -> Tuple[int, int]:
        """Run one forward of ``stage``, which saves ``saved`` bytes in all; returns ``(saved,
        gathered)`` at its fullest moment: the bytes it had saved by then and those gathered then."""
        best, at_save, last = (0, self.held), self.held, 0
        for e in self.events.get(stage, ()):
            if e.saved > last:               # tensors saved since the previous event, with this held
                at_save, last = self.held, e.saved
            if e.unshard:
                if e.unit not in self.order:
                    self.order.append(e.unit)
                self.forwards[e.unit] += 1
                self._gather(e.unit)
                self._gather(e.prefetch)
            else:
                best = max(best, (e.saved, self.held), key=sum)
                self.released.add(e.unit)
                if not self.backing[e.unit]:
                    self.gathered.discard(e.unit)
        if saved > last:
            at_save = self.held
        self.since = at_save
        return max(best, (saved, self.held), key=sum)

    def input_backward(self, stage: Optional[int]) -> None:
        """A split backward's ``B``: each unit reached is gathered (its ``W`` reduces it later)."""
        for unit in self._reached(stage):
            self._begin(unit)

    def backward(self, stage: Optional[int], after_inputs: bool = False) -> int:
        """Run one backward of ``stage`` (with ``after_inputs``, the ``W`` of a split one, whose
        ``B`` gathered the units); returns the most bytes gathered since the last count."""
        for unit in self._reached(stage):
            if not after_inputs:
                self._begin(unit)
            if unit in self.completes:
                self.forwards[unit] = max(self.forwards[unit] - 1, 0)
                self.backing[unit] = max(self.backing[unit] - 1, 0)
                if not self.backing[unit] and (unit in self.released or self.forwards[unit] == 0):
                    self.gathered.discard(unit)
        most, self.since = self.since, self.held
        return most

    def _reached(self, stage: Optional[int]) -> List[str]:
        """The units of ``stage`` in the order a backward reaches them."""
        return [e.unit for e in reversed(self.events.get(stage, ())) if e.unshard]

    def _begin(self, unit: str) -> None:
        """The backward reaches ``unit``: a unit the forward freed is gathered again (the hook on
        its outputs), and the unit gathered before it is prefetched."""
        if unit not in self.released:
            return
        self.backing[unit] += 1
        self._gather(unit)
        at = self.order.index(unit)
        self._gather(self.order[at - 1] if at > 0 else None)

    def step(self) -> int:
        """The optimizer step: everything freed before it."""
        self.gathered.clear()
        for unit in self.forwards:
            self.forwards[unit] = self.backing[unit] = 0
        self.since = 0
        return 0
