"""Planning and pricing at real sizes: how long each step of the interactive loop takes.

Two plans of the sizes issue-scale users ask about, both built on the meta device (no weights):

- ``gpt-145.6B``: the shipped GPT at the largest row of Megatron-LM's weak-scaling table
  (Narayanan et al. 2021, SC21: 80 layers, hidden 12288, 96 heads, vocabulary 51,200, sequence
  2,048), bf16, every block recomputed, ``hybrid`` with tp 8 x pp 8 (64 plan devices), 1,536 GPUs,
  1F1B over 8 micro-batches of one sequence, priced on A100-SXM-80GB nodes;
- ``llama-70B``: Hugging Face's ``LlamaForCausalLM`` at Llama-3-70B's shape (hidden 8192,
  intermediate 28672, 80 layers, 64 heads, 8 key-value heads, vocabulary 128,256; the values of its
  published ``config.json``), ``hybrid`` with tp 8 x pp 8 on 64 GPUs, 8 micro-batches of one sequence
  of 2,048, priced on H100-SXM-80GB nodes.

For each it times ``plan()``, ``plan.memory()`` (the first call replays each device's program on
fake tensors), ``plan.summary(hardware=...)``, a second ``summary`` on another hardware, and a
``summary`` with another optimizer (nothing is re-traced or replayed: the runs are cached on the
plan), in wall seconds, and the second summary once more in this process's CPU seconds, which a
shared machine's load does not inflate. ``summary()`` without hardware is left out: it profiles ops on this CPU (about a minute from an empty cache; ``benchmarks.real_size_planning`` times it).

    python -m benchmarks.plan_at_scale                    # writes benchmarks/results/plan_at_scale.md
    python -m benchmarks.plan_at_scale --models llama-70B --layers 8 --print
"""

from __future__ import annotations

import argparse
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch

import nbscaler
from nbscaler import ComputeConfig, Hardware

RESULTS = Path(__file__).parent / "results" / "plan_at_scale.md"
SEQ, MICROS = 2048, 8


def _pipeline(gpus: int, recompute: Dict) -> ComputeConfig:
    return ComputeConfig(64, gpus, use_end2end=True, use_pipeline=True, pipeline_nstages=8,
                         pipeline_nmicros=MICROS, pipeline_scheduler="1f1b", pas_config=recompute)


def gpt_145b(layers: int) -> Tuple[Callable[[], "nbscaler.Plan"], Hardware, Hardware]:
    from nbscaler.models.gpt import GPT, GPTConfig
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab_size=51200, seq_len=SEQ, n_layer=layers, d_model=12288, n_head=96))
    idx = torch.zeros(1, SEQ, dtype=torch.long)          # real (CPU) inputs: the module is on meta, they are not
    args = {"batch": {"idx": idx, "targets": idx.clone()}}
    cfg = _pipeline(1536, {"recompute_modules": ["blocks"]})
    plan = lambda: nbscaler.plan(model, args, "hybrid", cfg, module_dtype=torch.bfloat16)
    return plan, Hardware.named("A100-SXM-80GB", nodes=192), Hardware.named("H100-SXM-80GB", nodes=192)


def llama_70b(layers: int) -> Tuple[Callable[[], "nbscaler.Plan"], Hardware, Hardware]:
    from nbscaler.models import torchvision_compat
    torchvision_compat.declare_missing_ops()         # transformers imports torchvision, whose ops may be missing here
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers,
                         num_attention_heads=64, num_key_value_heads=8, vocab_size=128256)
    from tests.models.hf import LossOf
    with torch.device("meta"):
        model = LossOf(LlamaForCausalLM(config).to(torch.bfloat16))     # forward(batch) -> loss, as training calls it
    ids = torch.zeros(1, SEQ, dtype=torch.long)          # real (CPU) inputs, as for the GPT
    args = {"batch": {"input_ids": ids, "labels": ids.clone()}}
    plan = lambda: nbscaler.plan(model, args, "hybrid", _pipeline(64, {}))
    return plan, Hardware.named("H100-SXM-80GB", nodes=8), Hardware.named("H200-SXM-141GB", nodes=8)


