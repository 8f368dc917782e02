"""autodist on a target: the configuration ``nbscaler.sweep`` prices fastest, planned whole, and why.

>>> cfg = ComputeConfig(8, 64, pas_config={"hardware": "H100-SXM-80GB", "global_batch": 128,   # doctest: +SKIP
...                                        "autodist_space": {"tp": (1, 2, 4, 8), "pp": (1, 2, 4, 8)}})
>>> p = nbscaler.plan(model, {"input_ids": ids}, "autodist", cfg, module_dtype=torch.bfloat16)  # doctest: +SKIP
>>> print(p.explain())                              # the choice against the runners-up

On this machine autodist profiles each op and searches its placement op by op (``policy.autodist``).
For a target the job may have thousands of GPUs that are not here, so the question is first which
configuration: tp, pp, micro-batch, recomputation, sequence parallelism, ZeRO. ``nbscaler.sweep``
prices every one the ranges allow from one trace of a two-layer copy, on the target's roofline and
NCCL models; autodist takes its fastest row that fits the target's memory, plans the model whole
under that row's config (``planning.sweep.config_of``: ``hybrid``'s tensor-parallel placement
inside each stage) and keeps the rows it beat for ``plan.explain()``: what each would cost and
what binds it. ``pas_config['sequence_parallel']``, where given, is the only value searched.

The plan's ``summary(optimizer, hardware=target, master_dtype=...)`` predicts what the chosen row
says (the sweep's own contract, ``tests/planning/test_sweep.py``); ``graph.meta['autodist']``
records the target, the ranges, the rows and the seconds the search took.

The op-by-op search is not run on a target: its costs are this machine's profiled op times, and
inside a stage of a transformer the tensor-parallel placement it competes with (``tp``, kept
whenever it is predicted faster, ``_keep_faster_builtin``) is the one ``hybrid`` uses.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import pandas as pd
import torch

from nbscaler.config import ComputeConfig
from nbscaler.cost.hardware import Hardware
from nbscaler.policy.autodist.options import AutodistOptions
from nbscaler.policy.builtin import SEQUENCE_PARALLEL, BuiltinPolicy, sequence_parallel
from nbscaler.policy.primitives import PolicyError

#: How many configurations ``plan.explain()`` sets against the choice.
RUNNERS_UP = 4

#: The runners-up are the fastest fitting configurations of other layouts within this factor of
#: the choice's step; slower ones are not priced (``sweep``'s ``prune``).
WITHIN = 1.25

#: The overheads a row's share columns measure, as ``explain()`` names what binds a configuration.
OVERHEADS = {"bubble": "the pipeline bubble", "tp_comm_share": "tensor-parallel collectives",
             "dp_comm_share": "the data-parallel gradient reduction", "pp_send_share": "pipeline sends"}


def searches_on_target(policy: Any, cfg: ComputeConfig) -> bool:
    """Whether ``policy`` is autodist asked to plan for a target (``pas_config['hardware']``)."""
    return policy == BuiltinPolicy.AUTODIST and (cfg.pas_config or {}).get("hardware") is not None


def plan_on_target(module: torch.nn.Module, dummy_args: Dict[str, Any], cfg: ComputeConfig,
                   module_dtype: Optional[torch.dtype]):
    """The plan of the fastest configuration that fits the target (see the module docstring).
    ``dummy_args`` hold one sequence, as ``nbscaler.sweep``'s do."""
    from nbscaler.planning.planner import trace_and_place
    from nbscaler.planning.space import PlanSpace
    from nbscaler.planning.stack import one_sequence
    from nbscaler.planning.sweep import config_of
    opts = AutodistOptions.from_config(cfg)
    hardware = opts.target(cfg)
    ranges = dict(opts.autodist_space)
    if SEQUENCE_PARALLEL in cfg.pas_config:          # the user's word on it: search that alone
        ranges.setdefault(SEQUENCE_PARALLEL, (sequence_parallel(cfg),))
    start, cpu = time.perf_counter(), time.process_time()
    space = PlanSpace(module, dummy_args, hardware, global_batch=opts.global_batch, optimizer=opts.optimizer,
                      master_dtype=opts.master_dtype, module_dtype=module_dtype, prune=WITHIN, settle=False, **ranges)
    frame = space.frame
    fitting = frame[frame.fits]
    if fitting.empty:
        leanest = frame.loc[frame.peak_bytes.idxmin()]
        raise PolicyError(f"no configuration of the space fits {hardware.name}'s {gigabytes(hardware.memory_bytes)}: "
                          f"the leanest ({describe(leanest)}) needs {gigabytes(leanest.peak_bytes)} a GPU; "
                          "allow recompute=True, ZeRO 2, more pipeline stages or more nodes.")
    best = fitting.iloc[0]
    chosen = config_of(best, hardware.ngpus, frame.attrs["stack"])
    searched = {"search_s": time.perf_counter() - start, "search_cpu_s": time.process_time() - cpu}
    # the copy showed whether training and eval mode trace alike: the 80 layers are traced once
    placed = trace_and_place(module, one_sequence(dummy_args, int(best.micro_batch)), BuiltinPolicy.HYBRID, chosen,
                             module_dtype, modes_agree=space.modes_agree)
    placed.policy_name = str(BuiltinPolicy.AUTODIST)
    placed.compile_seconds = time.perf_counter() - start            # the search, then the whole trace
    placed.graph.meta["autodist"] = {"target": {
        **searched, "hardware": hardware, "global_batch": opts.global_batch, "optimizer": opts.optimizer,
        "master_dtype": opts.master_dtype, "priced": len(frame), "excluded": len(frame.attrs["excluded"]),
        "pruned": frame.attrs["pruned"], "chosen": best.to_dict(),
        "runners_up": [r.to_dict() for _, r in runners_up(frame, best).iterrows()],
        "fitting": len(fitting)}}
    return placed


