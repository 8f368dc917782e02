"""What a device's run of the two-layer copy costs, re-read on each target in a few array operations.

``LayerFacts`` needs, per op of the copy and per device, the op's and its collectives' seconds on the
target beside what does not depend on it (saved bytes, FLOPs). A sweep reads the same runs on many
targets (each knob of the Explorer's space tab that changes the hardware), and the runs of a sweep's
placements repeat a few hundred distinct ops and collectives thousands of times. So a run is read
once into an ``OpLedger``: the target-free facts as a matrix, and for each op and collective its row
and its *kind*, an index into ``Kinds``, the table of distinct ops (``RooflineOps.key``) and
collectives (function, bytes, group) that every ledger of the sweep shares. On a target, ``Kinds``
prices each kind once and a ledger's rows are two ``bincount``s per column, adding each row's
seconds in the order of the run, as a loop over it would.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Set, Tuple

import numpy as np

from nbscaler.cost.context_calls import ring_exposed
from nbscaler.cost.roofline import masked_flops


#: The columns of ``LayerFacts.matrix``: seconds, bytes and FLOPs of one op on one device.
#: ``SAVED_TAIL``: the saved bytes of an op that feeds no weighted op (the loss at the model's
#: end), which a split backward's ``B`` frees on any stage but the first (``cost.memory.held_for_weights``).
#: ``MASKED_F`` / ``MASKED_B``: the FLOPs of those a causal mask hides in a forward, and in a backward
#: with its recomputed forward (``cost.roofline.masked_flops``), which a kernel that skips them does not run.
FWD, BWD, TP_FWD, TP_BWD, SAVED, FLOPS_F, FLOPS_B, FLOPS_AGAIN, MASKED_F, MASKED_B, SAVED_TAIL = range(11)


class Kinds:
    """The distinct ops and collectives of many ledgers, and their seconds on each target asked."""

    def __init__(self) -> None:
        self.ops: Dict[Tuple, int] = {}                # RooflineOps.key -> kind
        self.op_calls: List[Tuple[Tuple, object]] = []  # each kind's key and one of its OpCalls
        self.collectives: Dict[Tuple, int] = {}        # (fn, bytes in, group size, ranks, backward runs) -> kind
        self._priced: List[Tuple[object, object, List[np.ndarray]]] = []   # (profiler, comm, [f, b, cf, cb])

    def op(self, key: Tuple, op) -> int:
        if key not in self.ops:
            self.ops[key] = len(self.op_calls)
            self.op_calls.append((key, op))
        return self.ops[key]

    def collective(self, what: Tuple) -> int:
        return self.collectives.setdefault(what, len(self.collectives))

    def seconds(self, profiler, comm) -> List[np.ndarray]:
        """Forward and backward seconds of every op kind, then of every collective kind, on the
        target of ``profiler`` and ``comm`` (kinds added since the last call are priced now)."""
        found = next((s for p, c, s in self._priced if p is profiler and c is comm), None)
        if found is None:
            found = [np.zeros(0)] * 6
            self._priced.append((profiler, comm, found))
        f, b, cf, cb, rf, rb = found
        if len(f) < len(self.op_calls):
            new_ops = self.op_calls[len(f):]
            more = np.array([profiler.time(op, key) for key, op in new_ops], dtype=float).reshape(-1, 2)
            f, b = np.concatenate([f, more[:, 0]]), np.concatenate([b, more[:, 1]])
            # a context-parallel ring's passes, what its compute does not hide (``cost.context_calls``)
            rings = np.array([ring_exposed(op, comm, profiler.time, again=False) for _, op in new_ops],
                             dtype=float).reshape(-1, 2)
            rf, rb = np.concatenate([rf, rings[:, 0]]), np.concatenate([rb, rings[:, 1]])
        if len(cf) < len(self.collectives):
            new = list(self.collectives)[len(cf):]
            cf = np.concatenate([cf, [comm.forward(fn, n, size, ranks=ranks) for fn, n, size, ranks, _ in new]])
            cb = np.concatenate([cb, [comm.backward(fn, n, size, ranks=ranks) if backward else 0.0
                                      for fn, n, size, ranks, backward in new]])
        found[:] = [f, b, cf, cb, rf, rb]
        return found


class OpLedger(NamedTuple):
    """One device's run of the copy, whatever the target: the facts that do not depend on it, and
    which row each op and collective adds its seconds to, by its kind (an index into ``Kinds``)."""

    fixed: np.ndarray                  # ops x facts, the seconds columns zero
    op_rows: np.ndarray                # per op: its row, its kind, 1.0 where recomputed (its
    op_kinds: np.ndarray               # forward runs again in the backward)
    op_again: np.ndarray
    coll_rows: np.ndarray              # per collective: the same
    coll_kinds: np.ndarray
    coll_again: np.ndarray

    @staticmethod
    def of(run, index: Dict[str, int], count: int, tail: int, kinds: Kinds, key, no_weight: Set[str]) -> "OpLedger":
        """The ledger of ``run`` over the copy's ``count`` ops (``index``: op name -> row); a
        collective with no consumer (a stage's outputs) counts at op ``tail``; ``key``: an op's
        kind (``RooflineOps.key``); ``no_weight``: the ops that feed no weighted op."""
        fixed = [[0.0] * (SAVED_TAIL + 1) for _ in range(count)]   # lists: numpy's per-element indexing is slow here
        op_rows, op_kinds, op_again = [], [], []
        for op in run.ops:
            r = index[op.node.name]
            row = fixed[r]
            meta = op.node.meta
            flops_f, flops_b = meta["local_flops_fwd"], meta["local_flops_bwd"]
            row[SAVED] += op.saved_bytes
            row[FLOPS_F] += flops_f
            row[FLOPS_B] += flops_b
            row[FLOPS_AGAIN] += flops_f if op.recomputed else 0.0
            row[MASKED_F] += masked_flops(meta, flops_f)
            row[MASKED_B] += masked_flops(meta, flops_b + (flops_f if op.recomputed else 0.0))
            row[SAVED_TAIL] += op.saved_bytes if op.node.name in no_weight else 0
            op_rows.append(r)
            op_kinds.append(kinds.op(key(op), op))
            op_again.append(1.0 if op.recomputed else 0.0)
        coll_rows, coll_kinds, coll_again = [], [], []
        for c in run.collectives:
            coll_rows.append(index.get(c.node, tail) if c.node is not None else tail)
            coll_kinds.append(kinds.collective((c.fn, c.in_bytes, len(c.devices), c.devices, c.backward)))
            coll_again.append(1.0 if c.recomputed else 0.0)
        ints = lambda xs: np.array(xs, dtype=np.int64)
        return OpLedger(np.array(fixed, dtype=float).reshape(count, SAVED_TAIL + 1), ints(op_rows), ints(op_kinds),
                        np.array(op_again), ints(coll_rows), ints(coll_kinds), np.array(coll_again))

    def rows(self, kinds: Kinds, profiler, comm) -> np.ndarray:
        """The facts of each op on the target of ``profiler`` and ``comm`` (ops x facts), as
        ``cost.timing.section_time`` and the memory model count them."""
        f, b, cf, cb, rf, rb = kinds.seconds(profiler, comm)
        out = self.fixed.copy()
        count = len(out)
        for rows, kind, again, (fwd, bwd), (fs, bs) in ((self.op_rows, self.op_kinds, self.op_again, (FWD, BWD), (f, b)),
                                                        (self.coll_rows, self.coll_kinds, self.coll_again,
                                                         (TP_FWD, TP_BWD), (cf, cb))):
            if len(rows):
                fk = fs[kind]
                out[:, fwd] = np.bincount(rows, fk, count)
                out[:, bwd] = np.bincount(rows, bs[kind] + fk * again, count)
        if len(self.op_rows) and rf.any():       # rings count with the section's collectives, as in section_time
            rk = rf[self.op_kinds]
            out[:, TP_FWD] += np.bincount(self.op_rows, rk, count)
            out[:, TP_BWD] += np.bincount(self.op_rows, rb[self.op_kinds] + rk * self.op_again, count)
        return out
