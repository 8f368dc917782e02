"""``plan.explain()``'s text for a plan autodist chose on a target (``nbscaler.space.autodist``).

The search records its choice, the runners-up and the ranges in ``graph.meta['autodist']['target']``;
this module only words that record, so a plan explains itself without the plan space.
"""

from __future__ import annotations

from typing import Any, Dict, List

from nbscaler.cost.hardware import Hardware

#: The overheads a row's share columns measure, as ``explain()`` names what binds a configuration.
OVERHEADS = {"bubble": "the pipeline bubble", "tp_comm_share": "tensor-parallel collectives",
             "dp_comm_share": "the data-parallel gradient reduction", "pp_send_share": "pipeline sends"}


#: What a configuration's recomputation adds to the compute, in words.
RECOMPUTING = {"selective": "recomputing the attention cores", "full": "recomputing the layers"}


def describe(row) -> str:
    """A configuration in words: ``tp 2 x pp 2 x dp 16, micro-batch 1, recompute selective, sequence
    parallel, ZeRO 2``; with context parallelism ``tp 1 x cp 4 (ring) x pp 2 x dp 8, ...``, with
    expert parallelism ``tp 1 x ep 4 x pp 2 x dp 8, ...``."""
    cp, ep = int(row.get("cp", 1) or 1), int(row.get("ep", 1) or 1)
    context = f" x cp {cp} ({row.get('context_parallel_kind', 'all_gather')})" if cp > 1 else ""
    context += f" x ep {ep}" if ep > 1 else ""
    float8 = row.get("float8", "none")
    software = (f", fp8 {float8} (train with Recipe(float8={float8!r}))" if float8 not in (None, "none") else "") + (
        ", compiled (train with ComputeConfig(compile=True))" if row.get("compiled", False) else "")
    return (f"tp {row['tp']}{context} x pp {row['pp']} x dp {row['dp']}, micro-batch {row['micro_batch']}, "
            f"recompute {row['recompute']}"
            f"{', sequence parallel' if row['sequence_parallel'] else ''}, ZeRO {row['zero_stage']}{software}")


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
        name = "compute, " + (RECOMPUTING[row["recompute"]] if row["recompute"] != best["recompute"]
                              and RECOMPUTING.get(row["recompute"]) else "in smaller, slower matmuls")
        most = work
    return f"{name} ({seconds(most)} more a step than the choice's)"


def _same(info: Dict[str, Any], dtype: str) -> str:
    """The call that predicts what the search priced: its recipe in shorthand where that says all of it."""
    recipe = info.get("recipe")
    if recipe is None or (not recipe.optimizer_kwargs and recipe.grad_reduce_dtype is None
                          and recipe.loss_scaling is None and recipe.clip_grad_norm is None):
        return f"plan.summary({info['optimizer'].__name__}, hardware=..., master_dtype={dtype})"
    return f"plan.summary(hardware=..., recipe=...) for the recipe {recipe.describe()}"


def explain_lines(info: Dict[str, Any]) -> List[str]:
    """``plan.explain()``'s text for a plan autodist chose on a target."""
    hw, best = info["hardware"], info["chosen"]
    dtype = str(info["master_dtype"]).replace("torch.", "") if info["master_dtype"] is not None else "no"
    lines = [f"autodist priced {info['priced']} configurations for {hw.name} x {hw.nodes} node(s) ({hw.ngpus} GPUs), "
             f"a global batch of {info['global_batch']} sequences, in {info['search_s']:.2f} s "
             f"({info['search_cpu_s']:.2f} s of CPU); {info['fitting']} fit"
             + (f", {info['excluded']} could not run" if info["excluded"] else "")
             + (f"; {info['pruned']} more were not priced: their pipeline alone is slower than a fitting one of "
                f"their tp x cp x ep x pp (or {info['within']:g} x the choice), or what they save for the backward alone overflows "
                "the memory" if info["pruned"] else "") + ".",
             f"chose {describe(best)} ({best['micro_batches']} micro-batches a step): {figures(best, hw)}.",
             f"  of its step: {overheads(best)}.",
             f"  {_same(info, dtype)} predicts the same.",
             "against the runners-up (what each would cost; what binds it):"]
    for row in info["runners_up"]:
        slower = row["step_time_s"] / best["step_time_s"] - 1
        lines.append(f"  {describe(row)}: {figures(row, hw)} ({slower:+.1%}); "
                     f"{'fits' if row['fits'] else 'does not fit'}; binds: {binding(row, best, hw)}.")
    return lines