def runners_up(frame: pd.DataFrame, best: pd.Series, most: int = RUNNERS_UP) -> pd.DataFrame:
    """The configurations set against ``best``, fastest first: the fastest of all when it does not
    fit (memory rules it out), then the fastest fitting row of each other tp x pp layout and of
    ``best``'s own layout with the other recomputation."""
    frame = frame.copy(deep=False)
    frame.attrs = {}                    # its frame of exclusions would be compared at each concat
    fastest = frame.sort_values("step_time_s", kind="stable").head(1)
    faster = fastest[~fastest.fits & (fastest.step_time_s < best.step_time_s)]
    fitting = frame[frame.fits]
    others = fitting[(fitting.tp != best.tp) | (fitting.pp != best.pp)].groupby(["tp", "pp"], sort=False).head(1)
    same = fitting[(fitting.tp == best.tp) & (fitting.pp == best.pp) & (fitting.recompute != best.recompute)].head(1)
    rows = pd.concat([same, others]).sort_values("step_time_s", kind="stable")
    return pd.concat([faster, rows]).head(most)


def describe(row) -> str:
    """A configuration in words: ``tp 2 x pp 2 x dp 16, micro-batch 1, recompute, sequence parallel,
    ZeRO 2``."""
    return (f"tp {row['tp']} x pp {row['pp']} x dp {row['dp']}, micro-batch {row['micro_batch']}, "
            f"{'recompute' if row['recompute'] else 'no recompute'}"
            f"{', sequence parallel' if row['sequence_parallel'] else ''}, ZeRO {row['zero_stage']}")


def seconds(s: float) -> str:
    return f"{s:.3g} s" if abs(s) >= 1 else f"{s * 1e3:.3g} ms"


def gigabytes(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"


def figures(row, hardware: Hardware) -> str:
    """What a configuration costs: step, throughput, MFU, peak memory against the capacity."""
    return (f"step {seconds(row['step_time_s'])}, {row['tokens_per_s']:,.0f} tokens/s, MFU {row['mfu']:.1%}, "
            f"peak {gigabytes(row['peak_bytes'])} of {gigabytes(hardware.memory_bytes)}")


def overheads(row) -> str:
    return ", ".join(f"{name} {row[col]:.1%}" for col, name in OVERHEADS.items())


def binding(row, best, hardware: Hardware) -> str:
    """What keeps ``row`` from beating ``best``: memory when it does not fit, else the overhead
    that costs it most seconds more than ``best`` (or the compute itself when none does)."""
    if not row["fits"]:
        return f"memory ({gigabytes(row['peak_bytes'])} a GPU, over the {gigabytes(hardware.memory_bytes)} there are)"
    extra = {name: row[col] * row["step_time_s"] - best[col] * best["step_time_s"] for col, name in OVERHEADS.items()}
    name, most = max(extra.items(), key=lambda kv: kv[1])
    work = (row["step_time_s"] - best["step_time_s"]) - sum(extra.values())
    if work > most:
        name = "compute, " + ("recomputing the layers" if row["recompute"] and not best["recompute"]
                              else "in smaller, slower matmuls")
        most = work
    return f"{name} ({seconds(most)} more a step than the choice's)"


def explain_lines(info: Dict[str, Any]) -> List[str]:
    """``plan.explain()``'s text for a plan autodist chose on a target."""
    hw, best = info["hardware"], info["chosen"]
    dtype = str(info["master_dtype"]).replace("torch.", "") if info["master_dtype"] is not None else "no"
    lines = [f"autodist priced {info['priced']} configurations for {hw.name} x {hw.nodes} node(s) ({hw.ngpus} GPUs), "
             f"a global batch of {info['global_batch']} sequences, in {info['search_s']:.2f} s "
             f"({info['search_cpu_s']:.2f} s of CPU); {info['fitting']} fit"
             + (f", {info['excluded']} could not run" if info["excluded"] else "")
             + (f"; {info['pruned']} more were not priced: their pipeline alone is slower than a fitting one of "
                f"their tp x pp (or {WITHIN:g} x the choice), or what they save for the backward alone overflows "
                "the memory" if info["pruned"] else "") + ".",
             f"chose {describe(best)} ({best['micro_batches']} micro-batches a step): {figures(best, hw)}.",
             f"  of its step: {overheads(best)}.",
             f"  plan.summary({info['optimizer'].__name__}, hardware=..., master_dtype={dtype}) predicts the same.",
             "against the runners-up (what each would cost; what binds it):"]
    for row in info["runners_up"]:
        slower = row["step_time_s"] / best["step_time_s"] - 1
        lines.append(f"  {describe(row)}: {figures(row, hw)} ({slower:+.1%}); "
                     f"{'fits' if row['fits'] else 'does not fit'}; binds: {binding(row, best, hw)}.")
    return lines
