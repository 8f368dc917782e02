"""torchtitan's one bf16 H100 row, planned from its published shape and priced on its GPUs.

torchtitan's published performance (``benchmarks/llama3_h100_202412_torchtitan.md`` and
``docs/performance.md``, Table 1, torchtitan 9dec370, December 2024): Llama 3.1 8B, FSDP over the 8
GPUs of one node, local batch 2 of 8,192 tokens, selective activation checkpointing, AdamW, 5,762
tokens/s and 82.4 GiB of memory per GPU, on Meta's Grand Teton H100s (96 GB of HBM2e at 2.4 TB/s,
500 W power limit). It is planned from Hugging Face's ``LlamaForCausalLM`` on meta as ZeRO stage 3
over the 8 GPUs, with the units torchtitan's ``apply_fsdp`` shards (``fully_shard`` on each
transformer block, then on the root: here one unit per decoder layer and one for the rest, the
embeddings, the final norm and the head), FlashAttention (PyTorch's SDPA on H100), fp32 sharded
parameters (the masters the optimizer updates), the gradients reduced in fp32 and the parameters
gathered in bf16 (its ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``), the
gradients' norm clipped (``max_norm = 1.0`` in its configs). torchtitan frees each block's gathered
parameters after its forward except the last block's (``reshard_after_forward`` is false for the
last block only); nbscaler has one setting for every unit and is given the closest, freeing them
all, so it gathers the last layer once more at the start of the backward. Neither frees the rest
after the forward (FSDP2 keeps its root gathered; nbscaler its rest unit). Its 500 W limit lowers
the clock by an amount torchtitan does not know ("between SXM and NVL"): each row is priced at the
SXM's peaks and at the NVL's (bf16 835.5 TFLOP/s dense, the datasheet's 1,671 sparse halved; fp8
1,670.5, its 3,341 halved).

The recomputation is not priced as it ran: torchtitan's selective checkpointing
(``selective_ac_option = "op"``, ``torchtitan/parallelisms/parallelize_llama.py``) wraps each block
and keeps the outputs of attention and of every other matrix product it runs (the first, third,
fifth and seventh: ``wq``, ``wv``, ``w1``, ``w2``), recomputing the rest of the block in the
backward (the products ``wk``, ``wo`` and ``w3``, the norms, the rotary embedding, the SwiGLU's
element-wise ops). nbscaler recomputes whole regions, each keeping only its inputs, and has no policy
that keeps chosen ops' outputs; its ``selective`` (Megatron-LM's) recomputes the attention core, one
SDPA kernel here, which torchtitan keeps. The three rows (none, the attention core, every layer)
bracket the run's policy: it recomputes part of what every-layer recomputation does, so its step
lies between the ``none`` and ``every layer`` rows' at the same peak.

The published memory is what torchtitan's ``train.py`` logs as ``memory``: ``max_reserved_gib``,
``torch.cuda.memory_stats()["reserved_bytes.all.peak"]`` over 2^30 (``torchtitan/metrics.py``), the
caching allocator's reserved bytes at their peak over the logged steps, in GiB.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

import torch

import nbscaler
from nbscaler import ComputeConfig, Hardware, NumberFormat, Recipe
from benchmarks.published.predict import shares

H100_NVL_BF16 = 835.5e12
H100_NVL_FP8 = 1670.5e12
RECIPE = Recipe(torch.optim.AdamW, master_dtype=torch.float32, grad_reduce_dtype=torch.float32, clip_grad_norm=1.0)
#: torchtitan's FSDP units: each transformer block (Hugging Face's decoder layers), the rest of the
#: model one more unit (nbscaler's rest unit, torchtitan's ``fully_shard`` on the root).
UNITS = ("model.layers",)
#: torchtitan frees every block's gathered parameters after its forward but the last's; nbscaler's one
#: setting for every unit closest to it.
RESHARD_AFTER_FORWARD = True
#: The goal set for this row: predicted tokens/s and peak memory per GPU each within 10% of the published.
GOAL = 0.10
GIB = 2 ** 30


@dataclass(frozen=True)
class PublishedLlamaRun:
    """A torchtitan row: tokens/s and peak memory (GiB, ``torch.cuda.max_memory_reserved``) per GPU as
    published; FSDP over ``gpus``, ``local_batch`` sequences each."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    gpus: int
    local_batch: int
    seq: int
    tokens_per_s_per_gpu: float
    peak_memory_gib: float
    source: str


