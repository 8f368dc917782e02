"""The shipped GPT trained in fp8 against its bf16 loss curve.

Four runs of the same GPT (``nbscaler.models.gpt``), each through ``parallelize`` on one rank from
the same initial weights, with AdamW and fp32 master copies of bf16 parameters:

- ``bf16``: every product in bf16;
- ``fp8 tensorwise`` and ``fp8 rowwise``: the linear layers' products in fp8 (``Recipe(float8=...)``);
- ``bf16, other data``: bf16 again on another draw of the same data, the yardstick.

The data: sequences from one fixed random Markov chain over the vocabulary (each token has a few
likely successors), so that the loss falls from ``ln(vocab)`` towards the chain's entropy. The
distance between two curves: the largest relative gap between their running means over
``WINDOW`` steps, after the first ``WINDOW`` steps. The stated claim, checked by the script: the
fp8 curves stay within the distance that merely drawing other batches puts between two bf16 runs
(``bf16`` against ``bf16, other data``), that is, fp8 moves the curve less than the data order does.

    python -m benchmarks.float8_loss              # 200 steps; writes benchmarks/results/float8_loss.md

and every loss of every run beside it, in ``float8_loss.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from nbscaler import ComputeConfig, Recipe, build_optimizer, parallelize
from nbscaler.models.gpt import GPT, GPTConfig
from nbscaler.runtime.launch import spawn

RESULTS = Path(__file__).parent / "results" / "float8_loss.md"
MODEL = GPTConfig(vocab_size=128, seq_len=32, n_layer=2, d_model=64, n_head=4)
BATCH = 8
LR = 3e-3
WINDOW = 10
SUCCESSORS = 4                      # likely next tokens of each token in the Markov chain
RUNS = {"bf16": (None, 0), "fp8 tensorwise": ("tensorwise", 0), "fp8 rowwise": ("rowwise", 0),
        "bf16, other data": (None, 1)}


def chain(vocab: int) -> torch.Tensor:
    """The Markov chain's transition matrix: each token's ``SUCCESSORS`` successors, fixed by seed."""
    g = torch.Generator().manual_seed(1234)
    probs = torch.full((vocab, vocab), 0.02 / vocab)
    for token in range(vocab):
        probs[token, torch.randperm(vocab, generator=g)[:SUCCESSORS]] += 0.98 / SUCCESSORS
    return probs


def markov_batch(step: int, data_seed: int, cfg: GPTConfig = MODEL) -> Dict[str, torch.Tensor]:
    """Batch ``step`` of data draw ``data_seed``: ``BATCH`` sequences walked along the chain."""
    g = torch.Generator().manual_seed(100_000 * data_seed + step)
    probs = chain(cfg.vocab_size)
    tokens = [torch.randint(0, cfg.vocab_size, (BATCH,), generator=g)]
    for _ in range(cfg.seq_len):
        tokens.append(torch.multinomial(probs[tokens[-1]], 1, generator=g).squeeze(1))
    seq = torch.stack(tokens, 1)
    return {"idx": seq[:, :-1].contiguous(), "targets": seq[:, 1:].contiguous()}


def train(float8: Optional[str], data_seed: int, steps: int, gen_dir: str) -> Dict[str, object]:
    """On one rank: the GPT in bf16 (fp8 products where ``float8`` is set) trained ``steps`` steps."""
    torch.manual_seed(0)
    recipe = Recipe(torch.optim.AdamW, {"lr": LR}, module_dtype=torch.bfloat16, float8=float8)
    pm = parallelize(GPT(MODEL), {"batch": markov_batch(0, 0)}, "dp", ComputeConfig(1, 1, use_end2end=True), gen_savedir=gen_dir,
                     instance_name=f"float8_{float8}", reuse="override", recipe=recipe)
    opt = build_optimizer(pm, recipe=recipe)
    losses, start = [], time.perf_counter()
    for step in range(steps):
        out = pm.train_step([markov_batch(step, data_seed)])
        opt.step()
        opt.zero_grad()
        losses.append(float(out[0]))
    return {"losses": losses, "seconds": time.perf_counter() - start}


def running_mean(losses: List[float], window: int = WINDOW) -> List[float]:
    """Mean of each ``window`` consecutive losses (``len(losses) - window + 1`` values)."""
    return [sum(losses[i:i + window]) / window for i in range(len(losses) - window + 1)]


def distance(a: List[float], b: List[float], window: int = WINDOW) -> float:
    """The largest relative gap between the running means of ``a`` and ``b`` (``b`` the reference),
    leaving out the first ``window`` steps, where both fall fastest."""
    ma, mb = running_mean(a, window), running_mean(b, window)
    return max(abs(x - y) / y for x, y in zip(ma[window:], mb[window:]))


def _run_one(name: str, steps: int, gen_dir: str) -> Dict[str, object]:
    float8, data_seed = RUNS[name]
    return spawn(train, 1, float8, data_seed, steps, gen_dir, timeout=3600)[0]


def report(runs: Dict[str, Dict[str, object]], steps: int, window: int, seconds: float) -> str:
    """The results file: the setup, the distances with the verdict, and the curves every 10 steps."""
    bf16 = runs["bf16"]["losses"]
    yardstick = distance(runs["bf16, other data"]["losses"], bf16, window)
    lines = ["# fp8 training against bf16: the shipped GPT's loss curve", "",
             f"Machine: {os.cpu_count()} cores, {platform.platform()}, torch {torch.__version__}; load average "
             f"after: {', '.join(f'{x:.2f}' for x in os.getloadavg())}; run on "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} in {seconds:.0f} s "
             "(the seconds per step are of a shared machine: fp8's casts are emulated on the CPU).", "",
             f"Model: GPT, {MODEL.n_layer} layers, d={MODEL.d_model}, {MODEL.n_head} heads, vocab {MODEL.vocab_size}, "
             f"sequence {MODEL.seq_len}, {BATCH} sequences per batch; {steps} steps of AdamW (lr {LR}) with fp32 "
             "masters of bf16 parameters, one rank. Data: walks along a fixed random Markov chain "
             f"({SUCCESSORS} likely successors per token).", "",
             f"Distance = the largest relative gap between the {window}-step running means of a curve and the bf16 "
             f"curve, after the first {window} steps. Yardstick = that distance for bf16 on another draw of the data: "
             f"{yardstick:.4f}.", "",
             "| run | first loss | last loss | mean of last window | distance to bf16 | within the yardstick | s/step |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for name, run in runs.items():
        losses = run["losses"]
        gap = distance(losses, bf16, window) if name != "bf16" else 0.0
        within = "yes" if gap <= yardstick else "no"
        within = "(yardstick)" if name == "bf16, other data" else ("(reference)" if name == "bf16" else within)
        lines.append(f"| {name} | {losses[0]:.4f} | {losses[-1]:.4f} | {sum(losses[-window:]) / window:.4f} | "
                     f"{gap:.4f} | {within} | {run['seconds'] / steps:.3f} |")
    lines += ["", "Losses every 10 steps:", "", "| step | " + " | ".join(runs) + " |",
              "| --- |" + " --- |" * len(runs)]
    for step in range(0, steps, 10):
        lines.append(f"| {step} | " + " | ".join(f"{run['losses'][step]:.4f}" for run in runs.values()) + " |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> Path:
    """Run the four trainings, write the results file and return its path."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--window", type=int, default=WINDOW)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--gen-dir", default="./.nbscaler")
    args = parser.parse_args(argv)
    if args.steps < 3 * args.window:
        parser.error(f"--steps must be at least three windows ({3 * args.window}) to compare curves after the first")
    start = time.perf_counter()
    runs = {name: _run_one(name, args.steps, args.gen_dir) for name in RUNS}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report(runs, args.steps, args.window, time.perf_counter() - start))
    args.out.with_suffix(".json").write_text(json.dumps({"steps": args.steps, "window": args.window, "runs": runs},
                                                        indent=1))
    return args.out


if __name__ == "__main__":
    print(main())
