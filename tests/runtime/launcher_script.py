"""A training script that any launcher may start (``python -m tests.runtime.launcher_script OUT GEN``):
``nbscaler.init_distributed()`` finds the ranks, the shipped Llama is split by ``tp`` over all of
them, and three SGD steps run on the same batches on every rank. Each rank writes what it learned
about itself and its losses to ``OUT/rank<r>.json``.
"""

import json
import sys
from pathlib import Path
from typing import List

import torch

import nbscaler
from nbscaler import ComputeConfig, build_optimizer, parallelize
from nbscaler.models.llama import Llama, LlamaConfig, sample_batch

STEPS = 3
LR = 0.1


def model_and_batches():
    """The model (seeded) and the batch of every step: the same on every rank and in the reference."""
    cfg = LlamaConfig()
    torch.manual_seed(0)
    return Llama(cfg), [sample_batch(cfg, batch_size=2, seed=step) for step in range(STEPS)]


def reference_losses() -> List[float]:
    """The losses of the same steps in one process."""
    model, batches = model_and_batches()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = model(**batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main(out: Path, gen_savedir: str) -> None:
    world = nbscaler.init_distributed()
    model, batches = model_and_batches()
    config = ComputeConfig(plan_ngpus=world.world_size, runtime_ngpus=world.world_size)
    pm = parallelize(model, batches[0], "tp", config, gen_savedir=gen_savedir)
    optimizer = build_optimizer(pm, torch.optim.SGD, lr=LR)
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = pm(**batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    facts = {"launcher": str(world.launcher), "rank": world.rank, "local_rank": world.local_rank,
             "world_size": world.world_size, "distributed": world.distributed, "device": str(world.device),
             "backend": world.backend, "same_again": nbscaler.init_distributed() is world, "losses": losses}
    (out / f"rank{world.rank}.json").write_text(json.dumps(facts))
    if world.distributed:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
