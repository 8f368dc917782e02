"""How long a knob of the Explorer's space tab takes to re-price the Llama-3-8B plan space on 8 H100s.

The model is Hugging Face's ``LlamaForCausalLM`` at Llama-3-8B's published shape (hidden 4096,
intermediate 14336, 32 layers, 32 heads, 8 key-value heads, vocabulary 128,256, from its
``config.json``), built on the meta device; sequences of 8,192 tokens, a global batch of 64
sequences, bf16 with fp32 master weights and AdamW, on ``Hardware.named("H100-SXM-80GB")`` (one
node of 8). The space is what the tab sweeps by default: every tp and pp dividing the 8 GPUs,
micro-batches of 1, 2 or 4 sequences, recomputation on and off, sequence parallelism on and off
where tp > 1, ZeRO 1 and 2 (192 configurations). The space without sequence parallelism (120
configurations) is measured too, beside it.

``PlanSpace`` is built several times, each in a fresh process (``--rounds``; traces and
placements, timed), and in each every knob is turned to a new value and back, several times. The first turn to the new value reads the ops' facts on a new target (or
prices new micro-batch counts) for the first time; the turns after it find the configurations'
peak memory kept (``PlanSpace`` keeps it per configuration), so both are reported: the first turn,
and the median of the later ones; the first turns of the rounds give their median and range, since
one turn on a shared machine can take half as long again as the next. Each figure is the wall and CPU seconds of one re-pricing
(``PlanSpace.last_price_s`` and this process's CPU time around ``set``); CPU seconds are what the
re-pricing costs whatever else the machine runs.

    python -m benchmarks.space              # writes benchmarks/results/space.md
    python -m benchmarks.space --print      # prints it instead
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
import warnings
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from benchmarks.runs import reference_loop_ms
from benchmarks.sweep import LossOf
from nbscaler import Hardware
from nbscaler.space.plan_space import PlanSpace

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
    from nbscaler.models import torchvision_compat
    torchvision_compat.declare_missing_ops()      # transformers imports torchvision, whose ops may be missing here
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


def measure(sequence_parallel: Tuple[bool, ...], rounds: int) -> Tuple[List[Dict[str, float]], Dict[str, "Turns"], int]:
    """``rounds`` spaces, each built in a fresh process (nothing of a value priced before is kept
    anywhere), each with every knob turned there and back ``REPEATS`` times: each build's seconds,
    and per knob the first turns (one a round) and the later ones."""
    builds: List[Dict[str, float]] = []
    turns: Dict[str, Turns] = {name: Turns() for name, _, _ in KNOBS}
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        for build, timed, configurations in pool.map(one_round, [sequence_parallel] * rounds, chunksize=1):
            builds.append(build)
            for name, first, wall, cpu in timed:
                turns[name].add(first, wall, cpu)
    return builds, turns, configurations


def one_round(sequence_parallel: Tuple[bool, ...]) -> Tuple[Dict[str, float], List[Tuple[str, bool, float, float]], int]:
    """One space built and its knobs turned, in this process: the build's seconds and each turn's."""
    warnings.filterwarnings("ignore", message="the cost model could not replay")
    start, cpu = time.perf_counter(), time.process_time()
    space = PlanSpace(llama3_8b(), tokens(), Hardware.named("H100-SXM-80GB"), global_batch=GLOBAL_BATCH,
                      sequence_parallel=sequence_parallel, **RANGES)
    build = {"wall_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu, "traces": space.traces}
    timed = [(name, k == 0 and knobs is there, *timed_set(space, knobs))
             for name, there, back in KNOBS for k in range(REPEATS) for knobs in (there, back)]
    return build, timed, len(space.frame)


class Turns:
    """Wall and CPU seconds of a knob's turns: the first ones (a value never priced before) and the later."""

    def __init__(self) -> None:
        self.first: List[Tuple[float, float]] = []
        self.later: List[Tuple[float, float]] = []

    def add(self, first: bool, wall: float, cpu: float) -> None:
        (self.first if first else self.later).append((wall, cpu))

    def cells(self) -> List[str]:
        """Median and range of the first turns, median of the later, wall and CPU, in ms."""
        out = []
        for seconds in (self.first, self.later):
            for i in (0, 1):
                values = sorted(s[i] * 1e3 for s in seconds)
                spread = f" ({values[0]:.0f}-{values[-1]:.0f})" if seconds is self.first and len(values) > 1 else ""
                out.append(f"{statistics.median(values):.0f}{spread}")
        return out


def report(spaces, rounds: int) -> str:
    """The results file: a table per space measured (``(sequence_parallel, measure(...))`` pairs)."""
    lines = ["# Re-pricing the plan space when a knob turns (Llama-3-8B, 8 H100s)", "",
             f"`python -m benchmarks.space` on this machine ({os.cpu_count()} CPU cores, load average "
             f"{os.getloadavg()[0]:.1f} at the end: the wall seconds carry the load, the CPU seconds much less; "
             f"its reference Python loop, `benchmarks.runs.reference_loop_ms`, took {reference_loop_ms():.1f} ms).",
             "", "Every tp and pp dividing 8, micro-batches 1, 2, 4, recompute on and off, ZeRO 1 and 2, sequences "
             "of 8,192 tokens, global batch 64, bf16 with fp32 master weights, AdamW; the space tab's default "
             "adds sequence parallelism on and off where tp > 1.", "",
             f"Each space is built {rounds} times, each in a fresh process, and in each every knob is turned to the value shown and "
             f"back, {REPEATS} times each way: the first turn (a value never priced before: the median of the "
             f"{rounds} rounds, their range in brackets) and the median of the turns after it (values priced "
             "before). None traces the model again.", ""]
    for sequence_parallel, measured in spaces:
        name = "with sequence parallelism (the tab's default)" if True in sequence_parallel else \
            "without sequence parallelism"
        lines += [f"## {name}", ""] + space_table(*measured)
    return "\n".join(lines) + "\n"


def space_table(builds: List[Dict[str, float]], turns: Dict[str, Turns], configurations: int) -> List[str]:
    walls = ", ".join(f"{b['wall_s']:.1f}" for b in builds)
    cpus = ", ".join(f"{b['cpu_s']:.1f}" for b in builds)
    lines = [f"{configurations} configurations.", "",
             f"Building the space (the two-layer copy traced {builds[0]['traces']} times, placed and priced), "
             f"each round: {walls} s wall, {cpus} s CPU.", "",
             "| knob | first turn wall ms | first turn CPU ms | later turns, median wall ms | "
             "later turns, median CPU ms |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {name} | " + " | ".join(t.cells()) + " |" for name, t in turns.items()]
    return lines + [""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print", action="store_true", help="print the results instead of writing them")
    parser.add_argument("--rounds", type=int, default=3, help="spaces built afresh per table (default 3)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="the cost model could not replay")
    text = report([(sp, measure(sp, args.rounds)) for sp in ((False,), (False, True))], args.rounds)
    if args.print:
        print(text)
    else:
        RESULTS.write_text(text)
        print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
