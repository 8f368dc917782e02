"""torchtitan's ladder: the same 8B run with ``torch.compile``, then with ``torch.compile`` and Float8.

torchtitan's Table 1 (``benchmarks/llama3_h100_202412_torchtitan.md``, torchtitan 9dec370 with
torchao eab345c, December 2024) adds two rungs to the FSDP row: ``torch.compile`` (6,667 tokens/s
and 77.0 GiB per GPU) and ``torch.compile`` with Float8 (8,532 tokens/s, 76.8 GiB). Each rung is
the FSDP row's plan priced with the facts of that rung's software, from torchtitan's code of that
commit:

- ``torch.compile``: ``apply_compile`` compiles each transformer block on its own
  (``Software(compiled=True, compiled_modules=("layers",))``): the embeddings, the final norm, the
  output layer and the loss stay eager;
- Float8: ``Float8Converter`` swaps every ``nn.Linear`` but the output layer (``fqn != "output"``,
  Hugging Face's ``lm_head``) for torchao's ``Float8Linear``, whose only scaling then was dynamic
  and tensorwise (``Recipe(float8="tensorwise", float8_skip=("lm_head",))``). Whether the run
  all-gathered its weights in fp8 (``enable_fsdp_float8_all_gather``) the table does not say;
  nbscaler gathers them in bf16, and the ZeRO-3 collectives the step waits for are about 1% of it.

Both rungs keep the FSDP row's model of the rest: its recomputations bracket torchtitan's, its two
peaks bracket the 500 W clock. The fp8 products run at the target's dense fp8 peak with the bf16
products' measured efficiency (no fp8 figure is published for it). nbscaler's memory model does
not change with compilation: the published peaks fall by 5.4 GiB with it, as inductor saves fewer
and fused tensors for the backward.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

import nbscaler
from benchmarks.published import torchtitan as tt
from nbscaler import Hardware, Recipe

#: The goals set for the ladder: each rung's tokens/s within 10% of the published, each step up
#: (a rung's tokens/s over the one below) within 5% of the published step.
RUNG_GOAL, STEP_GOAL = 0.10, 0.05
#: The README carries the ladder's summary between these markers, rewritten with the results.
START, END = "<!-- torchtitan-ladder: written by python -m benchmarks.published_runs -->", "<!-- /torchtitan-ladder -->"
COMPILED_MODULES = ("layers",)
FLOAT8_SKIP = ("lm_head",)


@dataclass(frozen=True)
class Rung:
    """One rung of the ladder, with the figures torchtitan published for it."""

    name: str
    tokens_per_s_per_gpu: float
    peak_memory_gib: float
    compiled: bool
    float8: Optional[str]

    def hardware(self, base: Hardware) -> Hardware:
        """``base`` running this rung's software."""
        modules = COMPILED_MODULES if self.compiled else ()
        return dataclasses.replace(base, software=base.software.replace(compiled=self.compiled, compiled_modules=modules))

    def recipe(self) -> Recipe:
        return tt.RECIPE.replace(float8=self.float8, float8_skip=FLOAT8_SKIP if self.float8 else ())


RUNGS = (Rung("FSDP", 5762, 82.4, False, None),
         Rung("FSDP + torch.compile", 6667, 77.0, True, None),
         Rung("FSDP + torch.compile + Float8", 8532, 76.8, True, "tensorwise"))


