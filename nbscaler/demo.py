"""The demo: compile a small GPT with every available policy, train it on local CPU ranks, and check
each run against the same training in one process.

Run it with ``python -m nbscaler.cli demo`` (or ``make demo``). Each case starts ``--ranks`` fresh
processes with a gloo group, rank 0 compiles the model (the others wait and load), every rank
trains a few steps, and the losses are compared with a single-process run of the same model on the
same data. Beside each measured step, the table gives the step ``plan.summary()`` predicts for it on
this machine, and after it what those predictions assume (``plan.assumed()``). Gradients of data-parallel units are summed, so the reference sums the losses of every
unit's batch.

Then the tour: the last case's plan is compiled in this process (``nbscaler.plan``) and trained on a
local ``Cluster`` of ``--ranks`` engines, whose telemetry the command line turns into one offline HTML
report of every view (``nbscaler.widgets.write_report``; this module does not import the views).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import pandas as pd
import torch
import torch.distributed as dist

from nbscaler.cluster import Cluster
from nbscaler.cluster.remote import TrainResult
from nbscaler.config import ComputeConfig
from nbscaler.models.gpt import GPT, GPTConfig, sample_batch
from nbscaler.parallel import parallelize
from nbscaler.planning import Plan, plan
from nbscaler.reference import MATCH_RTOL, reference_run
from nbscaler.runtime.launch import spawn
from nbscaler.runtime.optimizer import build_optimizer

MODEL = GPTConfig(vocab_size=128, seq_len=32, n_layer=2, d_model=64, n_head=4)
BATCH = 4
LR = 0.05


@dataclass(frozen=True)
class DemoCase:
    policy: str
    plan_ngpus: int
    runtime_ngpus: int
    extra: tuple = ()            # ComputeConfig keywords, as (name, value) pairs

    @property
    def config(self) -> ComputeConfig:
        return ComputeConfig(plan_ngpus=self.plan_ngpus, runtime_ngpus=self.runtime_ngpus, use_end2end=True,
                             **dict(self.extra))

    @property
    def nmicros(self) -> int:
        return self.config.pipeline_nmicros if self.config.use_pipeline else 1


def _pipeline(scheduler: str, nstages: int, nmicros: int = 4) -> tuple:
    return (("use_pipeline", True), ("pipeline_scheduler", scheduler), ("pipeline_nstages", nstages),
            ("pipeline_nmicros", nmicros))


def cases(nranks: int, compile: bool = False) -> List[DemoCase]:
    """Every available policy on ``nranks`` ranks, plus tensor parallelism inside data-parallel units;
    with ``compile``, each rank runs its generated code through ``torch.compile`` (``ComputeConfig.compile``)."""
    compiled = (("compile", True),) if compile else ()
    out = [DemoCase("dp", 1, nranks, compiled), DemoCase("tp", nranks, nranks, compiled),
           DemoCase("data", nranks, nranks, compiled),
           DemoCase("pp", nranks, nranks, _pipeline("1f1b", nranks) + compiled)]
    if nranks >= 4:
        out += [DemoCase("tp", nranks // 2, nranks, compiled),
                DemoCase("hybrid", nranks, nranks, _pipeline("1f1b", 2) + compiled)]
    return out


def _samples(step: int, unit: int, nmicros: int) -> List[Dict[str, torch.Tensor]]:
    return [sample_batch(MODEL, BATCH, seed=1000 * step + 10 * unit + m) for m in range(nmicros)]


def _train_on_rank(case: DemoCase, steps: int, gen_dir: str) -> Dict[str, object]:
    unit = case.config.unit_of(dist.get_rank())
    torch.manual_seed(0)
    start = time.perf_counter()
    pm = parallelize(GPT(MODEL), {"batch": sample_batch(MODEL, BATCH)}, case.policy, case.config,
                     gen_savedir=gen_dir, instance_name=f"{case.policy}_{case.plan_ngpus}x{case.runtime_ngpus}",
                     reuse="override")
    compile_s = time.perf_counter() - start
    opt = build_optimizer(pm, torch.optim.SGD, lr=LR)
    losses, times = [], []
    for step in range(steps):
        start = time.perf_counter()
        out = pm.train_step(_samples(step, unit, case.nmicros))
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        losses.append([float(x) for x in out])
    return {"losses": losses, "compile_s": compile_s, "step_s": sum(times[1:]) / max(1, len(times) - 1),
            "gen_dir": str(pm.gen_dir), "torch_compile_s": pm.compile_seconds}


def reference_losses(case: DemoCase, steps: int) -> List[List[List[float]]]:
    """Per step, per unit, per micro-batch: the losses of the same training in one process."""
    torch.manual_seed(0)
    model = GPT(MODEL)
    nmicros = case.nmicros
    return reference_run(model, torch.optim.SGD(model.parameters(), lr=LR),
                         lambda step, unit: _samples(step, unit, nmicros), steps=steps, units=case.config.units).losses


def predicted(case: DemoCase) -> Tuple[float, List[str]]:
    """The step ``case`` is predicted to take on this machine (the slowest rank's, training with
    the demo's SGD), and what that prediction assumes (``plan.assumed()``)."""
    torch.manual_seed(0)
    compiled = plan(GPT(MODEL), {"batch": sample_batch(MODEL, BATCH)}, case.policy, case.config)
    return float(compiled.summary(torch.optim.SGD).step_time_s.max()), compiled.assumed()


def run_case(case: DemoCase, steps: int, gen_dir: str) -> Dict[str, object]:
    per_rank = spawn(_train_on_rank, case.runtime_ngpus, case, steps, gen_dir, timeout=600)
    predicted_s, assumed = predicted(case)            # after the run: at the speed its ranks left measured
    ref = reference_losses(case, steps)
    worst = 0.0
    for rank, res in enumerate(per_rank):
        unit = case.config.unit_of(rank)
        for step in range(steps):
            for got, want in zip(res["losses"][step], ref[step][unit]):
                worst = max(worst, abs(got - want) / abs(want))
    first = per_rank[0]
    compiled = [res["torch_compile_s"] for res in per_rank]
    return {"case": case, "compile_s": first["compile_s"], "step_s": first["step_s"], "predicted_s": predicted_s,
            "torch_compile_s": None if compiled[0] is None else max(compiled),
            "assumed": assumed, "match": worst <= MATCH_RTOL, "rel_err": worst, "gen_dir": first["gen_dir"],
            "final_loss": per_rank[-1]["losses"][-1][0]}


def print_table(rows: List[Dict[str, object]]) -> None:
    """The runs, one a line; a ``torch.compile s`` column (the slowest rank's) where a run was compiled."""
    compiled = any(r["torch_compile_s"] is not None for r in rows)
    header = (f"{'policy':<18}{'plan x ranks':<14}{'compile s':>10}"
              + (f"{'torch.compile s':>16}" if compiled else "")
              + f"{'step s':>9}{'predicted s':>13}{'losses match':>14}{'rel err':>10}  generated code")
    print(header)
    print("-" * len(header))
    for r in rows:
        c: DemoCase = r["case"]
        match = "yes" if r["match"] else "NO"
        name = c.policy + (f" {c.config.scheduler}" if c.config.use_pipeline else "")
        torch_s = r["torch_compile_s"]
        torch_cell = (f"{torch_s:>16.2f}" if torch_s is not None else f"{'':>16}") if compiled else ""
        print(f"{name:<18}{f'{c.plan_ngpus} x {c.runtime_ngpus}':<14}{r['compile_s']:>10.2f}{torch_cell}"
              f"{r['step_s']:>9.3f}{r['predicted_s']:>13.3f}{match:>14}{r['rel_err']:>10.1e}  {r['gen_dir']}")
    assumed = list(dict.fromkeys(line for r in rows for line in r["assumed"]))
    if assumed:
        print("\nthe predicted steps assume:\n" + "\n".join(f"  {line}" for line in assumed))


def runs_frame(rows: List[Dict[str, object]]) -> pd.DataFrame:
    """The table ``print_table`` prints, as a DataFrame (the report's runs table)."""
    return pd.DataFrame([{"policy": r["case"].policy, "scheduler": r["case"].config.scheduler if r["case"].config.use_pipeline else "",
                          "plan_ngpus": r["case"].plan_ngpus, "runtime_ngpus": r["case"].runtime_ngpus,
                          "compile_s": r["compile_s"], "torch_compile_s": r["torch_compile_s"],
                          "step_s": r["step_s"], "predicted_step_s": r["predicted_s"],
                          "losses_match": r["match"],
                          "rel_err": r["rel_err"]} for r in rows])


@dataclass
class Tour:
    """One case compiled here and trained on a local cluster: what the report draws."""

    case: DemoCase
    plan: Plan
    result: TrainResult
    rel_err: float


def tour(case: DemoCase, steps: int, gen_dir: str) -> Tour:
    """Plan ``case`` in this process, train it on a local cluster, check it against one process."""
    torch.manual_seed(0)
    compiled = plan(GPT(MODEL), {"batch": sample_batch(MODEL, BATCH)}, case.policy, case.config)
    with Cluster(n=case.runtime_ngpus, timeout=300, name="demo") as cl:
        torch.manual_seed(0)
        pm = cl.parallelize(GPT(MODEL), {"batch": sample_batch(MODEL, BATCH)}, case.policy, case.config,
                            gen_savedir=gen_dir, instance_name="tour", reuse="override")
        nmicros = case.nmicros
        result = pm.train(lambda step, unit: _samples(step, unit, nmicros), steps, optimizer_fn=torch.optim.SGD,
                          lr=LR, progress=False)
    ref = reference_losses(case, steps)
    # A step's loss is the sum over its micro-batches, known to the ranks holding the last stage.
    per_unit = result.steps.groupby(["step", "unit"]).loss.max()
    worst = max(abs(loss - sum(ref[step][unit])) / abs(sum(ref[step][unit])) for (step, unit), loss in per_unit.items())
    return Tour(case, compiled, result, worst)


@dataclass
class DemoOutcome:
    rows: List[Dict[str, object]]
    tour: Tour
    report_path: str

    @property
    def ok(self) -> bool:
        return all(r["match"] for r in self.rows) and self.tour.rel_err <= MATCH_RTOL


def run(argv: Optional[List[str]] = None) -> DemoOutcome:
    """Every case, the table, and the tour; the caller writes the report."""
    parser = argparse.ArgumentParser(prog="nbscaler demo", description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, choices=[2, 4], help="local CPU ranks per run")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run")
    parser.add_argument("--gen-dir", default=os.path.join(tempfile.gettempdir(), "nbscaler-demo"),
                        help="where generated code goes")
    parser.add_argument("--report", default="nbscaler-demo-report.html", help="the HTML report to write")
    parser.add_argument("--compile", action="store_true",
                        help="run each rank's generated code through torch.compile (ComputeConfig.compile)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"nbscaler demo: GPT with {MODEL.n_layer} layers, d_model={MODEL.d_model}, on {args.ranks} CPU ranks, "
          f"{args.steps} steps per policy\n")
    rows = []
    for case in cases(args.ranks, args.compile):
        print(f"  running {case.policy} ({case.plan_ngpus} x {case.runtime_ngpus}) ...", flush=True)
        rows.append(run_case(case, args.steps, args.gen_dir))
    print()
    print_table(rows)
    ok = all(r["match"] for r in rows)
    print("\nall policies reproduce the single-process losses" if ok else "\nSOME POLICIES DIFFER from one process")
    last = cases(args.ranks, args.compile)[-1]
    print(f"\ntour: {last.policy} on a local cluster of {last.runtime_ngpus} engines ...", flush=True)
    toured = tour(last, args.steps, args.gen_dir)
    print(f"tour losses {'match' if toured.rel_err <= MATCH_RTOL else 'DIFFER from'} one process "
          f"(worst relative error {toured.rel_err:.1e})")
    return DemoOutcome(rows, toured, args.report)


def main(argv: Optional[List[str]] = None) -> int:
    """The demo without the report (``nbscaler demo`` adds it)."""
    return 0 if run(argv).ok else 1