def llama_8b(layers: int) -> Tuple[Callable[[], "nbscaler.Plan"], Hardware, Hardware]:
    """Hugging Face's ``LlamaForCausalLM`` at Llama-3-8B's shape (hidden 4096, intermediate 14336,
    32 layers, 32 heads, 8 key-value heads, vocabulary 128,256), ``tp`` on the 8 GPUs of one node."""
    from nbscaler.models import torchvision_compat
    torchvision_compat.declare_missing_ops()
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    from tests.models.hf import LossOf
    with torch.device("meta"):
        model = LossOf(LlamaForCausalLM(config).to(torch.bfloat16))     # forward(batch) -> loss, as training calls it
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    args = {"batch": {"input_ids": ids, "labels": ids.clone()}}
    plan = lambda: nbscaler.plan(model, args, "tp", ComputeConfig(8, 8))
    return plan, Hardware.named("H100-SXM-80GB"), Hardware.named("H200-SXM-141GB")


MODELS = {"gpt-145.6B": gpt_145b, "llama-70B": llama_70b, "llama-8B": llama_8b}
LAYERS = {"gpt-145.6B": 80, "llama-70B": 80, "llama-8B": 32}


def _timed(fn: Callable[[], object]) -> Tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def _cpu_timed(fn: Callable[[], object]) -> float:
    """CPU seconds of ``fn`` in this process: what it costs whatever else the machine runs."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def measure(name: str, layers: int) -> Dict[str, float]:
    """Seconds of each step for model ``name`` at ``layers`` layers."""
    make, hw, other = MODELS[name](layers)
    row: Dict[str, float] = {}
    row["plan"], plan = _timed(make)
    row["ops"] = len(plan.graph.nodes)
    row["memory"], _ = _timed(lambda: plan.memory(torch.optim.Adam))
    row["summary(hardware)"], _ = _timed(lambda: plan.summary(torch.optim.Adam, hardware=hw))
    row["again, other hardware"], _ = _timed(lambda: plan.summary(torch.optim.Adam, hardware=other))
    row["again, other optimizer"], _ = _timed(lambda: plan.summary(torch.optim.SGD, hardware=hw))
    row["again, other hardware, CPU"] = _cpu_timed(lambda: plan.summary(torch.optim.Adam, hardware=other))
    return row


COLUMNS = ["plan", "memory", "summary(hardware)", "again, other hardware", "again, other optimizer",
           "again, other hardware, CPU"]


def table(rows: List[Tuple[str, int, Dict[str, float]]]) -> str:
    lines = ["| model | layers | ops | " + " | ".join(f"{c} (s)" for c in COLUMNS) + " | plan + memory + summary (s) |",
             "| --- | ---: | ---: | " + " | ".join("---:" for _ in COLUMNS) + " | ---: |"]
    for name, layers, r in rows:
        total = r["plan"] + r["memory"] + r["summary(hardware)"]
        lines.append(f"| {name} | {layers} | {int(r['ops'])} | " + " | ".join(f"{r[c]:.2f}" for c in COLUMNS)
                     + f" | {total:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt-145.6B", "llama-70B"], choices=list(MODELS))
    parser.add_argument("--layers", type=int, default=None, help="layers of every model (default: its own)")
    parser.add_argument("--print", action="store_true", help="print the table instead of writing the results file")
    opts = parser.parse_args()
    warnings.simplefilter("ignore")
    rows = []
    for name in opts.models:
        layers = opts.layers or LAYERS[name]
        rows.append((name, layers, measure(name, layers)))
        print(table(rows[-1:]), flush=True)
    text = table(rows)
    if not opts.print:
        RESULTS.write_text(f"# Planning and pricing at scale\n\n`python -m benchmarks.plan_at_scale`, "
                           f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.\n\n{text}\n")
    print(text)


if __name__ == "__main__":
    main()