LLAMA_RUNS = [
    PublishedLlamaRun("Llama 3.1 8B", 4096, 14336, 32, 32, 8, 2, 8192, 5762, 82.4,
                      "torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1 (FSDP, no torch.compile), 9dec370"),
]


def grand_teton_h100(nodes: int, bf16_peak: Optional[float] = None) -> Hardware:
    """Meta's Grand Teton H100: 96 GB of HBM2e at 2.4 TB/s; the SXM's peaks, or the NVL's
    (``bf16_peak=H100_NVL_BF16``: its tensor cores' peaks, fp8's too, at its lower clock)."""
    hw = Hardware.named("H100-SXM-80GB", nodes=nodes)
    peaks = dict(hw.peak_flops_by_precision)
    name = "H100 (Grand Teton, 96 GB HBM2e)"
    if bf16_peak is not None:
        if bf16_peak != H100_NVL_BF16:
            raise ValueError(f"bf16_peak={bf16_peak:g}: the rows bracket the clock with the SXM's peaks (None) "
                             f"and the NVL's (H100_NVL_BF16={H100_NVL_BF16:g}).")
        peaks.update({NumberFormat.BF16: bf16_peak, NumberFormat.FP16: bf16_peak, NumberFormat.FP8: H100_NVL_FP8})
        name += f", bf16 peak {bf16_peak / 1e12:.0f} TFLOP/s"
    return dataclasses.replace(hw, name=name, memory_bytes=96e9, memory_bytes_per_s=2.4e12, peak_flops_by_precision=peaks)


def hf_llama(run: PublishedLlamaRun) -> torch.nn.Module:
    """Hugging Face's ``LlamaForCausalLM`` at a Llama-3 shape (8 key-value heads, vocabulary 128,256), on meta."""
    from nbscaler.models import torchvision_compat
    torchvision_compat.declare_missing_ops()         # transformers imports torchvision, whose ops may be missing here
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=run.hidden, intermediate_size=run.intermediate, num_hidden_layers=run.layers,
                         num_attention_heads=run.heads, num_key_value_heads=8, vocab_size=128256,
                         rope_theta=500000.0, max_position_embeddings=run.seq)
    with torch.device("meta"):
        return LlamaForCausalLM(config).to(torch.bfloat16)


#: nbscaler's recomputations that bracket torchtitan's (module docstring): none, the attention core
#: of each layer, every layer whole.
RECOMPUTE = {"none": {"recompute": "none"}, "selective (attention core)": {"recompute": "selective"},
             "every layer": {"recompute": "full"}}
BRACKET = ("none", "every layer")


def config(run: PublishedLlamaRun, pas: Dict[str, object]) -> ComputeConfig:
    """ZeRO stage 3 over the run's GPUs with torchtitan's units and the closest reshard setting."""
    return ComputeConfig(1, run.gpus, use_end2end=True, use_zero=True, zero_stage=3, zero_units=UNITS,
                         zero_reshard_after_forward=RESHARD_AFTER_FORWARD, pas_config=pas)


def kernel_seconds(plan: "nbscaler.Plan", hardware: Hardware, device: int,
                   recipe: Optional[Recipe] = None) -> Dict[str, float]:
    """Seconds of plan ``device``'s forward and backward per kind of kernel on ``hardware`` (with
    ``recipe``'s products: fp8 or not), each op as the plan's step model prices it (a recomputed
    op's forward again in the backward)."""
    model = plan.step_model(hardware, recipe)
    out = {"matrix products": 0.0, "attention": 0.0, "other kernels": 0.0}
    for run in plan.local_runs[device].values():
        for op in run.ops:
            f, b = model.profiler.time(op)
            kind = ("matrix products" if op.node.meta.get("product") else
                    "attention" if op.node.op == "attention" else "other kernels")
            out[kind] += f + b + (f if op.recomputed else 0.0)
    return out


def step_parts(plan: "nbscaler.Plan", step, recipe: Optional[Recipe] = None,
               section: str = "tp collectives") -> Dict[str, float]:
    """The slowest device's step in seconds: its kernels by kind, what it waits for ZeRO stage 3's
    gathers and reduce-scatters, the optimizer step (with the clipping's passes) and its section
    collectives (named ``section``: without tensor parallelism, another dimension's)."""
    device = step.slowest[1]
    d = step.devices[device]
    return {**kernel_seconds(plan, step.hardware, device, recipe), "ZeRO-3 collectives (exposed)": d.fsdp_s,
            "exposed reduction": d.sync_s, "optimizer step": d.update_s, section: d.tp_s}


