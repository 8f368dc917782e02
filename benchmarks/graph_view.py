"""How fast the graph view opens and expands on a deep GPT (targets: open < 1 s, expand < 300 ms).

Each repeat compiles a fresh plan (untimed), then times, for the logical pane plus every rank's pane:

- *plan tables*: the plan's own ``plan.ops`` and ``plan.collectives``, computed on first use (every
  view reads them; the Explorer pays this once per compile, whichever view asks first);
- *open*: ``GraphView(plan)`` once those exist: the per-plan facts, the collapsed scene of each
  pane, graphviz on what is visible, the SVG (the first repeat lays out the collapsed level cold);
- *expand*: ``view.expand('blocks.<middle>')``, a level ``dot`` has not seen;
- *expand again*: the same expansion after collapsing it, a layout found in the cache.

    python -m benchmarks.graph_view --layers 24 --ranks 4 --repeat 3
    python -m benchmarks.graph_view --model llama --layers 64      # a few thousand ops
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.models import gpt, llama
from nbscaler.widgets import GraphView


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["gpt", "llama"], default="gpt")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--ranks", type=int, default=4, help="runtime ranks (tp on 2 devices per unit)")
    parser.add_argument("--policy", default="tp")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    if args.model == "gpt":
        cfg = gpt.GPTConfig(n_layer=args.layers, d_model=64, n_head=4, seq_len=32, vocab_size=256)
        module, inputs = gpt.GPT(cfg), {"batch": gpt.sample_batch(cfg, 2)}
    else:
        cfg = llama.LlamaConfig(n_layer=args.layers)
        module, inputs = llama.Llama(cfg), llama.sample_batch(cfg, 2)
    traced = nbscaler.plan(module, inputs, args.policy, ComputeConfig(2, args.ranks))
    middle = f"blocks.{args.layers // 2}"
    times = {"plan tables": [], "open": [], "expand": [], "expand again": []}
    for _ in range(args.repeat):
        plan = traced.replan()                           # fresh tables, same graph; placing is untimed
        times["plan tables"].append(timed(lambda: (plan.ops, plan.collectives)))
        start = time.perf_counter()
        view = GraphView(plan)
        times["open"].append(time.perf_counter() - start)
        times["expand"].append(timed(lambda: view.expand(middle)))
        view.collapse(middle)
        times["expand again"].append(timed(lambda: view.expand(middle)))
        middle = f"blocks.{int(middle.split('.')[1]) + 1}"   # a level not laid out yet next time
    print(f"{args.model} with {args.layers} layers, {len(traced.graph)} ops, policy {args.policy}, "
          f"{args.ranks} ranks ({1 + args.ranks} panes); load average {os.getloadavg()[0]:.1f}")
    for name, values in times.items():
        print(f"  {name:13s} median {statistics.median(values) * 1e3:6.0f} ms   "
              f"(all: {', '.join(f'{v * 1e3:.0f}' for v in values)} ms)")


if __name__ == "__main__":
    main()
