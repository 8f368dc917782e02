"""How long collectives take: an alpha-beta model, with defaults and a calibration on a process group.

A message of ``b`` bytes costs ``alpha + b * beta``: a fixed latency and a per-byte time. The
collectives of ``nbscaler.runtime.collectives`` run as rings over ``n`` devices, so each costs a
number of latency steps and moves a share of the tensor through every device:

=========================  ==============================  ===================================
collective                 forward (``b``: local input)    backward (its gradient)
=========================  ==============================  ===================================
``all_gather``             ``(n-1)`` steps, ``(n-1) b``    a local slice
``all_gather_sum_grad``    as ``all_gather``               ``reduce_scatter`` of the whole
``chunk``                  a local slice                   ``all_gather`` of the piece
``all_reduce``             ``2(n-1)``, ``2 (n-1)/n b``     nothing (the gradient passes)
``reduce_scatter``         ``(n-1)``, ``(n-1)/n b``        ``all_gather`` of the piece
``all_to_all``             ``(n-1)``, ``(n-1)/n b``        ``all_to_all``
``sum_grad``               nothing                         ``all_reduce``
``first_only``             nothing                         nothing
=========================  ==============================  ===================================

A backend that runs one of them as another (``layouts.EMULATED``: torch's gloo runs a
reduce-scatter as an all-reduce) is priced as what it runs: ``CommModel.backend`` says which.

``calibrate`` times ``all_reduce`` over a group at a small and a large size, each after a little
compute as a step runs it, and fits ``alpha`` and ``beta`` (a line through the two); a pipeline's
sends take the latency of the small message back to back, between awake peers, and starting one
(``isend`` or ``irecv``) is timed on its own, after compute as well; the result is
cached on disk per backend and group size, and ``load`` returns it, or the defaults when nothing
was calibrated. ``ensure_calibrated`` does that once for every group size a world can use, each
on every group of that size at once; a cluster runs it when it first parallelizes.

>>> model = CommModel(alpha_s=1e-4, beta_s_per_byte=1e-9)
>>> round(model.forward("all_reduce", 4_000_000, 2), 6)
0.0042
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from nbscaler.cost.cache import cache_dir
from nbscaler.cost.speed import rank_device, sync
from nbscaler.layouts import COLLECTIVES, Backend, BackendChoice, Collective, host_backend, runs

def priced_as(fn: str, n: int, backend: Optional[str] = None) -> Optional[Collective]:
    """The primitive collective the models time ``fn``'s forward as: the one ``layouts.COLLECTIVES``
    names, or what ``backend`` runs for it (``layouts.runs``); ``None`` when it moves nothing (a
    local op, or a group of one)."""
    spec = COLLECTIVES.get(fn)
    return runs(backend, spec.priced_as) if spec is not None and n > 1 else None


def backward_time(model, fn: str, nbytes: int, n: int, ranks: Optional[Sequence[int]] = None) -> float:
    """Seconds of the backward of ``fn`` on ``model`` (``nbytes``: the forward's local input): its
    backward partner's forward, on the gradient's local bytes (``layouts.COLLECTIVES``)."""
    spec = COLLECTIVES.get(fn)
    if n <= 1 or spec is None or spec.backward is None:
        return 0.0
    return model.forward(spec.backward, spec.backward_input(nbytes, n), n, ranks)


DEFAULTS = {"gloo": (1e-4, 1 / 2e9), "nccl": (1e-5, 1 / 5e10)}
"""(alpha seconds, beta seconds per byte) when nothing was calibrated: gloo over local TCP, nccl
over NVLink-class links. Rough on purpose; calibrate for numbers worth comparing."""


@dataclass(frozen=True)
class CommModel:
    """``alpha_s`` is the latency a collective pays inside a step, waking its peers included;
    ``p2p_alpha_s`` the latency of a pipeline's send, whose receiver is busy with another block
    when the message arrives (its receive was posted ahead), so it pays no wake-up. ``None``: the
    same as ``alpha_s``. ``p2p_post_s`` is the time a rank spends starting one tensor's ``isend``
    or ``irecv``, on its own clock (``None``: not calibrated, counted as nothing). ``backend`` is
    the one the model times: a collective it emulates is priced as what it runs instead."""

    alpha_s: float
    beta_s_per_byte: float
    calibrated: bool = False
    p2p_alpha_s: Optional[float] = None
    p2p_post_s: Optional[float] = None
    backend: str = Backend.GLOO

    def ring(self, steps: float, nbytes: float) -> float:
        return steps * self.alpha_s + nbytes * self.beta_s_per_byte

    def forward(self, fn: str, nbytes: int, n: int, ranks: Optional[Sequence[int]] = None) -> float:
        """Seconds of collective ``fn`` over ``n`` devices on a local input of ``nbytes``. The
        calibration is of one host's links, so which ``ranks`` the group holds changes nothing
        (``cost.nccl.NcclModel``, the same interface for a target, reads them)."""
        primitive = priced_as(fn, n, self.backend)
        if primitive is None:
            return 0.0
        share = (n - 1) / n
        return {
            Collective.ALL_GATHER: lambda: self.ring(n - 1, (n - 1) * nbytes),
            Collective.ALL_REDUCE: lambda: self.ring(2 * (n - 1), 2 * share * nbytes),
            Collective.REDUCE_SCATTER: lambda: self.ring(n - 1, share * nbytes),
            Collective.ALL_TO_ALL: lambda: self.ring(n - 1, share * nbytes),
        }[primitive]()

    def backward(self, fn: str, nbytes: int, n: int, ranks: Optional[Sequence[int]] = None) -> float:
        """Seconds of the backward of ``fn`` (``nbytes``: the forward's local input)."""
        return backward_time(self, fn, nbytes, n, ranks)

    def p2p(self, nbytes: int, ranks: Optional[Sequence[int]] = None) -> float:
        """Seconds of one pipeline send/recv of ``nbytes``."""
        alpha = self.alpha_s if self.p2p_alpha_s is None else self.p2p_alpha_s
        return alpha + nbytes * self.beta_s_per_byte

    def p2p_post(self, ntensors: int) -> float:
        """Seconds a rank spends starting the sends (or receives) of ``ntensors`` tensors."""
        return ntensors * (self.p2p_post_s or 0.0)


def _backend(backend: Optional[str]) -> str:
    """``backend``, or the one ranks on this machine run (``local_backend``)."""
    return str(backend or local_backend().value)


def local_choice(runtime_ngpus: Optional[int] = None) -> BackendChoice:
    """The backend and device ``runtime_ngpus`` ranks on this host get, as the runtime chooses them
    (``runtime.backend.host_backend``: nccl only where every rank has a GPU of its own, else gloo on
    the CPU; ``NBSCALER_BACKEND`` overrides). Without a count: as many ranks as there are GPUs
    (one where there is none). A plan's ranks all run on this host, as in a notebook."""
    return host_backend(runtime_ngpus or max(1, torch.cuda.device_count()))


def local_backend(runtime_ngpus: Optional[int] = None) -> Backend:
    """The backend a plan of ``runtime_ngpus`` ranks on this machine runs, and so is priced for
    (``local_choice``): gloo on a host with fewer GPUs than ranks, though CUDA is there."""
    return local_choice(runtime_ngpus).backend


def _path(backend: str, nranks: int) -> Path:
    return cache_dir() / f"comm-{backend}-{nranks}.json"


def load(backend: Optional[str] = None, nranks: int = 2) -> CommModel:
    """The calibrated model for ``backend`` (by default ``_backend``'s) and group size, else the defaults."""
    backend = _backend(backend)
    path = _path(backend, nranks)
    if path.exists():
        return replace(CommModel(**json.loads(path.read_text())), backend=backend)
    alpha, beta = DEFAULTS.get(backend, DEFAULTS["gloo"])
    return CommModel(alpha, beta, backend=backend)


def _step_like_work(scratch: torch.Tensor) -> None:
    """About a millisecond of what a training step does between two collectives: a few small
    matrix products and a pass over a few MB, which leave the caches cold and the peers' threads
    asleep, as a step leaves them."""
    a = scratch[: 256 * 256].view(256, 256)
    for _ in range(4):
        torch.mm(a, a).tanh_()
    scratch.mul_(1.0)


def _timed_all_reduce(buf: torch.Tensor, group: Optional[dist.ProcessGroup], repeats: int) -> float:
    """Mean seconds of one ``all_reduce`` of ``buf`` as a training step runs it: after some compute
    (``_step_like_work``), without a barrier before it (which would hide the waits for the slowest
    rank that a step pays).

    Timed back to back instead, a collective finds its buffer in the cache and its peer awake: on
    a 2-core VM a 1 MB gloo ``all_reduce`` took 2 ms back to back and 4 to 5 ms after compute.
    The mean, not the median: a step pays the sum of its collectives, and on a shared machine a
    collective's time has a long tail (a peer not scheduled at once). There the median of a small
    ``all_reduce`` was 0.5 ms and its mean 2 ms, and a tensor-parallel step of 16 paid the mean."""
    scratch = torch.ones(2 ** 20, dtype=buf.dtype, device=buf.device)            # 4 MB
    _warm_connection(buf, group)
    times = []
    for _ in range(repeats):
        _step_like_work(scratch)
        buf.add_(1.0)
        times.append(_one_all_reduce(buf, group))
    return statistics.fmean(times)


def _awake_all_reduce(buf: torch.Tensor, group: Optional[dist.ProcessGroup], repeats: int) -> float:
    """Median seconds of one ``all_reduce`` of ``buf`` run back to back: the latency between peers
    that are awake and waiting for it, as a pipeline's receiver is."""
    _warm_connection(buf, group)
    return statistics.median(_one_all_reduce(buf, group) for _ in range(repeats))


def _warm_connection(buf: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    for _ in range(3):
        dist.all_reduce(buf, group=group)
    dist.barrier(group=group)


def _one_all_reduce(buf: torch.Tensor, group: Optional[dist.ProcessGroup]) -> float:
    sync(buf.device)
    start = time.perf_counter()
    dist.all_reduce(buf, group=group)
    sync(buf.device)
    return time.perf_counter() - start


def _post_seconds(device: torch.device, group: Optional[dist.ProcessGroup], repeats: int) -> Optional[float]:
    """Mean seconds to start one small ``isend`` or ``irecv`` between the group's first two ranks,
    each after some compute (``_step_like_work``), as a pipeline's executor starts them between
    blocks; ``None`` on the other ranks.

    gloo's start is no cheap call: on a 2-core VM, 0.2 to 0.4 ms after compute, a twentieth of a
    small model's stage. The two ranks take turns sending, so each times both kinds."""
    me = dist.get_rank(group)
    if me > 1:
        return None
    peer = dist.get_global_rank(group, 1 - me) if group is not None else 1 - me
    scratch = torch.ones(2 ** 20, dtype=torch.float32, device=device)
    message = torch.zeros(256, dtype=torch.float32, device=device)
    times = []
    for i in range(repeats):
        _step_like_work(scratch)
        sync(device)
        start = time.perf_counter()
        work = (dist.isend(message, peer, group=group, tag=i) if (i + me) % 2 == 0
                else dist.irecv(message, peer, group=group, tag=i))
        times.append(time.perf_counter() - start)
        work.wait()
    return statistics.fmean(times[2:])


def fit(sizes: Sequence[int], seconds: Sequence[float], n: int) -> CommModel:
    """Fit ``alpha`` and ``beta`` to ``all_reduce`` times over ``n`` devices.

    ``t = 2(n-1) alpha + 2(n-1)/n size beta`` is a line in ``size``; it is drawn through the
    smallest and the largest message (each already a mean of many runs). A least-squares fit
    through all of them lets one odd middle size (a shared machine's timings have them) bend the
    latency of the small messages a step sends most of by a factor of two or more.

    >>> m = fit([1000, 2000, 4000], [2.1e-4, 2.2e-4, 2.4e-4], 2)
    >>> round(m.alpha_s * 1e6), round(1 / m.beta_s_per_byte / 1e6)
    (100, 100)
    """
    (s0, t0), (s1, t1) = min(zip(sizes, seconds)), max(zip(sizes, seconds))
    slope = (t1 - t0) / (s1 - s0)
    intercept = t0 - slope * s0
    steps = 2 * max(1, n - 1)
    return CommModel(alpha_s=max(intercept, 1e-7) / steps, beta_s_per_byte=max(slope, 1e-13) * n / steps,
                     calibrated=True)


def calibrate(group: Optional[dist.ProcessGroup] = None, sizes: Sequence[int] = (2**10, 2**22),
              repeats: int = 40, save: bool = True) -> CommModel:
    """Fit ``alpha`` and ``beta`` from ``all_reduce`` timings over ``group`` (every member calls it).

    About a second on a local machine (the mean of ``repeats`` runs per size). Rank 0 of the group
    writes the result to the cache, so ``load`` finds it in later plans.
    """
    if not dist.is_initialized():
        raise RuntimeError("calibrating collectives needs a process group: call it on every rank of a "
                           "torchrun, nbscaler.runtime.launch.spawn or cluster run.")
    n = dist.get_world_size(group)
    device = rank_device(group)
    seconds = [_timed_all_reduce(torch.zeros(size // 4, dtype=torch.float32, device=device), group, repeats)
               for size in sizes]
    awake = _awake_all_reduce(torch.zeros(min(sizes) // 4, dtype=torch.float32, device=device), group, repeats)
    post = _post_seconds(device, group, repeats)
    model = replace(fit(sizes, seconds, n), p2p_alpha_s=awake / (2 * max(1, n - 1)), p2p_post_s=post,
                    backend=dist.get_backend(group))
    if save and dist.get_rank(group) == 0:
        store(model, n, dist.get_backend(group))
    return model


def store(model: CommModel, nranks: int, backend: Optional[str] = None) -> None:
    """Write ``model`` to the cache as the calibration of ``backend`` (as for ``load``) over
    ``nranks`` (atomically)."""
    path = _path(_backend(backend), nranks)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(asdict(model)))
    tmp.replace(path)


def median_model(models: Sequence[CommModel]) -> CommModel:
    """The model whose ``alpha``, ``beta`` and send latency are the medians of ``models``'s:
    several calibrations spread over a while, to set beside the median of as many measurements.
    On a shared machine one calibration in three can catch a slow regime (a small ``all_reduce``
    at a 4 ms scheduler tick, not 0.5 ms); a mean of three then moves by a third, a median not.

    >>> median_model([CommModel(1e-4, 1e-9, True), CommModel(2e-4, 2e-9, True), CommModel(9e-3, 1e-9, True)]).alpha_s
    0.0002
    """
    def median(values: List[Optional[float]]) -> Optional[float]:
        return None if None in values else statistics.median(values)

    return CommModel(statistics.median(m.alpha_s for m in models), statistics.median(m.beta_s_per_byte for m in models),
                     all(m.calibrated for m in models), median([m.p2p_alpha_s for m in models]),
                     median([m.p2p_post_s for m in models]), models[0].backend)


def group_sizes(world_size: int) -> List[int]:
    """The group sizes a plan on ``world_size`` ranks may run collectives over: 2, 4, ... and the world."""
    sizes = [2 ** k for k in range(1, world_size.bit_length()) if 2 ** k < world_size]
    return sizes + ([world_size] if world_size > 1 else [])


def ensure_calibrated(force: bool = False) -> Dict[int, CommModel]:
    """Calibrate every group size of the world that has no calibration in rank 0's cache yet, or
    all of them with ``force``. Every rank calls it.

    Size ``k`` is timed on every block of ``k`` consecutive ranks at once (ranks left over by a
    ``k`` that does not divide the world wait), as a plan's groups of ``k`` run their collectives
    side by side: the tensor-parallel groups of every unit, or of every pipeline stage. Timed on the
    first ``k`` ranks alone, with the others idle, a group of 2 among 4 ranks on 2 cores had the
    cores to itself, and the demo's ``tp`` on 2 x 4 ranks measured twice its prediction. Rank 0's
    group is the one saved. Rank 0 decides what to calibrate and tells the others, so ranks on
    hosts with other caches agree. Returns the models calibrated by this call, by group size
    (empty when all were cached).
    """
    world, me = dist.get_world_size(), dist.get_rank()
    backend = dist.get_backend()
    todo = [[k for k in group_sizes(world) if force or not _path(backend, k).exists()]]
    dist.broadcast_object_list(todo, src=0)
    out = {}
    for k in todo[0]:
        blocks = world // k
        groups = [None] if k == world else [dist.new_group(list(range(b * k, (b + 1) * k))) for b in range(blocks)]
        if me < blocks * k:
            out[k] = calibrate(groups[me // k], save=me == 0)
        dist.barrier()
    return out