def peak_parts(plan: "nbscaler.Plan", device: int) -> Dict[str, float]:
    """Plan ``device``'s peak by category (``nbscaler.columns``), in bytes."""
    row = plan.memory(recipe=RECIPE).iloc[device]
    return {"activations": row["activation_bytes"], "optimizer state and fp32 masters": row["optimizer_bytes"],
            "gradients": row["grad_bytes"], "gathered units": row["gathered_bytes"],
            "parameters and buffers": row["param_bytes"] + row["buffer_bytes"]}


def predict_llama(run: PublishedLlamaRun, log: Callable = print) -> List[Dict[str, object]]:
    """The run as ZeRO stage 3 over its GPUs for each recomputation of ``RECOMPUTE``, each priced at
    the SXM's peak and at the NVL's."""
    model = hf_llama(run)
    ids = torch.zeros(run.local_batch, run.seq, dtype=torch.long)      # transformers' forward reads the ids' values
    rows = []
    for label, pas in RECOMPUTE.items():
        start = time.perf_counter()
        plan = nbscaler.plan(model, {"input_ids": ids, "labels": ids.clone()}, "data", config(run, pas))
        rebuilt = max((b for runs in plan.local_runs.values() for r in runs.values() for b in r.rebuilt.values()),
                      default=0)
        for peak in (None, H100_NVL_BF16):
            step = plan.step_figures(recipe=RECIPE, hardware=grand_teton_h100(max(1, run.gpus // 8), peak))
            tokens, gib = step.tokens_per_s / run.gpus, step.peak_bytes / GIB
            rows.append({"recompute": label, "peak": "SXM, 989" if peak is None else "NVL, 836",
                         "peak_name": "the SXM's" if peak is None else "the NVL's", "step": step,
                         "tokens_per_s_per_gpu": tokens, "tokens_error": tokens / run.tokens_per_s_per_gpu - 1,
                         "peak_gib": gib, "memory_error": gib / run.peak_memory_gib - 1,
                         "shares": step_shares(step), "parts": step_parts(plan, step),
                         "memory": peak_parts(plan, step.slowest[1]), "rebuilt_bytes": rebuilt})
            log(f"  {run.name} recompute {label}, {rows[-1]['peak']}: step {step.step_time_s:.2f} s, "
                f"{tokens:,.0f} tokens/s per GPU, peak {gib:.1f} GiB, {time.perf_counter() - start:.0f} s")
    return rows


def step_shares(step) -> Dict[str, float]:
    """``predict.shares`` with the seconds the step waits for ZeRO stage 3's collectives taken out of
    compute as a cause of their own."""
    out = shares(step)
    out["compute and optimizer"] -= step.fsdp_comm_share
    out["ZeRO-3 collectives (exposed)"] = step.fsdp_comm_share
    return out


def within_goal(row: Dict[str, object]) -> bool:
    return abs(row["tokens_error"]) <= GOAL and abs(row["memory_error"]) <= GOAL


def _parts(parts: Dict[str, float], scale: float, unit: str) -> str:
    return ", ".join(f"{k} {v / scale:.{2 if unit == 's' else 1}f}" for k, v in parts.items() if v / scale >= 0.005)


def verdict(run: PublishedLlamaRun, rows: List[Dict[str, object]]) -> str:
    """The goal, met or not, in figures; where the published figures lie against the bracketing rows."""
    met = [r for r in rows if within_goal(r)]
    text = [f"The goal (predicted tokens/s and peak memory per GPU each within {GOAL:.0%} of the published) is "
            + (f"met by {len(met)} of the {len(rows)} rows: " + "; ".join(f"{r['recompute']} at the {r['peak']} peak"
                                                                       for r in met) if met
               else f"met by none of the {len(rows)} rows") + ", and no row prices torchtitan's recomputation."]
    lo_label, hi_label = BRACKET
    for peak in dict.fromkeys(r["peak"] for r in rows):
        at = {r["recompute"]: r for r in rows if r["peak"] == peak}
        lo, hi = at[hi_label]["tokens_per_s_per_gpu"], at[lo_label]["tokens_per_s_per_gpu"]
        where = ("below both" if run.tokens_per_s_per_gpu < lo else "above both" if run.tokens_per_s_per_gpu > hi
                 else "between them")
        text.append(f"At {at[lo_label]['peak_name']} peak ({peak.split(', ')[1]} TFLOP/s) a prediction of the run's "
                    f"recomputation would lie between the '{lo_label}' and '{hi_label}' rows' ({hi:,.0f} and {lo:,.0f} "
                    "tokens/s per GPU); the published "
                    f"{run.tokens_per_s_per_gpu:,.0f} is {where}"
                    + (f": even '{hi_label}' is {at[hi_label]['tokens_error']:+.1%} against it, so the predicted step "
                       "is too short whatever the run's recomputation costs." if where == "below both" else "."))
    gibs = [r["peak_gib"] for r in rows]
    inside = min(gibs) <= run.peak_memory_gib <= max(gibs)
    text.append(f"The rows' peaks span {min(gibs):.1f} to {max(gibs):.1f} GiB; the published {run.peak_memory_gib:.1f} GiB "
                f"lies {'inside' if inside else 'outside'} that span.")
    unfit = list(dict.fromkeys(r["recompute"] for r in rows if not r["step"].fits))
    if unfit:
        text.append(f"The {' and '.join(repr(u) for u in unfit)} rows do not fit the "
                    f"{rows[0]['step'].hardware.memory_bytes / 1e9:.0f} GB the run trained in.")
    return " ".join(text)


def section(run: PublishedLlamaRun, rows: List[Dict[str, object]]) -> str:
    """The torchtitan section of the results: its tables and what the rows say, computed."""
    from benchmarks.published.report import _shares
    paragraphs = __doc__.split("\n\n")
    lines = ["| recomputation | bf16 peak (TFLOP/s) | step (s) | tokens/s per GPU, predicted | published | error | "
             "peak memory per GPU (GiB), predicted | published | error | fits in "
             f"{rows[0]['step'].hardware.memory_bytes / 1e9:.0f} GB | within {GOAL:.0%} on both | MFU | "
             "the step, by cause |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        step = r["step"]
        lines.append(f"| {r['recompute']} | {r['peak']} | {step.step_time_s:.2f} | {r['tokens_per_s_per_gpu']:,.0f} | "
                     f"{run.tokens_per_s_per_gpu:,.0f} | {r['tokens_error']:+.1%} | {r['peak_gib']:.1f} | "
                     f"{run.peak_memory_gib:.1f} | {r['memory_error']:+.1%} | {'yes' if step.fits else 'no'} | "
                     f"{'yes' if within_goal(r) else 'no'} | {step.mfu:.0%} | {_shares(r['shares'])} |")
    parts = ["| recomputation | bf16 peak (TFLOP/s) | the step (s), by kind of kernel and wait | the peak (GiB), "
             "by category |", "| --- | --- | --- | --- |"]
    for r in rows:
        parts.append(f"| {r['recompute']} | {r['peak']} | {_parts(r['parts'], 1.0, 's')} | "
                     f"{_parts(r['memory'], GIB, 'GiB')} |")
    rebuilt = max(r["rebuilt_bytes"] for r in rows)
    counts = (f"nbscaler's peak is the most a rank holds at one moment of the step (`nbscaler.columns`: "
              "parameter shards, gradients, optimizer state with the fp32 masters, buffers, saved activations and "
              "ZeRO-3's gathered units); it leaves out short-lived workspace (temporaries, the gradient flowing "
              "between two ops, collective buffers, the layer a recomputation rebuilds in the backward: up to "
              f"{rebuilt / GIB:.1f} GiB here) and the caching allocator's slack, both of which torchtitan's reserved "
              "peak holds, so it reads lower than the published figure by what it leaves out.")
    return (f"## torchtitan on H100 ({run.name}, FSDP on {run.gpus} GPUs)\n\n{paragraphs[1]}\n\n{paragraphs[2]}\n\n"
            f"{paragraphs[3].strip()} {counts}\n\n" + "\n".join(lines) + f"\n\n{verdict(run, rows)}\n\n"
            "Where each row's step and peak go (the slowest device's step; its peak moment):\n\n"
            + "\n".join(parts) + "\n")
