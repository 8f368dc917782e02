"""Measured against predicted pipeline bubbles for a uniform model.

A stack of identical layers is cut into ``--stages`` stages on as many CPU ranks; each scheduler
runs a few ``train_step``s and the last one's timed blocks give the measured bubble fraction, next to
the simulator's prediction from the measured mean forward and backward block times.

    python -m benchmarks.pipeline_bubble --stages 4 --micros 8
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn

from nbscaler import ComputeConfig, build_optimizer, parallelize
from nbscaler.runtime.launch import spawn
from nbscaler.schedule import Timeline, build_schedule, simulate


class UniformStack(nn.Module):
    """``nlayers`` identical layers and a sum: every stage costs the same."""

    def __init__(self, nlayers: int, width: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(nlayers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.pow(2).mean()


def _run(scheduler: str, stages: int, micros: int, width: int, steps: int):
    torch.manual_seed(0)
    cfg = ComputeConfig(stages, stages, use_end2end=True, use_pipeline=True, pipeline_nstages=stages,
                        pipeline_nmicros=micros, pipeline_scheduler=scheduler)
    pm = parallelize(UniformStack(2 * stages, width), {"x": torch.randn(64, width)}, "pp", cfg,
                     gen_savedir="/tmp/nbscaler-bench", instance_name=scheduler, reuse="override")
    opt = build_optimizer(pm, torch.optim.SGD, lr=1e-3)
    for _ in range(steps):
        pm.train_step([torch.randn(64, width) for _ in range(micros)])
        opt.step()
        opt.zero_grad()
        dist.barrier()
    return pm.pipeline_events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micros", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(f"{'scheduler':<10}{'measured':>10}{'predicted':>11}{'closed form':>13}")
    for scheduler in ("gpipe", "1f1b"):
        events = [e for rank in spawn(_run, args.stages, scheduler, args.stages, args.micros, args.width,
                                      args.steps, timeout=600, threads=1) for e in rank]
        measured = Timeline.from_rows(events, nranks=args.stages)
        forward = statistics.mean(e["t_end"] - e["t_start"] for e in events if e["phase"] == "F")
        backward = statistics.mean(e["t_end"] - e["t_start"] for e in events if e["phase"] == "B")
        predicted = simulate(build_schedule(scheduler, args.stages, args.micros), forward, backward)
        closed = (args.stages - 1) / (args.micros + args.stages - 1)
        print(f"{scheduler:<10}{measured.bubble_fraction:>10.3f}{predicted.bubble_fraction:>11.3f}{closed:>13.3f}")


if __name__ == "__main__":
    main()