def predict_ladder(run: tt.PublishedLlamaRun, log: Callable = print) -> List[Dict[str, object]]:
    """Every rung priced on the FSDP row's plans: one row per recomputation, peak and rung."""
    model = tt.hf_llama(run)
    ids = torch.zeros(run.local_batch, run.seq, dtype=torch.long)
    rows = []
    for label in tt.BRACKET:
        plan = nbscaler.plan(model, {"input_ids": ids, "labels": ids.clone()}, "data", tt.config(run, tt.RECOMPUTE[label]))
        for peak in (None, tt.H100_NVL_BF16):
            base = tt.grand_teton_h100(max(1, run.gpus // 8), peak)
            for rung in RUNGS:
                step = plan.step_figures(recipe=rung.recipe(), hardware=rung.hardware(base))
                tokens = step.tokens_per_s / run.gpus
                rows.append({"recompute": label, "peak": "SXM, 989" if peak is None else "NVL, 836", "rung": rung,
                             "step": step, "tokens_per_s_per_gpu": tokens,
                             "tokens_error": tokens / rung.tokens_per_s_per_gpu - 1, "peak_gib": step.peak_bytes / tt.GIB})
                log(f"  {rung.name}, recompute {label}, {rows[-1]['peak']}: {tokens:,.0f} tokens/s per GPU")
    return rows


def step_ups(rows: List[Dict[str, object]]) -> List[Dict[str, object]]:
    """Each rung's tokens/s over the rung below, predicted (per recomputation and peak) and published."""
    out = []
    for (label, peak) in dict.fromkeys((r["recompute"], r["peak"]) for r in rows):
        at = [r for r in rows if (r["recompute"], r["peak"]) == (label, peak)]
        for below, above in zip(at, at[1:]):
            predicted = above["tokens_per_s_per_gpu"] / below["tokens_per_s_per_gpu"]
            published = above["rung"].tokens_per_s_per_gpu / below["rung"].tokens_per_s_per_gpu
            out.append({"recompute": label, "peak": peak, "step": above["rung"].name.split(" + ")[-1],
                        "predicted": predicted, "published": published, "error": predicted / published - 1})
    return out


def verdict(rows: List[Dict[str, object]], ups: List[Dict[str, object]]) -> str:
    """The two goals, met or not, in figures."""
    rungs_met = [r for r in rows if abs(r["tokens_error"]) <= RUNG_GOAL]
    ups_met = [u for u in ups if abs(u["error"]) <= STEP_GOAL]
    worst = max(ups, key=lambda u: abs(u["error"]))
    return (f"Each rung within {RUNG_GOAL:.0%} of its published tokens/s: {len(rungs_met)} of {len(rows)} rows"
            + (f" ({'; '.join(sorted({r['rung'].name for r in rungs_met}))})" if rungs_met else "")
            + f". Each step up within {STEP_GOAL:.0%} of the published: {len(ups_met)} of {len(ups)}; the furthest is "
            f"{worst['step']} at {worst['recompute']}, {worst['peak']}: {worst['predicted']:.3f} against "
            f"{worst['published']:.3f} ({worst['error']:+.1%}). The goal (every rung and every step up) is "
            + ("met." if len(rungs_met) == len(rows) and len(ups_met) == len(ups) else "not met."))


def section(run: tt.PublishedLlamaRun, rows: List[Dict[str, object]]) -> str:
    """The ladder's section of the results: the facts, both tables and the verdict, computed."""
    paragraphs = __doc__.split("\n\n")
    lines = ["| rung | recomputation | bf16 peak (TFLOP/s) | step (s) | tokens/s per GPU, predicted | published | "
             "error | peak (GiB), predicted | published |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        rung = r["rung"]
        lines.append(f"| {rung.name} | {r['recompute']} | {r['peak']} | {r['step'].step_time_s:.2f} | "
                     f"{r['tokens_per_s_per_gpu']:,.0f} | {rung.tokens_per_s_per_gpu:,.0f} | {r['tokens_error']:+.1%} | "
                     f"{r['peak_gib']:.1f} | {rung.peak_memory_gib:.1f} |")
    ups = step_ups(rows)
    steps = ["| step up | recomputation | bf16 peak (TFLOP/s) | tokens/s over the rung below, predicted | published | "
             "error |", "| --- | --- | --- | --- | --- | --- |"]
    steps += [f"| + {u['step']} | {u['recompute']} | {u['peak']} | {u['predicted']:.3f} | {u['published']:.3f} | "
              f"{u['error']:+.1%} |" for u in ups]
    return (f"## torchtitan's ladder ({run.name}, FSDP on {run.gpus} GPUs): torch.compile and Float8\n\n"
            + "\n\n".join(p.strip() for p in paragraphs[1:]) + "\n\n" + "\n".join(lines) + "\n\n"
            + "What each fact is worth, as a step up the ladder:\n\n" + "\n".join(steps) + "\n\n"
            + verdict(rows, ups) + "\n")


def summary_block(rows: List[Dict[str, object]]) -> str:
    """The README's short table of the ladder (each step up, predicted against published) and its verdict."""
    ups = step_ups(rows)
    lines = ["| step up | recomputation | bf16 peak (TFLOP/s) | predicted | published | error |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| + {u['step']} | {u['recompute']} | {u['peak']} | {u['predicted']:.3f} | {u['published']:.3f} | "
              f"{u['error']:+.1%} |" for u in ups]
    return "\n".join(lines) + "\n\n" + verdict(rows, ups)
