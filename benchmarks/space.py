"""How long a knob of the Explorer's space tab takes to re-price the Llama-3-8B plan space on 8 H100s.

The model is Hugging Face's ``LlamaForCausalLM`` at Llama-3-8B's published shape (hidden 4096,
intermediate 14336, 32 layers, 32 heads, 8 key-value heads, vocabulary 128,256, from its
``config.json``), built on the meta device; sequences of 8,192 tokens, a global batch of 64
sequences, bf16 with fp32 master weights and AdamW, on ``Hardware.named("H100-SXM-80GB")`` (one
node of 8). The space is what the tab sweeps by default: every tp and pp dividing the 8 GPUs,
micro-batches of 1, 2 or 4 sequences, recomputation on and off, sequence parallelism on and off
where tp > 1, ZeRO 1 and 2 (192 configurations). The space without sequence parallelism (120
configurations) is measured too, beside it.

``PlanSpace`` is built once (traces and placements, timed), then each knob is turned to a new value
and back, several times. The first turn to the new value reads the ops' facts on a new target (or
prices new micro-batch counts) for the first time; the turns after it find the configurations'
peak memory kept (``PlanSpace`` keeps it per configuration), so both are reported: the first turn,
and the median of the later ones. Each figure is the wall and CPU seconds of one re-pricing
(``PlanSpace.last_price_s`` and this process's CPU time around ``set``); CPU seconds are what the
re-pricing costs whatever else the machine runs.

    python -m benchmarks.space              # writes benchmarks/results/space.md
    python -m benchmarks.space --print      # prints it instead
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from benchmarks.sweep import LossOf
from nbscaler import Hardware
from nbscaler.planning.space import PlanSpace

RESULTS = Path(__file__).parent / "results" / "space.md"
SEQ, GLOBAL_BATCH, REPEATS = 8192, 64, 3
RANGES = dict(micro_batch=(1, 2, 4), zero_stage=(1, 2))
KNOBS: List[Tuple[str, Dict, Dict]] = [
    ("target H100 -> H200", {"hardware": "H200-SXM-141GB"}, {"hardware": "H100-SXM-80GB"}),
    ("2 nodes of 4 GPUs <- 1 of 8", {"nodes": 2, "gpus_per_node": 4}, {"nodes": 1, "gpus_per_node": 8}),
    ("global batch 64 -> 128", {"global_batch": 128}, {"global_batch": GLOBAL_BATCH}),
    ("master weights fp32 -> bf16", {"master_dtype": torch.bfloat16}, {"master_dtype": torch.float32}),
]


def llama3_8b() -> torch.nn.Module:
    from tests.models import torchvision_ops
    torchvision_ops.declare_missing_ops()      # transformers imports torchvision, whose ops may be missing here
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192)
    with torch.device("meta"):
        return LossOf(LlamaForCausalLM(config))


def tokens() -> Dict[str, Dict[str, torch.Tensor]]:
    ids = torch.zeros(1, SEQ, dtype=torch.long)
    return {"batch": {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}}


def timed_set(space: PlanSpace, knobs: Dict) -> Tuple[float, float]:
    """Wall and CPU seconds of one re-pricing; it must trace nothing."""
    traces, cpu = space.traces, time.process_time()
    space.set(**knobs)
    assert space.traces == traces, f"{knobs} traced the model again"
    return space.last_price_s, time.process_time() - cpu


def measure(sequence_parallel: Tuple[bool, ...]) -> Tuple[Dict[str, float], List[Tuple[str, List[float], List[float]]], int]:
    start, cpu = time.perf_counter(), time.process_time()
    space = PlanSpace(llama3_8b(), tokens(), Hardware.named("H100-SXM-80GB"), global_batch=GLOBAL_BATCH,
                      sequence_parallel=sequence_parallel, **RANGES)
    built = {"wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu, "traces": space.traces}
    rows = []
    for name, there, back in KNOBS:
        walls, cpus = [], []
        for _ in range(REPEATS):
            for knobs in (there, back):
                wall, cpu_s = timed_set(space, knobs)
                walls.append(wall)
                cpus.append(cpu_s)
        rows.append((name, walls, cpus))
    return built, rows, len(space.frame)


def report(spaces) -> str:
    """The results file: a table per space measured (``(sequence_parallel, measure(...))`` pairs)."""
    lines = ["# Re-pricing the plan space when a knob turns (Llama-3-8B, 8 H100s)", "",
             f"`python -m benchmarks.space` on this machine ({os.cpu_count()} CPU cores, load average "
             f"{os.getloadavg()[0]:.1f} at the end: the wall seconds carry the load, the CPU seconds much less).",
             "", "Every tp and pp dividing 8, micro-batches 1, 2, 4, recompute on and off, ZeRO 1 and 2, sequences "
             "of 8,192 tokens, global batch 64, bf16 with fp32 master weights, AdamW; the space tab's default "
             "adds sequence parallelism on and off where tp > 1.", ""]
    for sequence_parallel, measured in spaces:
        name = "with sequence parallelism (the tab's default)" if True in sequence_parallel else \
            "without sequence parallelism"
        lines += [f"## {name}", ""] + space_table(*measured)
    return "\n".join(lines) + "\n"


def space_table(built: Dict[str, float], rows, configurations: int) -> List[str]:
    lines = [f"{configurations} configurations.", "",
             f"Building the space (the two-layer copy traced {built['traces']} times, placed and priced): "
             f"{built['wall_s']:.1f} s wall, {built['cpu_s']:.1f} s CPU.", "",
             f"Each knob turned to the value shown and back, {REPEATS} times each way: the first turn (a value "
             f"never priced before) and the median of the {2 * REPEATS - 1} turns after it (values priced "
             "before). None traces the model again.", "",
             "| knob | first turn wall ms | first turn CPU ms | later turns, median wall ms | "
             "later turns, median CPU ms |", "|---|---:|---:|---:|---:|"]
    for name, walls, cpus in rows:
        lines.append(f"| {name} | {walls[0] * 1e3:.0f} | {cpus[0] * 1e3:.0f} | "
                     f"{statistics.median(walls[1:]) * 1e3:.0f} | {statistics.median(cpus[1:]) * 1e3:.0f} |")
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print", action="store_true", help="print the results instead of writing them")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="the cost model could not replay")
    text = report([(sp, measure(sp)) for sp in ((False,), (False, True))])
    if args.print:
        print(text)
    else:
        RESULTS.write_text(text)
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
