"""A one-node Slurm on this host, for the tests: munged, slurmctld and slurmd, started and stopped here.

Everything lives in one temporary folder (the munge key and socket, ``slurm.conf``, state, spool,
logs), nothing is installed as a service, and nothing needs systemd or cgroups:

- ``munged`` runs on a socket of its own with a key made for this run; ``AuthInfo=socket=...`` points
  Slurm at it;
- the node is this host under its own name at ``127.0.0.1``, with ``NODE_CPUS`` CPUs whatever the
  machine has (``SlurmdParameters=config_overrides``), so that a job of four one-CPU engine tasks
  fits a two-core machine;
- processes are tracked by ``proctrack/linuxproc`` and tasks are not bound (``task/none``);
- the daemons run in the foreground (``-D``) as children of the test process, and ``stop`` ends them.

Clients (``sbatch``, ``squeue``, ``scancel``) find the cluster through ``SLURM_CONF``; ``environment()``
gives it, and a job inherits it from ``sbatch`` like the rest of the environment.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo")
NODE_CPUS = 8
PARTITION = "nbscaler"
START_TIMEOUT_S = 60.0
POLL_S = 0.2
# The controller and node ports are fixed in slurm.conf; a pair that is taken is skipped for the next.
FIRST_PORT = 16817
PORT_TRIES = 8

SLURM_CONF = """\
ClusterName=nbscaler
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
KillWait=5
MinJobAge=600
InactiveLimit=0
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName={partition} Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here (not installed, not root, or a daemon would not start); says why."""


@dataclass
class SlurmHost:
    """A running one-node Slurm: its folder, its configuration and its daemons."""

    root: Path
    version: str
    real = True
    partition: str = PARTITION
    daemons: List[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def environment(self) -> Dict[str, str]:
        """What a client process needs to reach this Slurm."""
        return {"SLURM_CONF": str(self.conf)}

    def command(self, *args: str, check: bool = True) -> str:
        """Run a Slurm client command against this cluster; returns its output."""
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=30,
                              env={**os.environ, **self.environment()})
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr or done.stdout}")
        return done.stdout

    def queued_jobs(self) -> List[str]:
        """Ids of the jobs ``squeue`` lists (pending, running or completing)."""
        return self.command("squeue", "-h", "-o", "%i").split()

    def job_state(self, job_id: str) -> str:
        """The job's state as the controller knows it (``RUNNING``, ``CANCELLED``, ...)."""
        return self.command("squeue", "-h", "--states=all", "-j", job_id, "-o", "%T").strip()

    def log(self, daemon: str) -> str:
        path = self.root / f"{daemon}.log"
        return path.read_text(errors="replace") if path.exists() else ""


def missing_reason() -> Optional[str]:
    """Why Slurm cannot be started here, or None when it can be tried."""
    absent = [d for d in DAEMONS if shutil.which(d) is None]
    if absent:
        return f"{', '.join(absent)} not found (apt-get install slurmctld slurmd slurm-client munge)"
    if os.geteuid() != 0:
        return "the Slurm daemons need root"
    return None


def start() -> SlurmHost:
    """Start munged, slurmctld and slurmd in a fresh folder; returns once the node is idle.

    Raises ``SlurmUnavailable`` (with the daemons' logs) when they do not come up; nothing is left
    running then.
    """
    reason = missing_reason()
    if reason:
        raise SlurmUnavailable(reason)
    version = subprocess.run(["slurmctld", "-V"], capture_output=True, text=True).stdout.strip()
    host = SlurmHost(Path(tempfile.mkdtemp(prefix="nbscaler-slurm-")), version)
    try:
        _start_munge(host)
        for attempt in range(PORT_TRIES):
            ctld_port = FIRST_PORT + 2 * attempt
            if _start_slurm(host, ctld_port, ctld_port + 1):
                return host
        raise SlurmUnavailable(f"no free port pair from {FIRST_PORT} on for slurmctld and slurmd")
    except BaseException:
        stop(host)
        raise


def stop(host: SlurmHost) -> None:
    """End the daemons (newest first), wait for them, and remove the folder."""
    for daemon in reversed(host.daemons):
        _end(daemon)
    host.daemons.clear()
    shutil.rmtree(host.root, ignore_errors=True)


def _start_munge(host: SlurmHost) -> None:
    key = host.root / "munge.key"
    subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
    key.chmod(0o400)
    socket_path = host.root / "munge.socket"
    host.daemons.append(subprocess.Popen(
        ["munged", "--foreground", "--force", f"--socket={socket_path}", f"--key-file={key}",
         f"--log-file={host.root}/munged.log", f"--pid-file={host.root}/munged.pid",
         f"--seed-file={host.root}/munged.seed"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True))
    _wait_until(lambda: socket_path.exists(), host, "munged", "its socket")


def _start_slurm(host: SlurmHost, ctld_port: int, slurmd_port: int) -> bool:
    """Write slurm.conf for these ports and start both daemons; False if a port was taken."""
    for folder in ("state", "spool"):
        (host.root / folder).mkdir(exist_ok=True)
    host.conf.write_text(SLURM_CONF.format(host=socket.gethostname().split(".")[0], root=host.root,
                                           ctld_port=ctld_port, slurmd_port=slurmd_port, cpus=NODE_CPUS,
                                           partition=PARTITION))
    env = {**os.environ, **host.environment()}
    for daemon in ("slurmctld", "slurmd"):
        (host.root / f"{daemon}.log").unlink(missing_ok=True)
        args = [daemon, "-D", "-f", str(host.conf)] + (["-i"] if daemon == "slurmctld" else [])
        host.daemons.append(subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                             start_new_session=True))
    try:
        _wait_until(lambda: _node_state(host) == "idle", host, "slurmd", "an idle node in sinfo")
    except SlurmUnavailable:
        taken = any("Address already in use" in host.log(d) for d in ("slurmctld", "slurmd"))
        if not taken:
            raise
        for daemon in host.daemons[-2:]:
            _end(daemon)
        del host.daemons[-2:]
        return False
    return True


def _node_state(host: SlurmHost) -> str:
    for daemon in host.daemons:
        if daemon.poll() is not None:
            raise SlurmUnavailable(f"{daemon.args[0]} exited with code {daemon.returncode}")
    try:
        done = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=10,
                              env={**os.environ, **host.environment()})
    except subprocess.TimeoutExpired:  # something else answers on the port; the daemon's exit says so
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _wait_until(ready, host: SlurmHost, daemon: str, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            if ready():
                return
            failure = None
        except SlurmUnavailable as err:
            failure = str(err)
        if failure or time.monotonic() > deadline:
            logs = "\n".join(f"--- {d}.log ---\n{host.log(d)[-3000:]}" for d in ("munged", "slurmctld", "slurmd"))
            raise SlurmUnavailable(f"{failure or f'no {what} within {START_TIMEOUT_S:.0f}s'}\n{logs}")
        time.sleep(POLL_S)


def _end(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
