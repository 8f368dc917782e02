"""``Cluster``: ipyparallel engines that form one ``torch.distributed`` process group.

A cluster is one ipyparallel controller plus ``n`` engines, each engine one rank. Starting it runs
four steps, each a method below:

1. launch the controller and the engines with ipyparallel's own launchers (``_launch``);
2. wait for the engines and put them in rank order: rank ``r`` is the ``r``-th engine id, which
   is also the MPI rank under ``mpiexec`` (``_wait_for_engines``, ``place_ranks``);
3. join the process group: gloo on CPU, nccl with one GPU per local rank (``_join_group``);
4. activate ``%px``/``%%px`` on a view of the engines in rank order, if IPython is running.

A call (``run``/``call``) sends one cloudpickled payload to every rank and waits for all of them.
The rules for failures, which keep every error bounded in time:

- a rank that raises tears down its group before answering, so peers blocked on it fail at once;
  ranks still busy a few seconds after the first failure are interrupted (SIGINT). A collective
  that waits for a rank that never comes fails after ``timeout``, so an error reaches the notebook
  within ``timeout`` plus a few seconds, whatever the ranks were doing;
- the call raises ``RankError`` naming the rank that failed first, with its remote traceback, and
  the group is rebuilt (new rendezvous, same engines) before the next call;
- an engine process that exits is seen within a fraction of a second (its pid, on this host) or
  by the controller's heartbeat (other hosts); the call raises ``RankDied`` and the cluster takes
  no more calls until ``restart()``.

One cluster per ``name`` lives in a kernel. Constructing ``Cluster(...)`` again with a name that
is running (a re-run notebook cell) takes over the running engines and their group when the
settings are equal, and stops them first when they differ, so engines never leak.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import cloudpickle
import ipyparallel
import psutil
from ipyparallel.error import EngineError, RemoteError

from nbscaler.cluster import engine
from nbscaler.cluster.engine import Outcome, RankInfo
from nbscaler.cluster.errors import ClusterError, RankDied, RankError
from nbscaler.cluster.launchers import launcher_options, threads_per_engine
from nbscaler.cluster.remote import RemoteModule
from nbscaler.config import ComputeConfig
from nbscaler.runtime.launch import free_port

POLL_S = 0.05
# How long a finished call waits for its last reports, which travel apart from the results.
OUTPUT_WAIT_S = 1.0
# After the first failure, how long the other ranks may finish on their own before being
# interrupted. Peers of a failed rank are released at once (its group is gone), so this is short.
FAILURE_GRACE_S = 3.0
# How long interrupted ranks get to return, beyond the group timeout that may still hold them in a
# collective, before the cluster is declared stuck.
INTERRUPT_GRACE_S = 5.0

ReportHandler = Callable[[List[Dict[str, Any]]], None]


@dataclass(frozen=True)
class ClusterSpec:
    """Everything that decides what a cluster is; equal specs may share running engines."""

    n: int
    engines: str = "local"
    timeout: float = 300.0
    threads: Optional[int] = None
    start_timeout: float = 120.0
    profile_dir: Optional[str] = None
    master_addr: Optional[str] = None
    launcher_options: Dict[str, Any] = field(default_factory=dict)
    cluster_options: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineSlot:
    """One engine and the rank it plays."""

    rank: int
    engine_id: int
    host: str
    address: str
    pid: int
    cores: int
    gpus: int
    local_rank: int
    local_world_size: int

    def __str__(self) -> str:
        return f"rank {self.rank} (engine {self.engine_id}, pid {self.pid} on {self.host})"


def place_ranks(engine_ids: Sequence[int], facts: Sequence[Dict[str, Any]]) -> List[EngineSlot]:
    """Give engine ``engine_ids[r]`` rank ``r``; local ranks count the engines of each host in order."""
    per_host: Dict[str, int] = {}
    for f in facts:
        per_host[f["host"]] = per_host.get(f["host"], 0) + 1
    seen: Dict[str, int] = {}
    slots = []
    for rank, (eid, f) in enumerate(zip(engine_ids, facts)):
        local_rank = seen[f["host"]] = seen.get(f["host"], -1) + 1
        slots.append(EngineSlot(rank, eid, f["host"], f["address"], f["pid"], f["cores"], f["gpus"],
                                local_rank, per_host[f["host"]]))
    return slots


class _Session:
    """The running part of a cluster: controller, engines, client and the state of the group."""

    def __init__(self, ipp_cluster: ipyparallel.Cluster, profile_dir: str, owns_profile_dir: bool):
        self.ipp_cluster = ipp_cluster
        self.profile_dir = profile_dir
        self.owns_profile_dir = owns_profile_dir
        self.client: Optional[ipyparallel.Client] = None
        self.view: Optional[ipyparallel.DirectView] = None
        self.slots: List[EngineSlot] = []
        # Set after a failed call: rebuild the group before the next one.
        self.group_dirty = False
        # Set when the engines cannot go on (one died, or one would not stop); says why.
        self.broken: Optional[str] = None

    @property
    def single_host(self) -> bool:
        here = socket.gethostname()
        return all(s.host == here for s in self.slots)

    def dead(self, slots: Sequence[EngineSlot]) -> List[EngineSlot]:
        """The engines among ``slots`` whose process is gone."""
        here = socket.gethostname()
        registered = set(self.client.ids)
        return [s for s in slots
                if s.engine_id not in registered or (s.host == here and not _pid_alive(s.pid))]

    def close(self) -> None:
        """Stop engines and controller, wait until their processes are gone, remove the files."""
        if self.client is not None:
            self.client.close()
            self.client = None
        try:
            # Engines stopped by a signal exit non-zero, and ipyparallel would dump their whole log
            # into the notebook as a warning; a stop that we asked for is not worth one.
            self.ipp_cluster.log.setLevel(logging.ERROR)
            self.ipp_cluster.stop_cluster_sync()
            _reap(cluster_processes(self.ipp_cluster.cluster_id))
        finally:
            if self.owns_profile_dir:
                shutil.rmtree(self.profile_dir, ignore_errors=True)


def cluster_processes(cluster_id: str) -> List[psutil.Process]:
    """The processes of a cluster on this host: controller, engines and their helpers.

    ipyparallel hands every process it launches ``IPP_CLUSTER_ID`` in its environment.
    """
    return [process for process in psutil.process_iter(["environ"])
            if (process.info["environ"] or {}).get("IPP_CLUSTER_ID") == cluster_id]


def _reap(processes: List[psutil.Process], wait_s: float = 5.0) -> None:
    """End what outlived the launchers' stop, e.g. engine nannies that only poll for their engine."""
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=wait_s)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=wait_s)


