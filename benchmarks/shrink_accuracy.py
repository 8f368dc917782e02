"""How close an op's time from a smaller shape, scaled (``cost.shrink``), comes to its time at the
real shape, on this machine.

The shipped Llama (``nbscaler.models.llama``: RMSNorm, RoPE, grouped-query attention written as two
products and a softmax, SwiGLU) and the shipped GPT (whose attention is
``scaled_dot_product_attention``) are planned on one device in fp32 at a few sizes large enough that
their products, norms, embedding and loss are over ``cost.shrink``'s budgets, yet small enough to run
at their real shapes here. For each such distinct op (one of each kind per model), the real shape and
its proxy are timed by the profiler's own ``time_op``, alternately, ``ROUNDS`` times; the medians of
forward + backward give the ratio ``scaled proxy / real`` (1.0: exact).

    python -m benchmarks.shrink_accuracy          # writes benchmarks/results/shrink_accuracy.md
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Dict, List

import torch

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.cost.profile import time_op
from nbscaler.cost.shrink import Basis, shrink
from nbscaler.models import gpt, llama

RESULTS = Path(__file__).parent / "results" / "shrink_accuracy.md"
ROUNDS = 3
KINDS = ("linear", "matmul", "attention", "softmax", "rms_norm", "elementwise", "embedding", "loss")


def _llama(d: int, seq: int, batch: int, vocab: int):
    cfg = llama.LlamaConfig(vocab_size=vocab, seq_len=seq, n_layer=1, d_model=d, n_head=d // 64, n_kv_head=d // 256)
    return f"Llama d={d} T={seq} B={batch}", llama.Llama(cfg), llama.sample_batch(cfg, batch)


def _gpt(d: int, seq: int, batch: int, vocab: int):
    cfg = gpt.GPTConfig(vocab_size=vocab, seq_len=seq, n_layer=1, d_model=d, n_head=d // 64)
    return f"GPT d={d} T={seq} B={batch}", gpt.GPT(cfg), {"batch": gpt.sample_batch(cfg, batch)}


MODELS = [lambda: _llama(1024, 2048, 1, 32000), lambda: _llama(1024, 512, 1, 160000),
          lambda: _gpt(1024, 1024, 2, 32000)]


def rows_of(label: str, model: torch.nn.Module, args: Dict) -> List[Dict]:
    """One row per kind of large op of ``model``: the real and the scaled proxy's seconds."""
    plan = nbscaler.plan(model, args, "dp", ComputeConfig(1, 1))
    chosen = {}
    for op in plan.local_runs[0][None].ops:
        proxy = shrink(op)
        kind = "rms_norm" if "norm" in op.node.target else op.node.op
        if proxy.basis in (Basis.FLOPS, Basis.BYTES) and kind in KINDS and kind not in chosen:
            chosen[kind] = proxy
    rows, cpu = [], torch.device("cpu")
    for kind, proxy in chosen.items():
        real, scaled = [], []
        for _ in range(ROUNDS):
            real.append(sum(time_op(proxy.op, cpu)))
            f, b = time_op(proxy.run, cpu)
            scaled.append(f * proxy.factor[0] + b * proxy.factor[1])
        r, s = statistics.median(real), statistics.median(scaled)
        rows.append({"model": label, "op": f"{kind} ({proxy.op.node.name})", "real": proxy.op.in_shapes[0][0],
                     "proxy": proxy.run.in_shapes[0][0], "basis": proxy.basis, "factor": proxy.factor[0],
                     "real_ms": r * 1e3, "scaled_ms": s * 1e3, "ratio": s / r})
    return rows


def table(rows: List[Dict]) -> str:
    lines = ["| model | op | real shape | run at | basis | factor | real fwd+bwd (ms) | scaled (ms) | scaled / real |",
             "| --- | --- | --- | --- | --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {r['model']} | {r['op']} | {tuple(r['real'])} | {tuple(r['proxy'])} | {r['basis']} | {r['factor']:.2f} | "
              f"{r['real_ms']:,.1f} | {r['scaled_ms']:,.1f} | {r['ratio']:.2f} |" for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--print", action="store_true", help="print the table instead of writing the results file")
    opts = parser.parse_args()
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    rows = [row for make in MODELS for row in rows_of(*make())]
    ratios = [r["ratio"] for r in rows]
    text = (f"{table(rows)}\n\n{len(rows)} ops: scaled / real from {min(ratios):.2f} to {max(ratios):.2f}, "
            f"median {statistics.median(ratios):.2f}.")
    if not opts.print:
        RESULTS.write_text(f"# Large ops timed at a smaller shape and scaled, against their real shape\n\n"
                           f"`python -m benchmarks.shrink_accuracy`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
                           f"on the shared 2-core CPU machine, one thread (load average {load:.1f} at the start, "
                           f"{os.getloadavg()[0]:.1f} at the end); the medians of {ROUNDS} alternating runs, "
                           f"forward + backward.\n\n{text}\n")
    print(text)


if __name__ == "__main__":
    main()
