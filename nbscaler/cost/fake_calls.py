"""Fake calls remembered: one dispatch through ``FakeTensorMode`` per distinct call of an op.

A replay (``cost.local.run_local``) calls each op of a rank's program on fake tensors to learn
what it makes and what autograd saves for the backward. The same call comes back again and again:
every decoder layer of a model, every placement of a sweep that keeps a layer's local shapes, each
pipeline stage of repeated layers. A call through fake tensors and autograd costs the better part
of a millisecond on a CPU, while what the replay reads of it is small and depends only on the
call's arguments as the op sees them.

So a replay holds no tensors but ``FakeValue``s, what it reads of a tensor (shape, strides, offset,
dtype, whether it carries a gradient, which storage it lives in and that storage's bytes), and a
call comes in two kinds:

- **remembered** (``FakeCalls``, by ``call_key``): its ``CallRecord`` says where each output's
  storage comes from (an input's, an earlier output's, a new one) and whose storage each tensor
  autograd saved is, so ``CallRecord.rebuild`` makes the outputs' values from the inputs' values
  in microseconds;
- **dispatched**: ``FakeStorages`` makes fake tensors of the inputs (views of one fake tensor per
  storage, so that aliasing is as in the replay), the op runs, and its results are read back as
  values (``FakeStorages.value``); the call's record is kept for next time.

A call is remembered only where its record says all it did: an op that changes an input in place
(its version counter moves), reads a tensor that is not among its inputs, or takes an argument the
key cannot write down exactly is dispatched every time. Storage keys are negative numbers the
replay hands out (``fresh_key``), never a real storage's.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, Dict, Hashable, List, NamedTuple, Optional, Sequence, Tuple

import torch

#: ``(storage key, bytes, dimensions)`` of a tensor autograd saved (``cost.local._Replay.save``).
Stored = Tuple[int, int, int]

_SCALARS = (bool, int, float, str, torch.dtype, type(None))
_counter = itertools.count(1)


def fresh_key() -> int:
    """A storage key no other storage of this process has."""
    return -next(_counter)


@dataclass(frozen=True, eq=False)
class FakeValue:
    """A tensor of a replay as the replay reads it. ``leaf``: made by the replay itself (a weight,
    an input, a received tensor), not by an op: its storage is its own, whole."""

    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int
    dtype: torch.dtype
    requires_grad: bool
    storage: int                 # its storage's key
    nbytes: int                  # its storage's bytes
    leaf: bool = False

    @staticmethod
    def made(shape: Sequence[int], dtype: torch.dtype, requires_grad: bool = False) -> "FakeValue":
        """A new contiguous tensor of its own storage, made by the replay (a leaf)."""
        shape = tuple(shape)
        stride = tuple(itertools.accumulate(reversed(shape[1:]), lambda a, b: a * max(b, 1), initial=1))[::-1]
        stride = stride if shape else ()
        return FakeValue(shape, stride, 0, dtype, requires_grad, fresh_key(), math.prod(shape) * _itemsize(dtype),
                         leaf=True)

    def dim(self) -> int:
        return len(self.shape)

    @property
    def bytes(self) -> int:
        """Bytes of its elements (not of its storage)."""
        return math.prod(self.shape) * _itemsize(self.dtype)

    def stored(self) -> Stored:
        return self.storage, self.nbytes, len(self.shape)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class _Unkeyable(Exception):
    """An argument the key cannot write down exactly: the call is dispatched."""


def _frozen(x: Any, ids: Dict[int, int]) -> Hashable:
    """``x`` as a hashable value equal only where the op would see the same argument: scalars with
    their type (``1``, ``1.0`` and ``True`` differ), values by their place among the inputs."""
    kind = type(x)
    if kind in _SCALARS:
        return kind, repr(x) if kind is float else x       # repr: -0.0 and 0.0, nan
    if kind is FakeValue:
        if id(x) not in ids:
            raise _Unkeyable
        return "T", ids[id(x)]
    if isinstance(x, (tuple, list)):
        return kind, tuple(_frozen(y, ids) for y in x)
    if isinstance(x, dict):
        return kind, tuple((_frozen(k, ids), _frozen(v, ids)) for k, v in x.items())
    if isinstance(x, slice):
        return slice, _frozen(x.start, ids), _frozen(x.stop, ids), _frozen(x.step, ids)
    if x is Ellipsis:
        return "..."
    if isinstance(x, (torch.device, torch.memory_format, torch.layout)):
        return kind, str(x)
    raise _Unkeyable


def call_key(target: Hashable, args: Tuple, kwargs: Dict[str, Any], inputs: Sequence[FakeValue]) -> Optional[Hashable]:
    """Everything a fake call of ``target`` on ``args`` and ``kwargs`` (whose tensors are the
    values ``inputs``) depends on, or ``None`` where it cannot be written down."""
    ids = {id(x): i for i, x in enumerate(inputs)}
    storages: Dict[int, int] = {}
    metas = tuple((x.shape, x.stride, x.offset, x.dtype, x.requires_grad, x.leaf,
                   storages.setdefault(x.storage, len(storages))) for x in inputs)
    try:
        frozen = _frozen(args, ids), _frozen(kwargs, ids)
    except _Unkeyable:
        return None
    return target, frozen, metas, torch.is_grad_enabled()


class _Out(NamedTuple):
    """How to make one output again: ``source`` is ``("same", i)`` (input ``i`` itself),
    ``("input", i)`` or ``("output", j)`` (a view of that one's storage), or ``("new", bytes)``."""

    source: Tuple[str, int]
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    offset: int
    dtype: torch.dtype
    requires_grad: bool


@dataclass(frozen=True)
class CallRecord:
    """What one fake call made (an ``_Out`` per output) and saved: ``("input" | "output", i, dim)``
    for a storage it was given or returned, ``("new", group, nbytes, dim)`` for one made inside."""

    outputs: Tuple[_Out, ...]
    saved: Tuple[Tuple, ...]

    @staticmethod
    def of(inputs: Sequence[torch.Tensor], produced: Sequence[torch.Tensor],
           packed: Sequence[torch.Tensor]) -> "CallRecord":
        """The record of a dispatched call on fake tensors: its ``inputs``, what it ``produced``, what
        autograd saved (``packed``)."""
        where: Dict[int, Tuple[str, int]] = {}
        for i, x in enumerate(inputs):
            where.setdefault(storage_key(x), ("input", i))
        outs = []
        for j, p in enumerate(produced):
            key = storage_key(p)
            same = next((i for i, x in enumerate(inputs) if p is x), None)
            if same is not None:
                source: Tuple[str, int] = ("same", same)
            elif key in where:
                source = where[key]
            else:
                source = ("new", p.untyped_storage().nbytes())
                where[key] = ("output", j)
            outs.append(_Out(source, tuple(p.shape), p.stride(), p.storage_offset(), p.dtype, p.requires_grad))
        saved, groups = [], {}
        for x in packed:
            key = storage_key(x)
            if key in where:
                saved.append((*where[key], x.dim()))
            else:
                saved.append(("new", groups.setdefault(key, len(groups)), x.untyped_storage().nbytes(), x.dim()))
        return CallRecord(tuple(outs), tuple(saved))

    def rebuild(self, inputs: Sequence[FakeValue]) -> Tuple[List[FakeValue], List[Stored]]:
        """The outputs' values of a call on ``inputs`` with this record's key, and what it saved."""
        produced: List[FakeValue] = []
        for out in self.outputs:
            kind, i = out.source
            if kind == "same":
                produced.append(inputs[i])
                continue
            if kind == "new":
                storage, nbytes = fresh_key(), i
            else:
                source = inputs[i] if kind == "input" else produced[i]
                storage, nbytes = source.storage, source.nbytes
            produced.append(FakeValue(out.shape, out.stride, out.offset, out.dtype, out.requires_grad, storage, nbytes))
        groups: Dict[int, int] = {}
        saved: List[Stored] = []
        for entry in self.saved:
            if entry[0] == "new":
                _, group, nbytes, dim = entry
                saved.append((groups.setdefault(group, fresh_key()), nbytes, dim))
            else:
                kind, i, dim = entry
                v = (inputs if kind == "input" else produced)[i]
                saved.append((v.storage, v.nbytes, dim))
        return produced, saved


class FakeCalls:
    """``CallRecord``s by ``call_key``, at most ``size`` of them (the oldest go first)."""

    def __init__(self, size: int = 50_000):
        self.size = size
        self.records: Dict[Hashable, CallRecord] = {}

    def get(self, key: Optional[Hashable]) -> Optional[CallRecord]:
        return self.records.get(key) if key is not None else None

    def put(self, key: Optional[Hashable], inputs: Sequence[torch.Tensor], produced: Sequence[torch.Tensor],
            packed: Sequence[torch.Tensor], versions: Sequence[int]) -> None:
        """Remember a call that changed none of its ``inputs`` (``versions``: their ``_version`` before it)."""
        if key is None or any(x._version != v for x, v in zip(inputs, versions)):
            return
        if len(self.records) >= self.size:
            del self.records[next(iter(self.records))]
        self.records[key] = CallRecord.of(inputs, produced, packed)


#: The calls every replay of this process shares.
CALLS = FakeCalls()


class FakeStorages:
    """Fake tensors for the values of one replay, made only for the calls it dispatches: one fake
    tensor per storage (a leaf's own, or a made storage's, which carries a gradient where it can so
    that, like an op's output, it is no leaf), and every value of that storage a view of it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.bases: Dict[int, torch.Tensor] = {}       # value storage -> its fake tensor
        self.keys: Dict[int, int] = {}                 # that tensor's real storage -> value storage
        self.made: Dict[int, Tuple[FakeValue, torch.Tensor]] = {}   # id(value) -> it (kept: ids stay unique), its tensor
        self.leaves: Dict[int, FakeValue] = {}         # storage -> the leaf that owns it

    def leaf(self, v: FakeValue) -> FakeValue:
        """Note that ``v`` (a leaf) owns its storage; returns it."""
        self.leaves[v.storage] = v
        return v

    def tensor(self, v: FakeValue) -> torch.Tensor:
        """The fake tensor of ``v`` (the same one each time it is asked)."""
        if id(v) not in self.made:
            self.made[id(v)] = (v, self._make(v))
        return self.made[id(v)][1]

    def _make(self, v: FakeValue) -> torch.Tensor:
        base = self.bases.get(v.storage)
        if base is None and v.storage in self.leaves and self.leaves[v.storage] is not v:
            base = self.tensor(self.leaves[v.storage])
        if base is None:
            if v.leaf:
                base = torch.empty_strided(v.shape, v.stride, dtype=v.dtype, device=self.device,
                                           requires_grad=v.requires_grad)
                self._keep(v.storage, base)
                return base
            base = torch.empty(v.nbytes // _itemsize(v.dtype), dtype=v.dtype, device=self.device)
            if v.dtype.is_floating_point or v.dtype.is_complex:
                base = base.requires_grad_().clone()
            self._keep(v.storage, base)
        if base.dtype != v.dtype:
            base = base.view(v.dtype)
        if not v.requires_grad:
            base = base.detach()
        return base.as_strided(v.shape, v.stride, v.offset)

    def _keep(self, storage: int, base: torch.Tensor) -> None:
        self.bases[storage] = base
        self.keys[storage_key(base)] = storage

    def value(self, t: torch.Tensor, known: Sequence[Tuple[torch.Tensor, FakeValue]] = ()) -> FakeValue:
        """The value of a tensor a dispatched call returned: one of ``known`` (its inputs) where
        it is one, else a view of a storage the replay knows, else of a new one (kept)."""
        for x, v in known:
            if t is x:
                return v
        storage = self.keys.get(storage_key(t))
        if storage is None:
            storage = fresh_key()
            self._keep(storage, t)
        v = FakeValue(tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.requires_grad, storage,
                      t.untyped_storage().nbytes())
        self.made[id(v)] = (v, t)
        return v

    def stored(self, t: torch.Tensor) -> Stored:
        """``Stored`` of a tensor a dispatched call saved."""
        storage = self.keys.get(storage_key(t))
        if storage is None:
            storage = fresh_key()
            self._keep(storage, t)
        return storage, t.untyped_storage().nbytes(), t.dim()
