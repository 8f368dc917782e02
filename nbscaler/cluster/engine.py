"""The engine side of a cluster: what runs inside every ipyparallel engine.

The notebook never hands a user function straight to the engines. It sends ``call(payload)``,
where ``payload`` is the cloudpickled ``(fn, args, kwargs)``, and ``call`` always returns an
``Outcome``, even when ``fn`` raises. Three things follow from that:

- unpickling happens inside the ``try``, so a function that cannot be rebuilt on an engine is an
  ordinary rank failure with a traceback;
- a failing rank tears down its process group before it answers. That closes its connections, so
  peers blocked in a collective with it fail at once instead of waiting out the group timeout;
- failures carry the wall-clock time they happened, so the notebook can tell the rank that failed
  first (the cause) from the ranks that only lost their peer.

Everything here must be importable on the engines, which is why it imports nothing from the
notebook side of the package.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Dict, Optional

import cloudpickle
import torch
import torch.distributed as dist

from nbscaler.cluster import network
from nbscaler.models import torchvision_compat
from nbscaler.runtime import groups
from nbscaler.runtime.launch import PeerFailed, init_process_group


@dataclass(frozen=True)
class RankInfo:
    """Where one engine sits in the process group, decided by the notebook."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    timeout_s: float
    threads: int
    interface: str = ""


@dataclass
class Outcome:
    """The result of ``fn`` on one rank, or the error it raised."""

    rank: int
    ok: bool
    value: Any = None
    error: str = ""
    traceback: str = ""
    failed_at: float = 0.0
    peer: Optional[int] = None       # the rank whose failure this one only follows from (PeerFailed)


_info: Optional[RankInfo] = None
# How often this engine has joined a process group: re-running a notebook cell must not re-join.
joins = 0
# On rank 0: the rendezvous store the next group forms on (see ``open_rendezvous``).
_store: Optional[dist.TCPStore] = None


def describe(network_choice: Optional[str] = None) -> Dict[str, Any]:
    """Facts the notebook needs to place this engine: host, pid, usable cores, GPUs, and the
    address and interface its process group uses (``network.choose``)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    endpoint = network.choose(network_choice, network.controller_host())
    return {
        "host": socket.gethostname(),
        "address": endpoint.address,
        "interface": endpoint.interface,
        "pid": os.getpid(),
        "cores": cores or 1,
        "gpus": torch.cuda.device_count(),
    }


def ready() -> bool:
    """Nothing: an engine runs its tasks in order, so this returning says every earlier one ended."""
    return True


def open_rendezvous(world_size: int, timeout_s: float, address: str = network.LOOPBACK) -> int:
    """On rank 0: start the store the next group meets at, on ``address`` only and a port the
    system picks; returns the port.

    The store listens from here on, so the port cannot be taken by anyone else before the other
    ranks connect (unlike a port found free, closed, and bound again later). It is handed a
    socket bound to ``address``: left to itself, the store listens on every interface.
    """
    global _store
    listener = network.listen_on(address)
    _store = dist.TCPStore(address, 0, world_size, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=timeout_s), master_listen_fd=listener.detach())
    return _store.port


def join_group(info: RankInfo) -> int:
    """Set the rank environment and threads, then join the process group; returns the join count."""
    global _info, _store, joins
    leave_group()
    os.environ.update(
        RANK=str(info.rank), WORLD_SIZE=str(info.world_size), LOCAL_RANK=str(info.local_rank),
        LOCAL_WORLD_SIZE=str(info.local_world_size), OMP_NUM_THREADS=str(info.threads),
        MASTER_ADDR=info.master_addr, MASTER_PORT=str(info.master_port),
    )
    torch.set_num_threads(info.threads)
    if info.interface:
        network.apply_interface(info.interface)
    if info.rank == 0:
        store, _store = _store, None
        if store is None:
            raise RuntimeError("rank 0 has no rendezvous store: open_rendezvous must run on it first")
    else:
        store = dist.TCPStore(info.master_addr, info.master_port, info.world_size, is_master=False,
                              timeout=timedelta(seconds=info.timeout_s))
    init_process_group(info.rank, info.world_size, None, info.timeout_s, info.local_rank, store=store,
                       local_world_size=info.local_world_size)
    if joins == 0:
        # A stopped engine exits its interpreter normally; a group still alive then may abort it
        # (see nbscaler.runtime.groups), so it leaves first.
        atexit.register(leave_group)
    _info = info
    joins += 1
    return joins


def leave_group() -> None:
    """Destroy every process group of this engine (closing its connections to the peers)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    groups.reset()


def call(payload: bytes) -> Outcome:
    """Run the pickled ``(fn, args, kwargs)``; never raises, the error travels in the Outcome."""
    rank = _info.rank if _info is not None else -1
    try:
        if not dist.is_initialized():
            raise RuntimeError("this engine's process group was destroyed (did the previous function call "
                               "destroy_process_group?); run again: the cluster rebuilds the group after a failure")
        # A payload that imports transformers or timm imports torchvision, which beside a torch it was
        # not built for needs two ops declared first (as the notebook declares them for itself).
        torchvision_compat.declare_missing_ops()
        # Unrestricted on purpose: the payload is the notebook's own function, sent by its ipyparallel client.
        fn, args, kwargs = cloudpickle.loads(payload)
        return Outcome(rank, True, fn(*args, **kwargs))
    except BaseException as exc:  # KeyboardInterrupt too: it is how the notebook stops a rank
        failed_at = time.time()
        # The notebook may interrupt again while this rank cleans up; let it finish.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            # Skip this frame: the traceback should start in the user's code.
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next))
            leave_group()
        finally:
            signal.signal(signal.SIGINT, previous)
        return Outcome(rank, False, error=f"{type(exc).__name__}: {exc}", traceback=text,
                       failed_at=failed_at, peer=exc.peer if isinstance(exc, PeerFailed) else None)


def report(**values: Any) -> None:
    """Send progress to the notebook (e.g. ``report(step=i, loss=l)``) while a call runs.

    The values reach ``Cluster.call(..., on_report=...)`` as the latest dict of each rank. Outside a
    cluster engine (under ``spawn`` or a plain script) this does nothing, so functions that report
    run unchanged everywhere.
    """
    if _info is None:
        return
    from ipyparallel.datapub import publish_data

    publish_data(values)
