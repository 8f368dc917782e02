"""Measured memory of one rank, in the categories of the cost model (``nbscaler.columns``).

On any device the live tensors are counted exactly, each storage once:

- parameters, buffers, gradients and optimizer state by walking the module and the optimizer;
- activations with ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves for
  the backward is counted when it is saved and uncounted when autograd lets go of it (for a
  pipeline, over the micro-batches in flight). Parameters and buffers that ops save (a linear
  saves its weight) are not activations.

``MemoryMeter`` reads them at the moments of a step (``nbscaler.columns.StepMoment``) and reports
what is held at the worst one, as the cost model predicts it (``nbscaler.cost.moments``).

On CUDA ``torch.cuda.max_memory_allocated`` over the measured block is reported as well: it also
sees temporaries and collective buffers, which the categories leave out.

>>> with MemoryMeter(pm, optimizer) as meter:                  # doctest: +SKIP
...     pm.train_step(samples)
...     optimizer.step()
>>> meter.stats()
{'rank': 0, 'param_bytes': 33024, 'grad_bytes': 33024, ..., 'peak_bytes': 140212}
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
import torch.distributed as dist

from nbscaler.columns import MEMORY_CATEGORIES, Held, StepMoment, SummaryColumn as C
from nbscaler.runtime.fsdp import ShardedUnits
from nbscaler.runtime.module import ParallelModule
from nbscaler.runtime.reducer import Reducer


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def storage_bytes(tensors: Iterable[Optional[torch.Tensor]], exclude: Iterable[int] = ()) -> int:
    """Bytes of the distinct storages behind ``tensors`` (``None`` entries skipped), leaving out
    storages whose key is in ``exclude``."""
    seen = set(exclude)
    total = 0
    for t in tensors:
        if t is None or _key(t) in seen:
            continue
        seen.add(_key(t))
        total += t.untyped_storage().nbytes()
    return total


def _updated(optimizer: Optional[torch.optim.Optimizer]) -> List[torch.Tensor]:
    return [p for g in (optimizer.param_groups if optimizer else []) for p in g["params"]]


def gradient_bytes(module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> int:
    """Bytes of the gradients held right now: of the module's parameters and of the optimizer's
    (ZeRO's shards), each storage once."""
    return storage_bytes([p.grad for p in module.parameters()] + [p.grad for p in _updated(optimizer)])


def _sharded(module: torch.nn.Module) -> List[ShardedUnits]:
    """ZeRO stage 3's units of every parallel module in ``module``."""
    return [r for m in module.modules() for r in [getattr(m, "reducer", None)] if isinstance(r, ShardedUnits)]


def gathered_bytes(module: torch.nn.Module) -> int:
    """Bytes of ZeRO-3 parameters gathered right now."""
    return sum(r.gathered_bytes for r in _sharded(module))


def static_memory(module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, int]:
    """Parameters, gradients, optimizer state and buffers held right now (bytes, each storage once).

    Optimizer parameters that are not views of the module's own (a copy the optimizer updates)
    count as optimizer state, except ZeRO-3's shards in the parameters' dtype, which are the
    parameters this rank stores; the gradients of all optimizer parameters (ZeRO's shards) count as
    gradients.
    """
    params = list(module.parameters()) + [s for r in _sharded(module) for s in r.stored_shards()]
    own = {_key(p) for p in params}
    extra = [p for p in _updated(optimizer) if _key(p) not in own]
    state = [v for s in (optimizer.state.values() if optimizer else []) for v in _tensors(s)]
    return {
        C.PARAM_BYTES: storage_bytes(params),
        C.GRAD_BYTES: gradient_bytes(module, optimizer),
        C.OPTIMIZER_BYTES: storage_bytes(extra + state, exclude=own),
        C.BUFFER_BYTES: storage_bytes(module.buffers()),
    }


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


class _Saved:
    """What autograd keeps instead of a saved tensor while the meter runs; uncounts it when dropped."""

    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor: torch.Tensor, meter: "SavedTensorMeter", key: int):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        self.meter._release(self.key)


class SavedTensorMeter:
    """Counts the storages autograd saves for the backward while active: ``live`` now, ``peak`` ever.

    Storages whose key is in ``exclude`` (parameters, buffers) are not counted; ``on_save(live)``
    is called each time a new storage is counted.
    """

    def __init__(self, exclude: Iterable[int] = (), on_save: Optional[Callable[[int], None]] = None):
        self.exclude = set(exclude)
        self.on_save = on_save
        self.refs: Dict[int, int] = {}
        self.sizes: Dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self._lock = threading.Lock()       # the backward releases from autograd's threads
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    @staticmethod
    def storage(t: torch.Tensor) -> torch.UntypedStorage:
        """The storage ``t``'s bytes live in (a subclass counts a tensor subclass by its own)."""
        return t.untyped_storage()

    def _pack(self, t: torch.Tensor) -> Any:
        storage = self.storage(t)
        key = storage._cdata
        if key in self.exclude:
            return t
        with self._lock:
            if key not in self.refs:
                self.refs[key] = 0
                self.sizes[key] = storage.nbytes()
                self.live += self.sizes[key]
                self.peak = max(self.peak, self.live)
                if self.on_save is not None:
                    self.on_save(self.live)
            self.refs[key] += 1
        # Detached: a tensor autograd saves as an output of its own node (softmax's result) would
        # otherwise hold that node through its grad_fn, a cycle through C++ that nothing collects;
        # a node a split backward's W never runs would then keep its saved tensors forever.
        return _Saved(t.detach(), self, key)

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        with self._lock:
            self.refs[key] -= 1
            if self.refs[key] == 0:
                del self.refs[key]
                self.live -= self.sizes.pop(key)

    def __enter__(self) -> "SavedTensorMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