def _pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


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
        master_addr: address of rank 0 for the rendezvous; by default ``127.0.0.1`` when every
            engine is on this host, else the address rank 0's host name resolves to.
        launcher_options: traits of the engine launcher, e.g. ``{'mpi_args': [...]}`` for MPI or
            ``{'queue': 'gpu', 'timelimit': '1:00:00'}`` for Slurm; ``environment`` is merged.
        cluster_options: traits of ``ipyparallel.Cluster``, e.g. ``{'controller_ip': '*'}``.
        start: start at once (the default); otherwise call ``start()`` or use ``with``.
    """

    def __init__(self, n: int, engines: str = "local", timeout: float = 300.0, *, name: str = "default",
                 threads: Optional[int] = None, start_timeout: float = 120.0,
                 profile_dir: Optional[str] = None, master_addr: Optional[str] = None,
                 launcher_options: Optional[Dict[str, Any]] = None,
                 cluster_options: Optional[Dict[str, Any]] = None, start: bool = True):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"Cluster(n={n!r}) is invalid: n is the number of engines (ranks), a positive integer.")
        if timeout <= 0:
            raise ValueError(f"Cluster(timeout={timeout!r}) is invalid: give the collective timeout in seconds (> 0).")
        self.name = name
        self.spec = ClusterSpec(n, engines, float(timeout), threads, float(start_timeout), profile_dir,
                                master_addr, dict(launcher_options or {}), dict(cluster_options or {}))
        self._session: Optional[_Session] = None
        if start:
            self.start()

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._session is not None

    def start(self) -> "Cluster":
        """Start the engines and the group, or take over those of an equal running cluster."""
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
            self._session = self._start_session()
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
        self.stop()
        return self.start()

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
        return self._running().ipp_cluster.cluster_id

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
        session = self._ready()
        payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs or {})))
        pending = [session.client[s.engine_id].apply_async(engine.call, payload) for s in session.slots]
        return self._gather(session, pending, on_report)

    # -- starting ---------------------------------------------------------------------------------
    def _start_session(self) -> _Session:
        spec = self.spec
        owns_profile_dir = spec.profile_dir is None
        profile_dir = spec.profile_dir or tempfile.mkdtemp(prefix=f"nbscaler-{self.name}-")
        ipp_cluster = ipyparallel.Cluster(
            engines=spec.engines, n=spec.n, profile_dir=profile_dir,
            cluster_id=f"nbscaler-{self.name}-{uuid.uuid4().hex[:8]}", log_level=logging.WARNING,
            shutdown_atexit=False, **spec.cluster_options)
        session = _Session(ipp_cluster, profile_dir, owns_profile_dir)
        try:
            self._launch(session)
            engine_ids = self._wait_for_engines(session)
            session.view = session.client.direct_view(engine_ids)
            session.view.block = True
            session.view.use_cloudpickle()
            facts = self._apply_each(session, engine_ids, engine.describe, [()] * spec.n)
            session.slots = place_ranks(engine_ids, facts)
            self._join_group(session)
            _activate_magics(session.view)
        except BaseException:
            session.close()
            raise
        return session

    def _launch(self, session: _Session) -> None:
        spec = self.spec
        session.ipp_cluster.start_controller_sync()
        options = launcher_options(spec.engines, spec.n, session.profile_dir, spec.launcher_options)
        session.ipp_cluster.start_engines_sync(spec.n, **options)
        session.client = session.ipp_cluster.connect_client_sync()

    def _wait_for_engines(self, session: _Session) -> List[int]:
        """Wait until ``n`` engines registered; fail at once if the launcher already gave up."""
        spec = self.spec
        deadline = time.monotonic() + spec.start_timeout
        engine_set = session.ipp_cluster.engine_set
        while len(session.client.ids) < spec.n:
            if engine_set.state == "after" or engine_set.stop_data:
                raise ClusterError(
                    f"the {spec.engines!r} engine launcher stopped before {spec.n} engines registered. "
                    f"Its output:\n{engine_set.get_output() or '(none)'}\n"
                    "Fix the launch (see the output above) and create the Cluster again.")
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"only {len(session.client.ids)} of {spec.n} engines registered within "
                    f"start_timeout={spec.start_timeout:.0f}s; raise start_timeout if they are queued "
                    f"(Slurm), or look at the engine logs in {session.profile_dir}/log.")
            time.sleep(POLL_S)
        return sorted(session.client.ids)[: spec.n]

    def _join_group(self, session: _Session) -> None:
        """(Re)build the process group: a fresh rendezvous on rank 0, every engine joins it."""
        spec = self.spec
        slots = session.slots
        if spec.master_addr:
            master = spec.master_addr
        elif session.single_host:
            master = "127.0.0.1"
        else:
            master = slots[0].address
        port = self._apply_each(session, [slots[0].engine_id], free_port, [()])[0]
        infos = [(RankInfo(s.rank, spec.n, s.local_rank, s.local_world_size, f"tcp://{master}:{port}",
                           spec.timeout, spec.threads or threads_per_engine(s.cores, s.local_world_size)),)
                 for s in slots]
        self._apply_each(session, [s.engine_id for s in slots], engine.join_group, infos)
        session.group_dirty = False

    def _apply_each(self, session: _Session, engine_ids: Sequence[int], fn: Callable[..., Any],
                    args: Sequence[tuple]) -> List[Any]:
        """Run cluster housekeeping ``fn(*args[i])`` on engine ``engine_ids[i]``, all at once."""
        results = [session.client[eid].apply_async(fn, *a) for eid, a in zip(engine_ids, args)]
        values = []
        for eid, result in zip(engine_ids, results):
            try:
                values.append(result.get(timeout=self.spec.timeout + self.spec.start_timeout))
            except RemoteError as err:
                hint = ""
                if err.ename == "ModuleNotFoundError" and "nbscaler" in str(err.evalue):
                    hint = ("The engines cannot import nbscaler: install it where they run, or export "
                            "PYTHONPATH with its folder before creating the Cluster.\n")
                raise ClusterError(f"engine {eid} failed in {fn.__name__}: {err.ename}: {err.evalue}\n{hint}"
                                   + "\n".join(err.render_traceback())) from None
        return values

    # -- calls ------------------------------------------------------------------------------------
    def _running(self) -> _Session:
        if self._session is None:
            raise ClusterError(
                f"Cluster(name={self.name!r}) is not running: it was stopped, or a newer Cluster with "
                "the same name took over its engines. Call start() (or restart()), or use the newer one.")
        return self._session

    def _ready(self) -> _Session:
        session = self._running()
        if session.broken:
            raise ClusterError(f"{session.broken}; call restart() for fresh engines and a new process group.")
        if session.group_dirty:
            self._join_group(session)
        return session

    def _healthy(self) -> bool:
        session = self._session
        return session is not None and not session.broken and not session.dead(session.slots)

    def _gather(self, session: _Session, pending: List[ipyparallel.AsyncResult],
                on_report: Optional[ReportHandler]) -> List[Any]:
        """Wait for every rank; after the first failure, interrupt those still running."""
        outcomes: Dict[int, Outcome] = {}
        dead: List[EngineSlot] = []
        give_up_at: Optional[float] = None
        waiting = list(session.slots)
        try:
            while waiting:
                session.client.wait([pending[s.rank] for s in waiting], timeout=POLL_S)
                for s in waiting:
                    if pending[s.rank].ready():
                        outcome = _outcome_of(s, pending[s.rank])
                        if outcome is None:
                            dead.append(s)
                        else:
                            outcomes[s.rank] = outcome
                dead += [s for s in session.dead(waiting) if s.rank not in outcomes and s not in dead]
                waiting = [s for s in waiting if s.rank not in outcomes and s not in dead]
                failed = dead or any(not o.ok for o in outcomes.values())
                if on_report is not None:
                    if not waiting and not failed:  # reports travel apart from results: let them land
                        for result in pending:
                            result.wait_for_output(OUTPUT_WAIT_S)
                    on_report([result.data for result in pending])
                if failed and give_up_at is None:
                    give_up_at = time.monotonic() + min(self.spec.timeout, FAILURE_GRACE_S)
                if waiting and give_up_at is not None and time.monotonic() > give_up_at:
                    outcomes.update(self._interrupt(session, waiting, pending))
                    break
        except KeyboardInterrupt:
            self._interrupt(session, waiting, pending)
            raise
        return _values_or_raise(session, outcomes, dead)

    def _interrupt(self, session: _Session, ranks: List[EngineSlot],
                   pending: List[ipyparallel.AsyncResult]) -> Dict[int, Outcome]:
        """SIGINT ``ranks`` and collect what they return; the cluster is broken if one will not stop."""
        session.group_dirty = True
        if not ranks:
            return {}
        session.client.send_signal(signal.SIGINT, targets=[s.engine_id for s in ranks], block=False)
        session.client.wait([pending[s.rank] for s in ranks], timeout=self.spec.timeout + INTERRUPT_GRACE_S)
        outcomes = {s.rank: _outcome_of(s, pending[s.rank]) for s in ranks if pending[s.rank].ready()}
        stuck = [str(s) for s in ranks if outcomes.get(s.rank) is None]
        if stuck:
            session.broken = f"{', '.join(stuck)} did not stop when interrupted"
        return {r: o for r, o in outcomes.items() if o is not None}


def _outcome_of(slot: EngineSlot, result: ipyparallel.AsyncResult) -> Optional[Outcome]:
    """The Outcome of a finished rank, or None when its engine died under it."""
    try:
        return result.get()
    except EngineError:
        return None
    except RemoteError as err:
        if err.ename == EngineError.__name__:  # the controller saw the engine go, and says so remotely
            return None
        # Failed before engine.call could catch it, e.g. nbscaler is not importable there.
        return Outcome(slot.rank, False, error=f"{err.ename}: {err.evalue}", traceback=err.traceback or "",
                       failed_at=time.time())


def _values_or_raise(session: _Session, outcomes: Dict[int, Outcome], dead: List[EngineSlot]) -> List[Any]:
    failures = {r: o.error for r, o in sorted(outcomes.items()) if not o.ok}
    if dead:
        first = min(dead, key=lambda s: s.rank)
        session.broken = f"{', '.join(map(str, dead))} died"
        raise RankDied(first.rank,
                       f"{first} died during the call: its process exited (killed, crashed or out of memory). "
                       f"{_consequences(failures)}Call restart() for fresh engines and a new process group.",
                       "", {**failures, **{s.rank: "engine process died" for s in dead}})
    if failures:
        session.group_dirty = True
        first = min((o for o in outcomes.values() if not o.ok), key=lambda o: o.failed_at)
        others = {r: e for r, e in failures.items() if r != first.rank}
        raise RankError(first.rank,
                        f"rank {first.rank} raised {first.error}\n{_consequences(others)}"
                        f"--- traceback on rank {first.rank} ---\n{first.traceback}",
                        first.traceback, failures)
    return [outcomes[r].value for r in range(len(session.slots))]


def _consequences(failures: Dict[int, str]) -> str:
    if not failures:
        return ""
    lines = "".join(f"  rank {r}: {e.splitlines()[0] if e else ''}\n" for r, e in failures.items())
    return f"Other ranks failed after it (most only lost their peer in a collective):\n{lines}"


def _activate_magics(view: ipyparallel.DirectView) -> None:
    """Point ``%px``/``%%px`` at this cluster when running under IPython (a notebook, a console)."""
    from IPython import get_ipython

    if get_ipython() is not None:
        view.activate()
