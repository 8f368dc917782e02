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

The rule lives in ``nbscaler.layouts`` with the ``Backend`` names, so that the cost model, which
prices the backend a plan's ranks will run, asks the very rule the runtime does; this module is
where the runtime reads it.

>>> choose_backend(device_count=1, local_world_size=4).backend
<Backend.GLOO: 'gloo'>
>>> choose_backend(device_count=4, local_world_size=4).device(local_rank=3)
device(type='cuda', index=3)
"""

from __future__ import annotations

from nbscaler.layouts import BACKEND_ENV, Backend, BackendChoice, choose_backend, host_backend

__all__ = ["BACKEND_ENV", "Backend", "BackendChoice", "choose_backend", "host_backend"]
