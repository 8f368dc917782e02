"""Which backend and device a rank uses: the one rule that the launcher, the cluster's engines and
``nbscaler.init_distributed`` all ask.

nccl needs a GPU of its own for each rank of a host: it refuses two ranks of one group on the same
GPU. So the rule is

- a GPU for every rank of the host: nccl, local rank ``r`` on ``cuda:r``;
- no GPU: gloo on the CPU;
- some GPUs but fewer than the host's ranks (a laptop or a free notebook service with one GPU, and
  a 4-rank demo): gloo on the CPU, said in one line (``BackendChoice.note``), since the ranks run
  slower than they could.

``NBSCALER_BACKEND=nccl`` or ``=gloo`` (or a ``backend`` argument) chooses instead. nccl asked for
runs local rank ``r`` on ``cuda:(r % GPUs)``: right where the launcher binds a GPU to each rank, so
that each sees one (Slurm's ``--gpus-per-task=1``), which no process can tell from one shared GPU.
nccl without any GPU is refused with what to do.

>>> choose_backend(device_count=1, local_world_size=4).backend
<Backend.GLOO: 'gloo'>
>>> choose_backend(device_count=4, local_world_size=4).device(local_rank=3)
device(type='cuda', index=3)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch

from nbscaler.layouts import Backend

#: The environment variable that chooses the backend, overriding the rule.
BACKEND_ENV = "NBSCALER_BACKEND"


@dataclass(frozen=True)
class BackendChoice:
    """A backend, the GPUs its ranks share out (0: they compute on the CPU), and the line to show
    the user ('' for none)."""

    backend: Backend
    gpus: int
    note: str = ""

    @property
    def on_gpu(self) -> bool:
        return self.gpus > 0

    def device(self, local_rank: int) -> torch.device:
        """The device of the rank that is ``local_rank`` on its host."""
        return torch.device("cuda", local_rank % self.gpus) if self.on_gpu else torch.device("cpu")


def choose_backend(device_count: int, local_world_size: int, requested: Optional[str] = None) -> BackendChoice:
    """The backend for ``local_world_size`` ranks on a host with ``device_count`` GPUs.

    ``requested`` ('nccl', 'gloo', or None/'' for the rule in the module docstring) is what the
    user asked for. Raises ``ValueError`` for an unknown backend, or nccl without a GPU.
    """
    if local_world_size < 1:
        raise ValueError(f"local_world_size must be at least 1, got {local_world_size}")
    enough = 0 < local_world_size <= device_count
    if requested:
        try:
            backend = Backend(requested.lower())
        except ValueError:
            raise ValueError(f"backend {requested!r} (from the argument or {BACKEND_ENV}) is not one of "
                             f"{', '.join(repr(b.value) for b in Backend)}") from None
        if backend is Backend.NCCL and device_count == 0:
            raise ValueError(f"nccl needs GPUs, and this host shows none: use gloo ({BACKEND_ENV}=gloo), or "
                             "check that CUDA and its driver are installed where the ranks run.")
        return BackendChoice(backend, device_count if backend is Backend.NCCL else 0)
    if enough:
        return BackendChoice(Backend.NCCL, device_count)
    if device_count == 0:
        return BackendChoice(Backend.GLOO, 0)
    return BackendChoice(Backend.GLOO, 0, note=(
        f"nbscaler: {local_world_size} ranks on this host share {device_count} GPU(s), and nccl needs one per "
        f"rank, so they run gloo on the CPU; start at most {device_count} ranks per host for nccl (or set "
        f"{BACKEND_ENV}=nccl if each rank has a GPU of its own), or {BACKEND_ENV}=gloo to choose gloo yourself."))


def host_backend(local_world_size: int, requested: Optional[str] = None) -> BackendChoice:
    """``choose_backend`` for this host's GPUs, with ``requested`` defaulting to ``NBSCALER_BACKEND``."""
    return choose_backend(torch.cuda.device_count(), local_world_size, requested or os.environ.get(BACKEND_ENV))
