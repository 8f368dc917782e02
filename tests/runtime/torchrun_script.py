"""A plain training script, as a user writes one, for ``torchrun`` to start (``python -m``).

It parallelizes the shipped Llama with the policy named on the command line over the ranks torchrun
started (plan of ``plan_ngpus`` devices), trains three steps with SGD, destroys the process group
and returns: a clean run exits 0 on every rank with nothing on stderr but torchrun's own lines.

    torchrun --standalone --nproc_per_node=4 -m tests.runtime.torchrun_script dp 1 GEN_DIR [ZERO_STAGE]
"""

import sys

import torch
import torch.distributed as dist

from nbscaler import ComputeConfig, build_optimizer, parallelize
from nbscaler.models.llama import Llama, LlamaConfig, sample_batch

STEPS = 3


def main(policy: str, plan_ngpus: int, gen_savedir: str, zero_stage: int = 0) -> None:
    # Hand the GIL to other threads only when blocking, as a busy loop of Python does: a thread of
    # a group that outlived destroy_process_group then still waits for it when the interpreter exits,
    # so a clean exit is not a matter of luck.
    sys.setswitchinterval(10.0)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = LlamaConfig()
    torch.manual_seed(0)
    pm = parallelize(Llama(cfg), sample_batch(cfg, batch_size=2), policy,
                     ComputeConfig(plan_ngpus=plan_ngpus, runtime_ngpus=world, use_zero=zero_stage > 0,
                                   zero_stage=max(zero_stage, 1)), gen_savedir=gen_savedir)
    optimizer = build_optimizer(pm, torch.optim.SGD, lr=0.1)
    for step in range(STEPS):
        optimizer.zero_grad()
        pm(**sample_batch(cfg, batch_size=2, seed=step * 100 + rank // plan_ngpus)).backward()
        optimizer.step()
    print(f"rank {rank} trained {STEPS} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], *(int(a) for a in sys.argv[4:]))
