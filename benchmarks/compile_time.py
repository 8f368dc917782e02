"""Compile time against model depth: ``plan()`` and ``parallelize(load_module=False)``.

The model is the shipped GPT (d=768, vocab 50304, sequence 128, batch 8) under ``tp`` on 4 plan
devices, at 6, 12, 24 and 48 layers. For each depth the table gives the median of ``--repeats``
runs of:

- ``trace``: tracing alone (shapes only: parameters are never computed on);
- ``plan``: trace, place, check and cost, in memory; also as CPU time of this process, which a
  loaded machine inflates less than wall-clock time;
- ``parallelize``: ``plan`` plus generating every rank's code and writing the files (weights
  included) into a fresh folder, without loading;
- ``recompile``: ``parallelize`` again into the same folder with ``reuse='override'``, where the
  unchanged weights file is linked instead of written;
- ``new instance``: ``parallelize`` under another ``instance_name`` in the same ``gen_savedir`` (what
  the Explorer does for each run), which finds the weights file in the folder's store by key.

A first, untimed ``plan`` of a tiny model pays the one-off start-up costs (imports, fake-tensor
dispatch caches), which the table reports on its own line.

    python -m benchmarks.compile_time            # prints a markdown table
    python -m benchmarks.compile_time --depths 6 12 --repeats 1
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from typing import Callable, Dict, List

import torch

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.models.gpt import GPT, GPTConfig, sample_batch
from nbscaler.trace import trace_modes

CONFIG = ComputeConfig(plan_ngpus=4, runtime_ngpus=4)


def gpt(depth: int) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=50304, seq_len=128, n_layer=depth, d_model=768, n_head=12))


def _seconds(fn: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> float:
    start = clock()
    fn()
    return clock() - start


def measure(depth: int, repeats: int) -> Dict[str, float]:
    """Median seconds of each compile step for a GPT of ``depth`` layers."""
    model = gpt(depth)
    args = {"batch": sample_batch(model.config, batch_size=8)}
    times: Dict[str, List[float]] = {"trace": [], "plan": [], "plan_cpu": [], "parallelize": [], "recompile": [],
                                     "new_instance": []}
    for _ in range(repeats):
        times["trace"].append(_seconds(lambda: trace_modes(model, args, CONFIG)))
        times["plan"].append(_seconds(lambda: nbscaler.plan(model, args, "tp", CONFIG)))
        times["plan_cpu"].append(_seconds(lambda: nbscaler.plan(model, args, "tp", CONFIG), time.process_time))
        with tempfile.TemporaryDirectory() as folder:
            compile_ = lambda name=None: nbscaler.parallelize(model, args, "tp", CONFIG, gen_savedir=folder,
                                                              load_module=False, reuse="override", instance_name=name)
            times["parallelize"].append(_seconds(compile_))
            times["recompile"].append(_seconds(compile_))
            times["new_instance"].append(_seconds(lambda: compile_("other")))
    out = {k: statistics.median(v) for k, v in times.items()}
    out["params_millions"] = sum(p.numel() for p in model.parameters()) / 1e6
    return out


def warm_up() -> float:
    """Seconds of the first plan in this process (a tiny model): imports and dispatch caches."""
    model = GPT(GPTConfig(n_layer=1))
    return _seconds(lambda: nbscaler.plan(model, {"batch": sample_batch(model.config, 2)}, "tp", CONFIG))


def table(rows: Dict[int, Dict[str, float]]) -> str:
    lines = ["| layers | parameters | trace (s) | plan (s) | plan, CPU time (s) | parallelize, files written (s) "
             "| recompile (s) | new instance (s) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for depth, r in rows.items():
        lines.append(f"| {depth} | {r['params_millions']:.0f} M | {r['trace']:.2f} | {r['plan']:.2f} | "
                     f"{r['plan_cpu']:.2f} | {r['parallelize']:.2f} | {r['recompile']:.2f} | {r['new_instance']:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[6, 12, 24, 48])
    parser.add_argument("--repeats", type=int, default=3)
    opts = parser.parse_args()
    warnings.simplefilter("ignore")
    first = warm_up()
    rows = {depth: measure(depth, opts.repeats) for depth in opts.depths}
    print(f"GPT d=768, vocab 50304, seq 128, batch 8, tp on 4 plan devices; median of {opts.repeats}.\n")
    print(table(rows))
    print(f"\nFirst plan in a fresh process (tiny model; imports and caches): {first:.2f} s")


if __name__ == "__main__":
    main()