class MemoryMeter:
    """Measure one rank's memory around a block of work (typically one training step).

    The meter follows the moments of ``nbscaler.columns.StepMoment`` as they happen: a forward's
    end each time autograd saves a new storage; a backward's end through a callback that the
    first gradient of each backward queues on autograd's engine, counting the activations held
    when it started and the most gradients held during it (ZeRO's reducer reports the instant
    before it frees a bucket's gradients); a zero-bubble schedule's W block, which runs as several
    backwards, once at its end; and the end of the block, after ``optimizer.step()``.
    ``stats()`` after the block gives the categories of ``nbscaler.columns``: parameters,
    optimizer state and buffers as held at the end, gradients and activations as held at the
    peak moment (``peak``), ``peak_bytes`` their sum and, on CUDA, ``cuda_max_allocated_bytes``.
    A backward that gives no parameter a gradient is not seen; it only frees activations.
    """

    def __init__(self, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None):
        self.module, self.optimizer = module, optimizer
        weights = list(module.parameters()) + list(module.buffers())
        if optimizer is not None:
            weights += [p for g in optimizer.param_groups for p in g["params"]]
        self.saved = SavedTensorMeter((_key(t) for t in weights), on_save=self._forward)
        self.cuda = next((t.device for t in weights if t.is_cuda), None)
        self.reducers = [r for m in module.modules() for r in [getattr(m, "reducer", None)] if isinstance(r, Reducer)]
        self.pipelined = [m for m in module.modules() if isinstance(m, ParallelModule)]
        self.sharded = _sharded(module)
        self.peak: Optional[Held] = None
        self._lock = threading.Lock()
        self._handles: List[Any] = []

    # -- the moments ------------------------------------------------------------------------------
    def _grads(self) -> int:
        return gradient_bytes(self.module, self.optimizer)

    def _count(self, moment: StepMoment, grads: int, activations: int, gathered: int = 0) -> None:
        held = Held(moment, grads, activations, gathered)
        if self.peak is None or held.nbytes > self.peak.nbytes:
            self.peak = held

    def _most_gathered(self) -> int:
        """ZeRO-3: the most parameters gathered since the last count."""
        return sum(r.take_most_gathered() for r in self.sharded)

    def _forward(self, live: int) -> None:
        with self._lock:
            self._started = max(self._started, live)
            self._most_gathered()
            self._count(StepMoment.FORWARD, self._held, live, gathered_bytes(self.module))

    def _observe(self) -> None:
        with self._lock:
            self._most = max(self._most, self._grads())

    def _on_gradient(self, param: torch.Tensor) -> None:
        # Autograd has no public hook for "this backward is done"; the engine runs callbacks queued
        # during a backward once all of it has run (DDP finds the end of a backward the same way).
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)

    def _backward_end(self) -> None:
        with self._lock:
            self._in_backward = False
            if self._weight_pass is None:
                self._count_backward()
            else:                     # one of a W block's calls: the block's end counts them all
                self._weight_pass = True
                self._most = max(self._most, self._grads())

    def _count_backward(self) -> None:
        self._held = self._grads()
        self._count(StepMoment.BACKWARD, max(self._most, self._held), self._started, self._most_gathered())
        self._started, self._most = self.saved.live, self._held

    def _on_weight_pass(self, starting: bool) -> None:
        """A W block starts or ends (``ParallelModule.weight_pass_observers``). It runs its weight
        branches as several backwards; like one backward, it counts once, at its end: with the
        activations held when it started and the most gradients it held. The ``B`` blocks before
        it may have freed some of what the forwards saved (the loss above the last weight), so
        the activations are read when it starts, not the most since the last count."""
        with self._lock:
            if starting:
                self._weight_pass = False           # True once one of its backwards has ended
                self._started = self.saved.live
            else:
                if self._weight_pass:
                    self._count_backward()
                self._weight_pass = None

    # -- the block --------------------------------------------------------------------------------
    def __enter__(self) -> "MemoryMeter":
        if self.cuda is not None:
            torch.cuda.reset_peak_memory_stats(self.cuda)
        self.peak = None
        self._held = self._most = self._grads()
        self._most_gathered()
        self._started, self._in_backward, self._weight_pass = 0, False, None
        self._handles = [p.register_post_accumulate_grad_hook(self._on_gradient)
                         for p in self.module.parameters() if p.requires_grad]
        for reducer in self.reducers:
            reducer.observers.append(self._observe)
        for module in self.pipelined:
            module.weight_pass_observers.append(self._on_weight_pass)
        self.saved.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.saved.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        for reducer in self.reducers:
            reducer.observers.remove(self._observe)
        for module in self.pipelined:
            module.weight_pass_observers.remove(self._on_weight_pass)
        with self._lock:
            self._count(StepMoment.STEP, max(self._most, self._grads()), self.saved.live, gathered_bytes(self.module))

    def stats(self) -> Dict[str, int]:
        """One row of measured memory for this rank (bytes)."""
        if self.peak is None:
            raise RuntimeError("MemoryMeter.stats() reads a measured block: run one under `with meter:` first.")
        row: Dict[str, int] = {C.RANK: dist.get_rank() if dist.is_initialized() else 0}
        row.update(static_memory(self.module, self.optimizer))
        row[C.GRAD_BYTES], row[C.ACTIVATION_BYTES] = self.peak.grad_bytes, self.peak.activation_bytes
        row[C.GATHERED_BYTES] = self.peak.gathered_bytes
        row[C.PEAK_BYTES] = sum(row[c] for c in MEMORY_CATEGORIES)
        if self.cuda is not None:
            row[C.CUDA_MAX_ALLOCATED_BYTES] = torch.cuda.max_memory_allocated(self.cuda)
        return {str(k): v for k, v in row.items()}
