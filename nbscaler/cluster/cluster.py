"""``Cluster``: what the notebook holds, ``n`` ipyparallel engines that form one process group.

This module is the user-facing part. What runs the processes is ``session``, what sends a
function to every rank and turns failures into errors is ``calls``, and what a parallel module on
the ranks looks like from the notebook is ``remote``.

One cluster per ``name`` lives in a kernel. Constructing ``Cluster(...)`` again with a name that
is running (a re-run notebook cell) takes over the running engines and their group when the
settings are equal, and stops them first when they differ, so engines never leak. Clusters still
running when the kernel exits are stopped; if the kernel is killed instead, each cluster's watchdog
ends its processes.
"""

from __future__ import annotations

import atexit
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

import ipyparallel

from nbscaler.cluster.calls import ReportHandler, call_every_rank, rebuild_group
from nbscaler.cluster.errors import ClusterError
from nbscaler.cluster.remote import RemoteModule
from nbscaler.cluster.session import ClusterSpec, EngineSlot, Session
from nbscaler.config import ComputeConfig

# name -> the Cluster that owns the running engines of that name in this kernel.
_live: Dict[str, "Cluster"] = {}


@atexit.register
def _stop_all() -> None:
    """Stop the clusters still running when the kernel exits (ipyparallel's own hook is off)."""
    for cluster in list(_live.values()):
        try:
            cluster.stop()
        except Exception as err:  # keep stopping the others; there is no caller left to raise to
            print(f"nbscaler: stopping {cluster!r} at exit failed: {err}", file=sys.stderr)


