"""A running cluster's processes: controller, engines in rank order, their process group, their end.

A session is made, then started, in five steps:

1. making it starts what watches it (``watchdog``) and, for local engines, the fork server that
   imports torch and nbscaler while the rest starts (``forkserver``);
2. ``start`` launches the controller, listening on one address (``network.controller_ip``), and
   the engines with ipyparallel's launchers;
3. waits for ``n`` engines and puts them in rank order, host by host, engine ids in order within a
   host; on one host, and under ``mpiexec``, rank ``r`` is the ``r``-th engine id (``place_ranks``);
4. forms the process group (gloo on CPU, nccl with one GPU per local rank) at a rendezvous store
   that rank 0 opens on the rendezvous address alone and a port the system picks, each engine on
   its own address and interface (``network``) (``join_group``);
5. points ``%px``/``%%px`` at the engines, when IPython runs.

``Session.close`` ends every process of the cluster and waits until they are gone. What a call
does with the engines, and how it fails, is in ``calls``.
"""

from __future__ import annotations

import logging
import shutil
import socket
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import ipyparallel
import psutil
from ipyparallel.error import RemoteError

from nbscaler.cluster import engine, forkserver, jobs, network, watchdog
from nbscaler.cluster.engine import RankInfo
from nbscaler.cluster.errors import ClusterError
from nbscaler.cluster.launchers import launcher_options
from nbscaler.config import threads_per_rank

POLL_S = 0.05
# The controller's heartbeat period. Ten missed beats unregister an engine on another host.
HEARTBEAT_MS = 1000


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
    network: Optional[str] = None
    launcher_options: Dict[str, Any] = field(default_factory=dict)
    cluster_options: Dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineSlot:
    """One engine and the rank it plays."""

    rank: int
    engine_id: int
    host: str
    address: str
    interface: str
    pid: int
    cores: int
    gpus: int
    local_rank: int
    local_world_size: int

    def __str__(self) -> str:
        return f"rank {self.rank} (engine {self.engine_id}, pid {self.pid} on {self.host})"


def place_ranks(engine_ids: Sequence[int], facts: Sequence[Dict[str, Any]]) -> List[EngineSlot]:
    """Rank the engines host by host: each host's engines get consecutive ranks, in engine id order.

    Hosts come in the order of their first engine id, so on one host (and under ``mpiexec``, whose
    ranks fill one host before the next) rank ``r`` is the ``r``-th engine id. Keeping a host's
    ranks together is what places a unit of ``plan_ngpus`` ranks on one host whenever
    ``plan_ngpus`` divides the engines per host, whatever order the engines registered in.
    Local ranks count the engines of each host.
    """
    order = sorted(range(len(engine_ids)), key=lambda i: engine_ids[i])
    hosts = list(dict.fromkeys(facts[i]["host"] for i in order))
    order.sort(key=lambda i: (hosts.index(facts[i]["host"]), engine_ids[i]))
    per_host = {h: sum(f["host"] == h for f in facts) for h in hosts}
    seen: Dict[str, int] = {}
    slots = []
    for rank, i in enumerate(order):
        f = facts[i]
        local_rank = seen[f["host"]] = seen.get(f["host"], -1) + 1
        slots.append(EngineSlot(rank, engine_ids[i], f["host"], f["address"], f["interface"], f["pid"], f["cores"],
                                f["gpus"], local_rank, per_host[f["host"]]))
    return slots


