"""``init_distributed``: one call at the top of a training script that finds out how it was started
(torchrun, Open MPI's ``mpirun``, Slurm's ``srun``, or nothing), joins the process group, and says
where this process stands.

    world = nbscaler.init_distributed()        # rank 1 of `mpirun -n 4 python train.py`, no GPU:
    world.rank, world.world_size, world.device, world.distributed    # 1, 4, device('cpu'), True

What each launcher says, read by ``read_launch_env`` (the first launcher found, in this order):

- torchrun: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
  ``MASTER_PORT``;
- Open MPI: ``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``, ``_LOCAL_SIZE``;
- Slurm: ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``, the tasks of this node
  (``SLURM_STEP_TASKS_PER_NODE`` or ``SLURM_TASKS_PER_NODE`` at ``SLURM_NODEID``).

Where rank 0 listens: ``MASTER_ADDR`` and ``MASTER_PORT`` when set, under any launcher. Otherwise,
under Slurm the first host of ``SLURM_JOB_NODELIST``, and under Open MPI ``localhost`` (on one
host; a run over several hosts must pass ``-x MASTER_ADDR=<rank 0's host>``). The port otherwise
is derived from the job, the same on every rank (``derived_port``): Open MPI's job id, or Slurm's
job and step ids. Two jobs may derive the same port; set ``MASTER_PORT`` to choose one.

The backend and device come from ``nbscaler.runtime.backend`` (nccl with a GPU per local rank,
else gloo on the CPU; ``NBSCALER_BACKEND`` chooses).
"""

from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from typing import Mapping, Optional

import torch
import torch.distributed as dist

from nbscaler.columns import StrEnum
from nbscaler.runtime.backend import host_backend
from nbscaler.runtime.hostlist import expand_hostlist, expand_tasks_per_node
from nbscaler.runtime.launch import init_process_group

#: Ports ``derived_port`` picks from: above the well-known and registered ranges most services use,
#: below Linux's default ephemeral range (32768 and up), so no outgoing connection holds one.
PORT_BASE, PORT_SPAN = 20000, 12000


class Launcher(StrEnum):
    """What started this process."""

    TORCHRUN = "torchrun"
    OPEN_MPI = "mpirun"
    SLURM = "srun"
    NONE = "none"


@dataclass(frozen=True)
class LaunchEnv:
    """Where this process stands, as its launcher's environment says."""

    launcher: Launcher
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


@dataclass(frozen=True)
class DistributedInfo:
    """What ``init_distributed`` found and did. ``backend`` is None for a single process (no group)."""

    launcher: Launcher
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: Optional[str]

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def derived_port(job: str) -> int:
    """A port every rank of job ``job`` derives alike, in ``[PORT_BASE, PORT_BASE + PORT_SPAN)``.

    >>> derived_port("4242.0") == derived_port("4242.0") != derived_port("4243.0")
    True
    """
    return PORT_BASE + zlib.crc32(job.encode()) % PORT_SPAN


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except KeyError:
        raise ValueError(f"the launcher set no {name}: start the script with torchrun, mpirun or srun, "
                         "or with none of them for one process") from None
    except ValueError:
        raise ValueError(f"{name}={env[name]!r} is not an integer") from None


def _port(env: Mapping[str, str], job: str) -> int:
    return _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else derived_port(job)


def _torchrun(env: Mapping[str, str]) -> LaunchEnv:
    world = _int(env, "WORLD_SIZE")
    return LaunchEnv(Launcher.TORCHRUN, _int(env, "RANK"), world, int(env.get("LOCAL_RANK", 0)),
                     int(env.get("LOCAL_WORLD_SIZE", world)), env.get("MASTER_ADDR", "localhost"),
                     _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else 29500)


def _open_mpi(env: Mapping[str, str]) -> LaunchEnv:
    world, local_world = _int(env, "OMPI_COMM_WORLD_SIZE"), _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
    addr = env.get("MASTER_ADDR")
    if not addr and local_world < world:
        raise ValueError(f"this mpirun spans several hosts ({local_world} of {world} ranks on this one), so the "
                         "ranks cannot guess where rank 0 listens: pass -x MASTER_ADDR=<rank 0's host> to mpirun")
    job = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE") or ""
    return LaunchEnv(Launcher.OPEN_MPI, _int(env, "OMPI_COMM_WORLD_RANK"), world,
                     _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"), local_world, addr or "localhost", _port(env, job))


def _slurm(env: Mapping[str, str]) -> LaunchEnv:
    world = _int(env, "SLURM_NTASKS")
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    local_world = expand_tasks_per_node(per_node)[int(env.get("SLURM_NODEID", 0))] if per_node else world
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    addr = env.get("MASTER_ADDR") or (expand_hostlist(nodes)[0] if nodes else "localhost")
    job = f"{env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', '')}"
    return LaunchEnv(Launcher.SLURM, _int(env, "SLURM_PROCID"), world, _int(env, "SLURM_LOCALID"), local_world,
                     addr, _port(env, job))


def read_launch_env(env: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """Where this process stands, from ``env`` (``os.environ`` by default); see the module docstring.

    torchrun comes first, as it may itself run under Slurm or Open MPI; Slurm's variables count only
    inside a job step (``srun``), not in the batch script that starts one.
    """
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        return _torchrun(env)
    if "OMPI_COMM_WORLD_RANK" in env:
        return _open_mpi(env)
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env and "SLURM_NTASKS" in env:
        return _slurm(env)
    return LaunchEnv(Launcher.NONE, 0, 1, 0, 1, "localhost", 0)


_INFO: Optional[DistributedInfo] = None


def init_distributed(backend: Optional[str] = None, timeout_s: float = 600.0) -> DistributedInfo:
    """Join the process group of the ranks the launcher started, and say where this one stands.

    Reads the launcher's environment (``read_launch_env``), chooses the backend and device
    (``nbscaler.runtime.backend``; ``backend`` or ``NBSCALER_BACKEND`` overrides it), sets
    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` as torchrun would (the rest of nbscaler, and torch, read them), and initialises
    the default process group; ``timeout_s`` bounds its collectives. With no launcher (or one
    process) it creates no group: ``distributed`` is False. Called again, it returns the same object.
    """
    global _INFO
    if _INFO is not None:
        return _INFO
    launch = read_launch_env()
    choice = host_backend(launch.local_world_size, backend)
    if launch.world_size > 1 and not dist.is_initialized():
        os.environ.update(RANK=str(launch.rank), WORLD_SIZE=str(launch.world_size),
                          LOCAL_RANK=str(launch.local_rank), LOCAL_WORLD_SIZE=str(launch.local_world_size),
                          MASTER_ADDR=launch.master_addr, MASTER_PORT=str(launch.master_port))
        # env://, not a tcp:// URL: under torchrun rank 0 must use the store torchrun's agent already runs.
        init_process_group(launch.rank, launch.world_size, "env://", timeout_s, launch.local_rank,
                           local_world_size=launch.local_world_size, backend=backend)
    elif choice.on_gpu:
        torch.cuda.set_device(choice.device(launch.local_rank))
    group_backend = dist.get_backend() if dist.is_initialized() else None
    _INFO = DistributedInfo(launch.launcher, launch.rank, launch.local_rank, launch.world_size,
                            launch.local_world_size, choice.device(launch.local_rank), group_backend)
    return _INFO
