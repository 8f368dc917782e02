"""A published run planned as it ran and priced on its target: nothing runs on this machine.

The row's GPT is built on the meta device at the row's size and planned with the row's tensor
(``t``) and pipeline (``p``) parallelism, ``GPUs / (t p)`` data-parallel units, the run's
recompute, pipeline split and schedule (one stage without a pipeline: gradient accumulation), and
priced with the run's recipe on its GPUs running its software (``PublishedRun.hardware``).
``ablation`` undoes each fact alone and prices again, so that each fact's sign and size are shown,
whichever way it moves the step.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch

import nbscaler
from nbscaler import ComputeConfig, Hardware
from nbscaler.cost.step_figures import StepFigures
from nbscaler.models.gpt import GPT
from benchmarks.published.runs import PublishedRun, RunFacts

MICROS = (1, 2, 4, 8, 16)


def tokens(micro: int, seq: int) -> Dict[str, Dict[str, torch.Tensor]]:
    idx = torch.zeros(micro, seq, dtype=torch.long, device="meta")
    return {"batch": {"idx": idx, "targets": idx.clone()}}


def plan_run(run: PublishedRun, micro: int, facts: Optional[RunFacts] = None) -> "nbscaler.Plan":
    """The row's GPT on meta, placed as the row ran with micro-batches of ``micro`` sequences."""
    facts = facts or run.facts
    with torch.device("meta"):
        model = GPT(run.gpt(facts))
    pas = {"recompute_modules": ["blocks"]} if facts.recompute == "full" else {}
    if run.pp > 1:
        pas["pipeline_split"] = facts.pipeline_split
    cc = ComputeConfig(run.tp * run.pp, run.gpus, use_end2end=True, use_pipeline=True, pipeline_nstages=run.pp,
                       pipeline_nmicros=run.per_replica // micro, pipeline_scheduler=facts.scheduler, pas_config=pas)
    return nbscaler.plan(model, tokens(micro, run.seq), "hybrid", cc, recipe=facts.recipe)


@dataclasses.dataclass
class Priced:
    """One plan of a run, priced: its micro-batch, step and what the step is made of."""

    micro: int
    step: StepFigures
    plan: "nbscaler.Plan" = dataclasses.field(repr=False)
    seconds_to_plan: float = 0.0

    @property
    def step_s(self) -> float:
        return self.step.step_time_s


def price(plan: "nbscaler.Plan", run: PublishedRun, facts: Optional[RunFacts] = None,
          hardware: Optional[Hardware] = None) -> StepFigures:
    facts = facts or run.facts
    return plan.step_figures(recipe=facts.recipe, hardware=hardware or run.hardware(facts))


def fastest_that_fits(run: PublishedRun, micros: Optional[List[int]] = None, log: Callable = print) -> Priced:
    """Plan with each micro-batch size that divides a replica's share, keep the fastest whose
    predicted memory fits (the last tried if none does)."""
    best = last = None
    for micro in [m for m in (micros or MICROS) if run.per_replica % m == 0]:
        start = time.perf_counter()
        plan = plan_run(run, micro)
        last = Priced(micro, price(plan, run), plan, time.perf_counter() - start)
        log(f"  {run.params_b}B micro-batch {micro}: step {last.step_s:.2f} s, peak {last.step.peak_bytes / 1e9:.1f} GB, "
            f"{last.seconds_to_plan:.0f} s to plan and price")
        if last.step.fits and (best is None or last.step_s < best.step_s):
            best = last
    return best or last


def shares(step: StepFigures) -> Dict[str, float]:
    """The slowest device's step by cause, as shares: the pipeline's bubble, its sends, the
    tensor-parallel collectives, the exposed data-parallel reduction, and compute with the
    optimizer step (the rest)."""
    out = {"bubble": step.bubble, "pipeline sends": step.pp_send_share, "tp collectives": step.tp_comm_share,
           "dp reduction (exposed)": step.dp_comm_share}
    return {"compute and optimizer": 1 - sum(out.values()), **out}


#: Each fact undone alone: its label, the change to the facts or the target, and whether the plan
#: must be made again (the model or its stages change) or only priced again.
ABLATIONS: Dict[str, Tuple[Callable[[RunFacts], RunFacts], Callable[[Hardware], Hardware], bool]] = {
    "FlashAttention": (lambda f: f.replace(software=f.software.replace(attention="flash")), lambda h: h, False),
    "no attention dropout": (lambda f: f.replace(software=f.software.replace(attention_dropout=0.0)), lambda h: h, False),
    "softmax unfused": (lambda f: f.replace(software=f.software.replace(fused_softmax=False)), lambda h: h, False),
    "bias-dropout-add unfused": (lambda f: f.replace(software=f.software.replace(fused_bias_dropout_add=False)),
                                 lambda h: h, False),
    "reduction during the backward": (lambda f: f.replace(software=f.software.replace(overlap_grad_reduce=True)),
                                      lambda h: h, False),
    "bf16, reduced in fp32, no loss scaler": (lambda f: f.replace(recipe=f.recipe.replace(
        module_dtype=torch.bfloat16, grad_reduce_dtype=torch.float32, loss_scaling=None)), lambda h: h, True),
    "no gradient clipping": (lambda f: f.replace(recipe=f.recipe.replace(clip_grad_norm=None)), lambda h: h, False),
    "boost clock (1,410 MHz)": (lambda f: f, lambda h: dataclasses.replace(h, sustained_clock_ratio=1.0), False),
    "matmul ceiling 0.80": (lambda f: f, lambda h: dataclasses.replace(h, matmul_efficiency=0.80), False),
    "no hidden dropout": (lambda f: f.replace(hidden_dropout=0.0), lambda h: h, True),
    "stages balanced by FLOPs": (lambda f: f.replace(pipeline_split="flops"), lambda h: h, True),
}


def ablation(run: PublishedRun, best: Priced) -> Dict[str, Optional[float]]:
    """Each fact undone alone: the step then over the step with every fact, less one (negative:
    the fact lengthens the step). ``None`` where the fact does not apply (no pipeline to split)."""
    out: Dict[str, Optional[float]] = {}
    for label, (change, target, replan) in ABLATIONS.items():
        if label == "stages balanced by FLOPs" and run.pp == 1:
            out[label] = None
            continue
        facts = change(run.facts)
        plan = plan_run(run, best.micro, facts) if replan else best.plan
        out[label] = price(plan, run, facts, target(run.hardware(facts))).step_time_s / best.step_s - 1
    return out


def predict(run: PublishedRun, micros: Optional[List[int]] = None, log: Callable = print) -> Dict[str, object]:
    """A row's prediction: the fastest micro-batch that fits, its shares and its ablation."""
    best = fastest_that_fits(run, micros, log)
    return {"run": run, "best": best, "shares": shares(best.step), "ablation": ablation(run, best)}