class Session:
    """The running part of a cluster: controller, engines, client and the state of the group."""

    def __init__(self, spec: ClusterSpec, name: str):
        """Get ready to start: the watchdog and, for local engines, the fork server, which starts
        importing at once (``start`` launches the rest)."""
        self.spec = spec
        self.owns_profile_dir = spec.profile_dir is None
        self.profile_dir = spec.profile_dir or tempfile.mkdtemp(prefix=f"nbscaler-{name}-")
        self.cluster_id = f"nbscaler-{name}-{uuid.uuid4().hex[:8]}"
        self.watchdog = watchdog.start(self.cluster_id, self.profile_dir if self.owns_profile_dir else None)
        self.launcher_options = launcher_options(spec.engines, spec.n, self.profile_dir, spec.launcher_options)
        self.engine_launcher: Any = spec.engines
        if spec.engines == "local" and forkserver.CAN_FORK:
            log_file = f"{self.profile_dir}/log/ipengine-{self.cluster_id}-forked.log"
            forkserver.start(self.cluster_id, self.launcher_options["environment"], log_file)
            self.engine_launcher = forkserver.ForkedEngineSetLauncher
        self.ipp_cluster: Optional[ipyparallel.Cluster] = None
        self.client: Optional[ipyparallel.Client] = None
        self.view: Optional[ipyparallel.DirectView] = None
        self.slots: List[EngineSlot] = []
        # Set after a failed call: rebuild the group before the next one.
        self.group_dirty = False
        # Set when the engines cannot go on (one died, or one would not stop); says why.
        self.broken: Optional[str] = None

    def start(self) -> "Session":
        """Start controller, engines and process group; on any failure nothing is left running."""
        try:
            self._launch()
            engine_ids = self._wait_for_engines()
            self.view = self.client.direct_view(engine_ids)
            self.view.block = True
            self.view.use_cloudpickle()
            facts = self.apply_each(engine_ids, engine.describe, [(self.spec.network,)] * self.spec.n)
            self.slots = place_ranks(engine_ids, facts)
            self.join_group()
            _activate_magics(self.view)
        except BaseException:
            self.close()
            raise
        return self

    @property
    def job_id(self) -> Optional[str]:
        """The batch job the engines run in (Slurm and other batch launchers), else None."""
        return jobs.job_id(self.ipp_cluster.engine_set) if self.ipp_cluster is not None else None

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

    def how_gone(self, slot: EngineSlot) -> str:
        """How an engine that left a call is gone: ``'exited'``, ``'stopped'`` (``SIGSTOP``: alive,
        but neither computing nor answering), or ``'unregistered'`` (the controller lost its
        heartbeat: another host, or a network, that is down)."""
        if slot.host == socket.gethostname():
            try:
                status = psutil.Process(slot.pid).status()
            except psutil.NoSuchProcess:
                return "exited"
            if status == psutil.STATUS_STOPPED:
                return "stopped"
            if status == psutil.STATUS_ZOMBIE:
                return "exited"
        return "unregistered"

    def join_group(self) -> None:
        """(Re)build the process group: rank 0 opens a fresh rendezvous store, every engine joins it."""
        spec, slots = self.spec, self.slots
        # Rank 0's own endpoint (see ``network``): loopback when the controller is on this host,
        # the address that reaches the controller (or the chosen network) when it is elsewhere.
        master = spec.master_addr or slots[0].address
        port = self.apply_each([slots[0].engine_id], engine.open_rendezvous, [(spec.n, spec.timeout, master)])[0]
        infos = [(RankInfo(s.rank, spec.n, s.local_rank, s.local_world_size, master, port, spec.timeout,
                           spec.threads or threads_per_rank(s.cores, s.local_world_size), s.interface),)
                 for s in slots]
        self.apply_each([s.engine_id for s in slots], engine.join_group, infos)
        self.group_dirty = False

    def apply_each(self, engine_ids: Sequence[int], fn: Callable[..., Any], args: Sequence[tuple]) -> List[Any]:
        """Run cluster housekeeping ``fn(*args[i])`` on engine ``engine_ids[i]``, all at once."""
        results = [self.client[eid].apply_async(fn, *a) for eid, a in zip(engine_ids, args)]
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

    def close(self) -> None:
        """Stop engines and controller, wait until their processes are gone, remove the files."""
        if self.client is not None:
            self.client.close()
            self.client = None
        try:
            forkserver.discard(self.cluster_id)
            if self.ipp_cluster is not None:
                # Engines stopped by a signal exit non-zero, and ipyparallel would dump their whole
                # log into the notebook as a warning; a stop that we asked for is not worth one.
                self.ipp_cluster.log.setLevel(logging.ERROR)
                self.ipp_cluster.stop_cluster_sync()
            watchdog.reap(watchdog.cluster_processes(self.cluster_id))
        finally:
            if self.owns_profile_dir:
                shutil.rmtree(self.profile_dir, ignore_errors=True)
            watchdog.dismiss(self.watchdog)

    # -- starting ---------------------------------------------------------------------------------
    def _launch(self) -> None:
        spec = self.spec
        options = dict(spec.cluster_options)
        options["controller_ip"] = network.controller_ip(spec.engines, spec.network, options.get("controller_ip"))
        # An engine counts as registered once the controller has seen its heart beat; a shorter
        # period than ipyparallel's 3 s lets the engines register sooner (user options still win).
        options["controller_args"] = [f"--HeartMonitor.period={HEARTBEAT_MS}", *options.get("controller_args", [])]
        self.ipp_cluster = ipyparallel.Cluster(
            engines=self.engine_launcher, n=spec.n, profile_dir=self.profile_dir, cluster_id=self.cluster_id,
            log_level=logging.WARNING, shutdown_atexit=False, **options)
        self.ipp_cluster.start_controller_sync()
        self.ipp_cluster.start_engines_sync(spec.n, **self.launcher_options)
        if self.job_id is not None:
            watchdog.watch_job(self.watchdog, [*self.ipp_cluster.engine_set.delete_command, self.job_id])
        self.client = self.ipp_cluster.connect_client_sync()

    def _wait_for_engines(self) -> List[int]:
        """Wait until ``n`` engines registered; fail at once if the launcher already gave up."""
        spec = self.spec
        deadline = time.monotonic() + spec.start_timeout
        engine_set = self.ipp_cluster.engine_set
        while len(self.client.ids) < spec.n:
            if engine_set.state == "after" or engine_set.stop_data:
                raise ClusterError(
                    f"the {spec.engines!r} engine launcher stopped before {spec.n} engines registered. "
                    f"Its output:\n{engine_set.get_output() or '(none)'}\n"
                    "Fix the launch (see the output above) and create the Cluster again.")
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"only {len(self.client.ids)} of {spec.n} engines registered within "
                    f"start_timeout={spec.start_timeout:.0f}s; raise start_timeout if they are queued "
                    f"(Slurm), or look at the engine logs in {self.profile_dir}/log.")
            time.sleep(POLL_S)
        return sorted(self.client.ids)[: spec.n]


def _pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _activate_magics(view: ipyparallel.DirectView) -> None:
    """Point ``%px``/``%%px`` at this cluster when running under IPython (a notebook, a console)."""
    from IPython import get_ipython

    if get_ipython() is not None:
        view.activate()
