"""Measured memory of one rank, in the categories of the cost model (``nbscaler.columns``).

On any device the live tensors are counted exactly, each storage once:

- parameters, buffers, gradients and optimizer state by walking the module and the optimizer;
- activations with ``torch.autograd.graph.saved_tensors_hooks``: every tensor autograd saves for
  the backward is counted when it is saved and uncounted when autograd lets go of it, so the peak
  of the running total is the most the step ever held (for a pipeline, over the micro-batches in
  flight). Parameters and buffers that ops save (a linear saves its weight) are not activations.

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
from typing import Any, Dict, Iterable, Optional

import torch
import torch.distributed as dist

from nbscaler.columns import MEMORY_CATEGORIES, SummaryColumn as C


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


def static_memory(module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None) -> Dict[str, int]:
    """Parameters, gradients, optimizer state and buffers held right now (bytes, each storage once).

    Optimizer parameters that are not views of the module's own (a copy the optimizer updates)
    count as optimizer state; the gradients of all optimizer parameters (ZeRO's shards) count as
    gradients.
    """
    params = list(module.parameters())
    own = {_key(p) for p in params}
    updated = [p for g in (optimizer.param_groups if optimizer else []) for p in g["params"]]
    extra = [p for p in updated if _key(p) not in own]
    state = [v for s in (optimizer.state.values() if optimizer else []) for v in _tensors(s)]
    return {
        C.PARAM_BYTES: storage_bytes(params),
        C.GRAD_BYTES: storage_bytes([p.grad for p in params] + [p.grad for p in updated]),
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

    Storages whose key is in ``exclude`` (parameters, buffers) are not counted.
    """

    def __init__(self, exclude: Iterable[int] = ()):
        self.exclude = set(exclude)
        self.refs: Dict[int, int] = {}
        self.sizes: Dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self._lock = threading.Lock()       # the backward releases from autograd's threads
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        key = _key(t)
        if key in self.exclude:
            return t
        with self._lock:
            if key not in self.refs:
                self.refs[key] = 0
                self.sizes[key] = t.untyped_storage().nbytes()
                self.live += self.sizes[key]
                self.peak = max(self.peak, self.live)
            self.refs[key] += 1
        return _Saved(t, self, key)

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

    ``stats()`` after the block gives the categories of ``nbscaler.columns``: parameters, gradients,
    optimizer state and buffers as held at that point (after ``optimizer.step()`` they are all
    there), activations as the peak saved during the block, ``peak_bytes`` their sum and, on CUDA,
    ``cuda_max_allocated_bytes``.
    """

    def __init__(self, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None):
        self.module, self.optimizer = module, optimizer
        weights = list(module.parameters()) + list(module.buffers())
        if optimizer is not None:
            weights += [p for g in optimizer.param_groups for p in g["params"]]
        self.saved = SavedTensorMeter(_key(t) for t in weights)
        self.cuda = next((t.device for t in weights if t.is_cuda), None)

    def __enter__(self) -> "MemoryMeter":
        if self.cuda is not None:
            torch.cuda.reset_peak_memory_stats(self.cuda)
        self.saved.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.saved.__exit__(*exc)

    def stats(self) -> Dict[str, int]:
        """One row of measured memory for this rank (bytes)."""
        row: Dict[str, int] = {C.RANK: dist.get_rank() if dist.is_initialized() else 0}
        row.update(static_memory(self.module, self.optimizer))
        row[C.ACTIVATION_BYTES] = self.saved.peak
        row[C.PEAK_BYTES] = sum(row[c] for c in MEMORY_CATEGORIES)
        if self.cuda is not None:
            row[C.CUDA_MAX_ALLOCATED_BYTES] = torch.cuda.max_memory_allocated(self.cuda)
        return {str(k): v for k, v in row.items()}