class Cluster:
    """``n`` ipyparallel engines, one rank each, with ``torch.distributed`` initialised.

    >>> with Cluster(n=2, timeout=20) as cl:                        # doctest: +SKIP
    ...     cl.run(lambda: torch.distributed.get_rank())
    [0, 1]

    Args:
        n: number of engines, i.e. ranks.
        engines: ipyparallel engine launcher: ``'local'`` (processes on this machine), ``'mpi'``
            (``mpiexec``), ``'slurm'`` (an ``sbatch`` job), or any other launcher name or class
            ipyparallel knows.
        timeout: seconds a collective may wait for a peer before it fails (the process group
            timeout). A failed call raises within seconds when ranks fail outright, and within
            ``2 * timeout + 10`` seconds in the worst case (a hung collective, then a rank that
            ignores the interrupt until its own collective times out).
        name: one cluster per name runs in a kernel (see the module docstring).
        threads: intra-op threads per rank; by default a host's cores are shared among its engines.
        start_timeout: seconds to wait for all engines to register (a Slurm queue may need more).
        profile_dir: ipyparallel profile folder for connection files and logs; by default a fresh
            temporary folder, removed at ``stop()``. Use a shared folder for engines on other hosts.
        master_addr: address of rank 0 for the rendezvous; by default rank 0's own address (below).
        network: where the process group talks: an interface name (``'ib0'``) or a subnet
            (``'10.1.0.0/16'``) every host has an address on. By default each engine uses the
            address, and interface, that routes to the controller (loopback when everything is on
            this host). ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` are set to each engine's
            interface unless the environment already sets them.
        launcher_options: traits of the engine launcher, e.g. ``{'mpi_args': [...]}`` for MPI or
            ``{'queue': 'gpu', 'timelimit': '1:00:00'}`` for Slurm; ``environment`` is merged.
        cluster_options: traits of ``ipyparallel.Cluster``, e.g. ``{'controller_ip': '10.1.0.5'}``. The
            controller listens on one address: by default loopback for local engines, and this host's
            address on ``network`` (or of its host name) otherwise; a wildcard (``'*'``) is refused.
        start: start at once (the default); otherwise call ``start()`` or use ``with``.
    """

    def __init__(self, n: int, engines: str = "local", timeout: float = 300.0, *, name: str = "default",
                 threads: Optional[int] = None, start_timeout: float = 120.0,
                 profile_dir: Optional[str] = None, master_addr: Optional[str] = None,
                 network: Optional[str] = None, launcher_options: Optional[Dict[str, Any]] = None,
                 cluster_options: Optional[Dict[str, Any]] = None, start: bool = True):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"Cluster(n={n!r}) is invalid: n is the number of engines (ranks), a positive integer.")
        if timeout <= 0:
            raise ValueError(f"Cluster(timeout={timeout!r}) is invalid: give the collective timeout in seconds (> 0).")
        self.name = name
        self.spec = ClusterSpec(n, engines, float(timeout), threads, float(start_timeout), profile_dir,
                                master_addr, network, dict(launcher_options or {}), dict(cluster_options or {}))
        self._session: Optional[Session] = None
        if start:
            self.start()

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._session is not None

    def start(self) -> "Cluster":
        """Start the engines and the group, or take over those of an equal running cluster."""
        return self._start()

    def _start(self, prepared: Optional[Session] = None) -> "Cluster":
        if self._session is not None:
            return self
        previous = _live.get(self.name)
        if previous is not None and previous is not self:
            if previous.spec == self.spec and previous._healthy():
                self._session, previous._session = previous._session, None
            else:
                previous.stop()
        _live[self.name] = self
        if self._session is None:
            self._session = (prepared or Session(self.spec, self.name)).start()
        elif prepared is not None:
            prepared.close()
        return self

    def stop(self) -> None:
        """Stop every engine and the controller; no process of this cluster is left afterwards."""
        session, self._session = self._session, None
        if _live.get(self.name) is self:
            del _live[self.name]
        if session is not None:
            session.close()

    def restart(self) -> "Cluster":
        """Replace all engines by fresh ones with a new process group (after a rank died, say)."""
        fresh = Session(self.spec, self.name)  # its fork server imports while the old engines stop
        try:
            self.stop()
        except BaseException:
            fresh.close()
            raise
        return self._start(fresh)

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "stopped"
        if self._session is not None:
            hosts = len({slot.host for slot in self._session.slots})
            state = self._session.broken or f"running on {hosts} host{'s' if hosts > 1 else ''}"
        return f"Cluster(name={self.name!r}, n={self.spec.n}, engines={self.spec.engines!r}: {state})"

    # -- what the notebook uses -----------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.spec.n

    @property
    def engines(self) -> List[EngineSlot]:
        """The engines in rank order: engine id, host, pid, local rank."""
        return list(self._running().slots)

    @property
    def cluster_id(self) -> str:
        """The ipyparallel cluster id; every process of the cluster has it as ``$IPP_CLUSTER_ID``."""
        return self._running().cluster_id

    @property
    def job_id(self) -> Optional[str]:
        """The batch job the engines run in (``engines='slurm'`` and other batch launchers), else None.

        ``restart()`` submits a new job, so the id changes with it.
        """
        return self._running().job_id

    @property
    def profile_dir(self) -> str:
        """The ipyparallel profile folder: connection files (``security/``) and logs (``log/``)."""
        return self._running().profile_dir

    @property
    def client(self) -> ipyparallel.Client:
        """The ipyparallel client connected to this cluster's controller."""
        return self._running().client

    @property
    def view(self) -> ipyparallel.DirectView:
        """A blocking view of the engines in rank order; ``%px``/``%%px`` run on it."""
        return self._running().view

    @property
    def single_host(self) -> bool:
        """Whether every engine runs on the notebook's host."""
        return self._running().single_host

    def parallelize(self, module_or_module_class: Any, dummy_forward_args: Dict[str, Any], pas_policy: Any,
                    compute_config: ComputeConfig, *, name: Optional[str] = None,
                    **parallelize_kwargs: Any) -> RemoteModule:
        """``nbscaler.parallelize`` on every rank; returns a handle to train and infer with.

        Rank 0 compiles (or reuses an earlier compile), the others wait for it and load their
        own generated code. ``parallelize_kwargs`` are those of ``nbscaler.parallelize``
        (``gen_savedir``, ``reuse``, ``instance_name``, ``broadcast_strategy``, ...). The broadcast
        strategy defaults to ``'none'`` when all engines share this host (the files are already
        there) and to ``'all'`` otherwise. ``name`` (default: ``instance_name`` or the class name)
        identifies the module on the ranks; parallelizing again under a name replaces it.
        """
        return RemoteModule.create(self, module_or_module_class, dummy_forward_args, pas_policy, compute_config,
                                   name, parallelize_kwargs)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> List[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; element ``r`` of the result is rank ``r``'s."""
        return self.call(fn, args, kwargs)

    def call(self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
             *, on_report: Optional[ReportHandler] = None) -> List[Any]:
        """``run`` with the arguments spelt out, plus ``on_report``.

        ``on_report`` is called about every 50 ms with the latest ``report(...)`` values of each
        rank (an empty dict for a rank that has not reported yet); progress bars use it.
        """
        return call_every_rank(self._ready(), fn, args, dict(kwargs or {}), on_report)

    # -- calls ------------------------------------------------------------------------------------
    def _running(self) -> Session:
        if self._session is None:
            raise ClusterError(
                f"Cluster(name={self.name!r}) is not running: it was stopped, or a newer Cluster with "
                "the same name took over its engines. Call start() (or restart()), or use the newer one.")
        return self._session

    def _ready(self) -> Session:
        session = self._running()
        if session.broken:
            raise ClusterError(f"{session.broken}; call restart() for fresh engines and a new process group.")
        if session.group_dirty:
            rebuild_group(session)
        return session

    def _healthy(self) -> bool:
        session = self._session
        return session is not None and not session.broken and not session.dead(session.slots)
