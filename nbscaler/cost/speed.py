"""How fast a device runs now: timing primitives, a reference workload and its calibration on the ranks.

The op profile (``cost.profile``) is taken once and cached, but what it describes moves: a shared
cloud VM ran the same small matrix product in 2.1 ms in some 3-second windows and 2.9 ms in others
a minute later, and ranks that outnumber the cores (4 ranks on 2, as a notebook teaching pipelines
runs them) each get a share of one. A profile taken in one process, alone, describes neither.

So op times are stored as multiples of ``reference_s``, the time of a small fixed forward and
backward timed with them, and read back at the reference's time *as the ranks last measured it*:
``calibrate`` runs the workload on every rank at once, as a training step keeps them all busy,
and caches the mean per device and number of ranks; ``load`` returns the median of the last
``RECENT_CALIBRATIONS``. Where no ranks have calibrated, the reference is the one timed in this
process (so op times read as profiled).

>>> speed_file = _path("cpu-x86_64-1t", 2).name
>>> speed_file
'speed-cpu-x86_64-1t-2ranks.json'
"""

from __future__ import annotations

import contextlib
import platform
import statistics
import time
from pathlib import Path
from typing import Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from nbscaler.cost.cache import cache_dir, read_table, write_table

#: Seconds of reference runs behind one ``reference_s``: enough to take the median over dozens of
#: runs, short enough to repeat before every measurement.
REFERENCE_BUDGET_S = 0.15

#: Calibrations behind the speed ``load`` returns: their median. One calibration is one second of
#: the machine: on a shared 2-core VM the reference took 3.2 ms in one and 5.9 ms in another a few
#: seconds later, while a training step moved far less, and every prediction scales with it.
RECENT_CALIBRATIONS = 5


def device_key(device: Optional[torch.device] = None, threads: Optional[int] = None) -> str:
    """Names the hardware a profile or a speed is valid for: the GPU, or the CPU and its intra-op
    threads (``threads``, this process's count by default)."""
    device = device or (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    if device.type == "cuda":
        return "cuda-" + torch.cuda.get_device_name(device).replace(" ", "_")
    return f"cpu-{platform.machine()}-{threads or torch.get_num_threads()}t"


def rank_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """The device this rank computes on: its GPU under nccl, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU), so a clock read after it is honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def intra_op_threads(threads: Optional[int]) -> Iterator[None]:
    """Run the body with ``threads`` intra-op threads (unchanged when None), then restore them."""
    before = torch.get_num_threads()
    if threads and threads != before:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


_WARM: set = set()


def warm_up(device: torch.device, seconds: float = 0.2) -> None:
    """Run forwards and backwards for a moment, once per process and device: a fresh process's
    first autograd calls (thread pools, allocator, kernel choice) run many times slower than later
    ones, and would otherwise be taken for the first timed work's own time."""
    if device.type + str(device.index) in _WARM:
        return
    x = torch.randn(64, 256, device=device, requires_grad=True)
    w = torch.randn(256, 256, device=device, requires_grad=True)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        F.linear(torch.tanh(x), w).sum().backward()
        sync(device)
    _WARM.add(device.type + str(device.index))


def _reference_step(x: torch.Tensor, w: torch.Tensor) -> None:
    """The reference workload: a matrix product, an elementwise op, a norm and a softmax, forward
    and backward: the kinds of op a transformer's step is made of, so a slower memory or a slower
    core both show in it."""
    h = F.gelu(F.linear(x, w))                                  # (256, 512)
    F.layer_norm(h, h.shape[-1:]).softmax(-1).pow(2).sum().backward()


def reference_s(device: torch.device, threads: Optional[int] = None, budget_s: float = REFERENCE_BUDGET_S) -> float:
    """Median seconds of one run of the reference workload on ``device`` now (``threads`` intra-op
    threads on a CPU, this process's count by default; at least ten runs and ``budget_s``)."""
    with intra_op_threads(threads):
        warm_up(device)
        x = torch.randn(256, 256, device=device, requires_grad=True)
        w = torch.randn(512, 256, device=device, requires_grad=True)
        times = []
        spent = 0.0
        while len(times) < 10 or spent < budget_s:
            sync(device)
            start = time.perf_counter()
            _reference_step(x, w)
            sync(device)
            times.append(time.perf_counter() - start)
            spent += times[-1]
        return statistics.median(times)


def _path(device_key: str, ranks: int) -> Path:
    return cache_dir() / f"speed-{device_key}-{ranks}ranks.json"


def load(device_key: str, ranks: int) -> Optional[float]:
    """The reference's seconds as ``ranks`` ranks on devices ``device_key`` recently measured it
    (the median of their last ``RECENT_CALIBRATIONS`` calibrations), or None."""
    return read_table(_path(device_key, ranks)).get("reference_s")


def store(reference: float, device_key: str, ranks: int) -> None:
    """Add ``reference`` to what ``ranks`` ranks on devices ``device_key`` measured (atomically),
    keeping the last ``RECENT_CALIBRATIONS``. In the cache, so not run as a doctest:

    >>> for seconds in (0.004, 0.0041, 0.0059):          # doctest: +SKIP
    ...     store(seconds, "cpu-x86_64-1t", 2)            # the last one caught a slow second
    >>> load("cpu-x86_64-1t", 2)                          # doctest: +SKIP
    0.0041
    """
    path = _path(device_key, ranks)
    recent = (read_table(path).get("recent") or [])[-(RECENT_CALIBRATIONS - 1):] + [reference]
    write_table(path, {"reference_s": statistics.median(recent), "recent": recent})


def calibrate(group: Optional[dist.ProcessGroup] = None, save: bool = True) -> float:
    """Time the reference workload on every rank of ``group`` at once (every member calls it) and
    return the mean; rank 0 adds it to the cache, so the time model reads op times at this speed
    (with the calibrations just before it: ``load``).

    A fraction of a second. The ranks start together after a barrier, so each is timed while the
    others are busy, as in a training step.
    """
    device = rank_device(group)
    warm_up(device)
    dist.barrier(group=group)
    mine = reference_s(device)
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    mean = statistics.fmean(everyone)
    if save and dist.get_rank(group) == 0:
        store(mean, device_key(device), len(everyone))
    return mean
