"""Start a few local ranks with ``torch.distributed`` initialised, without ``torchrun``.

This is what the demo, the benchmarks and the multi-process tests use on one machine. Each rank is a
fresh process running ``fn(*args)``; the return values come back in rank order. A rank that raises
makes the whole call raise with that rank's traceback, and a run that outlives ``timeout`` is
killed, so a hung collective ends in an error instead of a frozen terminal.

On Linux the ranks are forked from multiprocessing's fork server, which imports torch and nbscaler
once (``PRELOAD``), the first time ranks start. A spawned interpreter imports them itself: seconds
of CPU per rank, all ranks at once on cores they share (4 ranks started in 6.4 s on 2 cores, and
in 0.1 s forked). Each rank still gets a process of its own, and the caller's environment as it is
when the ranks start, as a spawned one does. Elsewhere the ranks are spawned.

>>> def world(): import torch.distributed as dist; return dist.get_world_size()
>>> spawn(world, nranks=2)                      # doctest: +SKIP
[2, 2]
"""

from __future__ import annotations

import io
import os
import queue
import tempfile
import time
import traceback
import warnings
from datetime import timedelta
from multiprocessing.connection import wait
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nbscaler.config import threads_per_rank
from nbscaler.runtime.backend import BackendChoice, host_backend


#: What the fork server imports once for every rank it forks.
PRELOAD = ("torch", "torch.distributed", "nbscaler")


def rank_context() -> "mp.context.BaseContext":
    """The multiprocessing context ranks start in: the fork server where the platform has one."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))   # read once, when the server first starts
    return ctx


class RankFailed(RuntimeError):
    """A rank raised; the message carries its rank and remote traceback."""


class PeerFailed(RuntimeError):
    """This rank stopped because another rank (``peer``) failed first and told it so: an error
    that only follows from the peer's, which is the one to read."""

    def __init__(self, peer: int, message: str):
        super().__init__(message)
        self.peer = peer


def init_process_group(rank: int, world_size: int, init_method: Optional[str], timeout_s: float,
                       local_rank: Optional[int] = None, *, store: Optional[dist.Store] = None,
                       local_world_size: Optional[int] = None, backend: Optional[str] = None) -> BackendChoice:
    """Join the group with the backend and device ``nbscaler.runtime.backend`` chooses for this host
    (nccl with a GPU per local rank, else gloo on the CPU); returns that choice.

    The ranks meet through ``init_method`` (a URL such as ``file:///tmp/x``) or through an open
    ``store``. ``local_rank`` (the rank among the processes of this host) picks the GPU, and
    ``local_world_size`` (how many ranks this host runs) decides whether there is one for each;
    they default to ``rank`` and ``world_size``, which is right when all ranks share one host.
    ``backend`` ('nccl' or 'gloo') overrides the choice, as ``NBSCALER_BACKEND`` does. A choice
    worth knowing about (ranks outnumber GPUs) is said once per host, by its local rank 0.
    """
    local_rank = rank if local_rank is None else local_rank
    choice = host_backend(world_size if local_world_size is None else local_world_size, backend)
    if choice.note and local_rank == 0:
        warnings.warn(choice.note, stacklevel=2)
    if choice.on_gpu:
        torch.cuda.set_device(choice.device(local_rank))
    dist.init_process_group(choice.backend.value, init_method=init_method, store=store, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout_s))
    return choice


def _rank_main(rank: int, world_size: int, init_method: str, timeout_s: float, threads: int,
               environment: dict, results: "mp.Queue", fn: Callable, args: tuple) -> None:
    # A forked rank has the fork server's environment, from when it started: take the caller's.
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(threads)
    try:
        init_process_group(rank, world_size, init_method, timeout_s)
        out = fn(*args)
        # Plain bytes: tensors sent as shared memory would vanish when this process exits.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # report everything, including KeyboardInterrupt in the child
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _dead(procs, finished) -> List[int]:
    return [r for r, p in enumerate(procs) if r not in finished and not p.is_alive() and p.exitcode not in (0, None)]


def spawn(fn: Callable[..., Any], nranks: int, *args: Any, timeout: float = 300.0,
          threads: Optional[int] = None) -> List[Any]:
    """Run ``fn(*args)`` on ``nranks`` fresh processes that form one process group.

    ``fn`` must be importable by name (defined at module level), as with any spawned process.
    ``threads`` is the intra-op thread count per rank; by default the cores are shared out.
    Raises ``RankFailed`` when a rank raises, ``TimeoutError`` when the run outlives ``timeout``.
    """
    ctx = rank_context()
    results = ctx.Queue()
    threads = threads or threads_per_rank(os.cpu_count() or 1, nranks)
    # The ranks meet in a file of a folder only this call uses: no port to find free, nothing to race.
    rendezvous = tempfile.TemporaryDirectory(prefix="nbscaler-spawn-")
    init_method = "file://" + os.path.join(rendezvous.name, "rendezvous")
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(r, nranks, init_method, max(10.0, timeout), threads, dict(os.environ), results,
                               fn, args))
             for r in range(nranks)]
    for p in procs:
        p.start()
    outs: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outs) < nranks:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(nranks)) - set(outs))
                raise TimeoutError(
                    f"ranks {missing} did not finish within {timeout:.0f}s (a hung collective, or a rank "
                    f"waiting for one that never came); raise `timeout` if the work is simply slow.")
            try:
                rank, ok, out = results.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = _dead(procs, outs)
                if dead:
                    raise RankFailed(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                                     "before returning (killed, or out of memory).")
                continue
            if not ok:
                # A rank that died silently is the cause; the others only fail talking to it. Give a
                # dying rank a moment to be seen exiting (its sentinel becomes ready when it does).
                wait([p.sentinel for r, p in enumerate(procs) if r != rank and r not in outs], timeout=0.5)
                dead = _dead(procs, outs)
                if dead:
                    raise RankFailed(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} before "
                                     f"returning (killed, or out of memory); rank {rank} then raised:\n{out}")
                raise RankFailed(f"rank {rank} raised:\n{out}")
            # Not weights_only: fn may return any picklable value. The bytes come from a rank this call
            # forked, over its private queue (itself a pickle), from the caller's own fn; no file is read.
            outs[rank] = torch.load(io.BytesIO(out), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=5 if len(outs) == nranks else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
        rendezvous.cleanup()
    return [outs[r] for r in range(nranks)]
