"""The matrix products and attention of the shipped models, timed on this machine's GPU in bf16 and
fp8, beside what nbscaler's roofline predicts for that GPU.

A target's step time is mostly its products, and nbscaler prices each one from its shape alone
(``cost.roofline.RooflineOps``: the FLOPs at the GPU's dense peak times its ``matmul_efficiency``,
plus a ramp; in fp8, the casts as well). This script checks that price on a real GPU. Each
distinct linear layer of the shipped GPT (at GPT-2 small's shape) and Llama (at a Llama-3-8B-like
width) is planned on the meta device, as a target is, and then:

- predicted: ``RooflineOps(Hardware.named(hardware)).time(op)``, forward and backward, in bf16,
  and again with ``float8=tensorwise`` (nbscaler's fp8 recipe, torchao's tensorwise scaling);
- measured, bf16: ``cost.profile.time_op`` on this device, nbscaler's own profiler (the median of
  a few runs, random inputs), the autograd engine's fixed start-up taken out of the backward as the
  profiler takes it out;
- measured, fp8: ``runtime.float8.Float8Product``, the product nbscaler's runtime runs under
  ``Recipe(float8="tensorwise")``, forward and backward, timed the same way.

Each distinct causal attention (GPT-2 small's, the Llama's at 4,096 and at 32,768 tokens, the
length each GPU holds in torchtitan's context-parallel rows) is timed the same way in bf16, and the
share of the bf16 peak it reached is set beside ``Hardware.attention_efficiency``.

Every figure and the summary are computed here. Run it on the GPU the hardware names; on another
device (``--small`` on a CPU, which the test runs) the table is computed the same way but compares
a prediction for one machine with a measurement on another, and says so.

    python -m benchmarks.gpu_products                 # on an H200: benchmarks/results/gpu_products.md
    python -m benchmarks.gpu_products --small --out /tmp/p.md
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.cost.hardware import Hardware
from nbscaler.cost.local import OpCall, run_local
from nbscaler.cost.profile import engine_overhead_s, time_op
from nbscaler.cost.roofline import RooflineOps
from nbscaler.cost.speed import sync
from nbscaler.ir.shape_rules import arg
from nbscaler.models.gpt import GPT, GPTConfig
from nbscaler.models.llama import Llama, LlamaConfig
from nbscaler.recipe import Float8Scaling

RESULTS = Path(__file__).parent / "results" / "gpu_products.md"
REPEATS = 20         # timed runs of each fp8 product, after 3 warm-ups (the median is kept)


@dataclass(frozen=True)
class ModelCase:
    name: str
    shape: str          # what the sizes are, in words
    build: object       # () -> (module on meta, forward arguments on meta)
    ops: Tuple[str, ...] = ("linear", "attention")      # which of its ops to time


def _on_meta(model: type, cfg: object, batch: int, end2end: bool):
    """() -> a shipped ``model`` of ``cfg`` in bf16 on the meta device, and ``batch`` sequences of
    token ids for it (GPT takes them as one ``batch`` dict, Llama as keywords)."""
    def build():
        with torch.device("meta"):
            module = model(cfg).to(torch.bfloat16)
        tokens = torch.zeros(batch, cfg.seq_len, dtype=torch.long, device="meta")
        args = {"idx": tokens, "targets": tokens}
        return module, ({"batch": args} if end2end else args)
    return build


#: Tokens of one sequence: what each GPU holds in torchtitan's context-parallel rows (its
#: benchmarks/llama3_h100_202412_torchtitan.md, Table 2: 32,768 to 262,144 tokens over 1 to 8 GPUs).
LONG = 32768
CASES = [
    ModelCase("GPT", "GPT-2 small: d 768, 12 heads, vocab 50,304; 8 sequences of 1,024 tokens",
              _on_meta(GPT, GPTConfig(vocab_size=50304, seq_len=1024, n_layer=1, d_model=768, n_head=12), 8,
                       end2end=True)),
    ModelCase("Llama", "d 4,096, 32 heads (8 key/value), MLP 8,192, vocab 128,256, causal SDPA; "
                       "1 sequence of 4,096 tokens",
              _on_meta(Llama, LlamaConfig(vocab_size=128256, seq_len=4096, n_layer=1, d_model=4096, n_head=32,
                                          n_kv_head=8, sdpa=True), 1, end2end=False)),
    ModelCase("Llama, long", f"the same Llama's attention over 1 sequence of {LONG:,} tokens",
              _on_meta(Llama, LlamaConfig(vocab_size=256, seq_len=LONG, n_layer=1, d_model=4096, n_head=32,
                                          n_kv_head=8, sdpa=True), 1, end2end=False), ("attention",)),
]
SMALL = [
    ModelCase("GPT", "d 64, 4 heads, vocab 256; 2 sequences of 32 tokens",
              _on_meta(GPT, GPTConfig(vocab_size=256, seq_len=32, n_layer=1, d_model=64, n_head=4), 2, end2end=True)),
    ModelCase("Llama", "d 64, 4 heads (2 key/value), vocab 256, causal SDPA; 1 sequence of 32 tokens",
              _on_meta(Llama, LlamaConfig(vocab_size=256, seq_len=32, n_layer=1, d_model=64, n_head=4, n_kv_head=2,
                                          sdpa=True), 1, end2end=False)),
]


def timed_calls(case: ModelCase) -> List[OpCall]:
    """One ``OpCall`` per distinct shape of each linear layer (a product) and attention of
    ``case``'s plan on one device, of the kinds ``case.ops`` names."""
    model, args = case.build()
    plan = nbscaler.plan(model, args, "dp", ComputeConfig(1, 1))
    seen: Dict[Tuple, OpCall] = {}
    for op in run_local(plan.programs[0].sections[0]).ops:
        node = op.node
        if node.op in case.ops and (node.op == "attention" or node.meta.get("product")):
            seen.setdefault((node.op, op.in_shapes, op.out_shapes), op)
    return list(seen.values())


def linear_calls(case: ModelCase) -> List[OpCall]:
    return [op for op in timed_calls(case) if op.node.op == "linear"]


def mkn(op: OpCall) -> Tuple[int, int, int]:
    """The product's rows, inner size and columns."""
    x, w = op.in_shapes[0][0], op.in_shapes[1][0]
    return math.prod(x[:-1]), w[1], w[0]


def time_float8(m: int, k: int, n: int, device: torch.device, repeats: int = REPEATS) -> Tuple[float, float]:
    """Median forward and backward seconds of nbscaler's fp8 product (tensorwise) of an ``(m, k)``
    input by a ``(k, n)`` weight, in bf16, on ``device`` (``repeats`` timed runs)."""
    from nbscaler.runtime.float8 import Float8Product
    x = torch.randn(m, k, dtype=torch.bfloat16, device=device, requires_grad=True)
    w = torch.randn(k, n, dtype=torch.bfloat16, device=device, requires_grad=True)
    grad = torch.ones(m, n, dtype=torch.bfloat16, device=device)
    fwd, bwd = [], []
    for i in range(repeats + 3):
        sync(device)
        start = time.perf_counter()
        out = Float8Product.apply(x, w, Float8Scaling.TENSORWISE.value, {})
        sync(device)
        middle = time.perf_counter()
        out.backward(grad)
        sync(device)
        end = time.perf_counter()
        if i >= 3:
            fwd.append(middle - start)
            bwd.append(end - middle)
        x.grad = w.grad = None
    return statistics.median(fwd), statistics.median(bwd)


@dataclass
class Row:
    model: str
    module: str
    mkn: Tuple[int, int, int]
    predicted_bf16: float       # forward + backward seconds
    measured_bf16: float
    predicted_fp8: float
    measured_fp8: Optional[float]


@dataclass
class AttentionRow:
    model: str
    shape: Tuple[int, ...]      # the queries' (B, heads, T, head size)
    keys: Tuple[int, ...]       # the keys'
    predicted: float            # forward + backward seconds
    measured: float
    kernels: str                # the longest kernels of one forward and backward: which one SDPA chose


def attention_kernels(op: OpCall, device: torch.device, top: int = 2) -> str:
    """The names of the ``top`` longest kernels (on a CPU, ops) of one forward and backward of
    ``op``'s attention on ``device``: which of its kernels ``scaled_dot_product_attention`` chose."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v = (torch.randn(shape, dtype=dtype, device=device, requires_grad=True)
               for shape, dtype, _ in op.in_shapes[:3])
    causal = arg(op.node, 5, "is_causal", False)
    F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()       # loads the kernels
    on_gpu = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])) as prof:
        F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()
        sync(device)
    spent = (lambda e: e.self_device_time_total) if on_gpu else (lambda e: e.self_cpu_time_total)
    longest = sorted(prof.key_averages(), key=spent, reverse=True)[:top]
    return "; ".join(f"`{e.key[:70]}`" for e in longest)


def measured_seconds(op: OpCall, device: torch.device, overhead_s: float) -> float:
    """Forward and backward seconds of ``op`` on ``device`` by nbscaler's profiler (``time_op``), the
    autograd engine's start-up (``overhead_s``, ``engine_overhead_s``) taken out as ``OpProfiler`` does."""
    fwd, bwd = time_op(op, device)
    return fwd + max(bwd - overhead_s, 0.0)


def measure_attention(cases: List[ModelCase], hardware: Hardware, device: torch.device) -> List[AttentionRow]:
    """Each distinct attention of ``cases`` in bf16: predicted for ``hardware``, measured on ``device``."""
    roofline, overhead = RooflineOps(hardware), engine_overhead_s(device)
    rows = []
    for case in cases:
        for op in timed_calls(case):
            if op.node.op == "attention":
                rows.append(AttentionRow(case.name, op.in_shapes[0][0], op.in_shapes[1][0], sum(roofline.time(op)),
                                         measured_seconds(op, device, overhead), attention_kernels(op, device)))
                print(f"  {case.name} attention {rows[-1].shape}: {rows[-1].measured * 1e3:.3f} ms", flush=True)
    return rows


def measure(cases: List[ModelCase], hardware: Hardware, device: torch.device, repeats: int = REPEATS) -> List[Row]:
    """Each distinct linear layer of ``cases``: predicted for ``hardware``, measured on ``device``."""
    bf16, fp8 = RooflineOps(hardware), RooflineOps(hardware, float8=Float8Scaling.TENSORWISE)
    overhead = engine_overhead_s(device)
    rows = []
    for case in cases:
        for op in linear_calls(case):
            m, k, n = mkn(op)
            try:
                measured_fp8: Optional[float] = sum(time_float8(m, k, n, device, repeats))
            except (RuntimeError, ImportError) as err:    # no fp8 products on this device, or no torchao
                print(f"  {case.name} {op.node.module_path}: fp8 not measured ({type(err).__name__}: {err})",
                      flush=True)
                measured_fp8 = None
            rows.append(Row(case.name, op.node.module_path, (m, k, n), sum(bf16.time(op)),
                            measured_seconds(op, device, overhead), sum(fp8.time(op)), measured_fp8))
            print(f"  {case.name} {op.node.module_path} {m}x{k}x{n}: bf16 {rows[-1].measured_bf16 * 1e3:.3f} ms",
                  flush=True)
    return rows


def _ms(s: Optional[float]) -> str:
    return "n/a" if s is None else f"{s * 1e3:.4g}"


def _ratio(measured: Optional[float], predicted: float) -> Optional[float]:
    return None if measured is None or not predicted else measured / predicted


def report(rows: List[Row], attention: List[AttentionRow], cases: List[ModelCase], hardware: Hardware,
           hardware_name: str, device: torch.device, command: str) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    same = device.type == "cuda" and hardware_name.split("-")[0] in name
    out = ["# The shipped models' products and attention on a GPU: measured against nbscaler's roofline", "",
           f"`{command}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; torch {torch.__version__}; "
           f"measured on {name}; predicted for `{hardware_name}`"
           + ("." if same else " (**another machine**: the ratios below compare two different devices)."), "",
           "Each row is one distinct linear layer, its forward and backward together (three products), in ms. "
           "Ratio = measured / predicted (above 1: nbscaler's price is too fast).", ""]
    out += [f"- {c.name}: {c.shape}." for c in cases] + [""]
    out += ["| model | layer | m x k x n | bf16 predicted | bf16 measured | ratio | fp8 predicted | fp8 measured | "
            "ratio | fp8 speed-up, predicted | measured |",
            "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        b, f = _ratio(r.measured_bf16, r.predicted_bf16), _ratio(r.measured_fp8, r.predicted_fp8)
        speedup = None if r.measured_fp8 is None else r.measured_bf16 / r.measured_fp8
        out.append(f"| {r.model} | {r.module} | {r.mkn[0]:,} x {r.mkn[1]:,} x {r.mkn[2]:,} | {_ms(r.predicted_bf16)} | "
                   f"{_ms(r.measured_bf16)} | {b:.2f} | {_ms(r.predicted_fp8)} | {_ms(r.measured_fp8)} | "
                   f"{'n/a' if f is None else f'{f:.2f}'} | {r.predicted_bf16 / r.predicted_fp8:.2f} | "
                   f"{'n/a' if speedup is None else f'{speedup:.2f}'} |")
    out += ["", "## Summary", ""] + summary(rows)
    out += attention_table(attention, hardware)
    return "\n".join(out) + "\n"


def attention_table(rows: List[AttentionRow], hardware: Hardware) -> List[str]:
    """Attention's rows, with the share of the bf16 peak each measurement implies."""
    out = ["", "## Attention", "",
           f"Causal `scaled_dot_product_attention` in bf16, forward and backward, in ms. nbscaler prices it as "
           f"FlashAttention at `attention_efficiency` = {hardware.attention_efficiency} of the bf16 peak; the last "
           "column is the efficiency at which that price would equal the measurement (the price scaled by the ratio, "
           "as attention at these sizes is bound by its arithmetic).", "",
           "| model | queries (B, heads, T, head size) | keys | predicted | measured | ratio | implied efficiency | "
           "longest kernels |", "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        ratio = r.measured / r.predicted
        out.append(f"| {r.model} | {r.shape} | {r.keys} | {_ms(r.predicted)} | {_ms(r.measured)} | {ratio:.2f} | "
                   f"{hardware.attention_efficiency / ratio:.2f} | {r.kernels.replace('|', '/')} |")
    return out


def summary(rows: List[Row]) -> List[str]:
    """Median and range of each ratio, and of the whole models' sums (time-weighted)."""
    lines = []
    for label, pred, meas in (("bf16", "predicted_bf16", "measured_bf16"), ("fp8", "predicted_fp8", "measured_fp8")):
        ratios = [getattr(r, meas) / getattr(r, pred) for r in rows if getattr(r, meas) is not None]
        if not ratios:
            lines.append(f"- {label}: not measured.")
            continue
        total_p = sum(getattr(r, pred) for r in rows if getattr(r, meas) is not None)
        total_m = sum(getattr(r, meas) for r in rows if getattr(r, meas) is not None)
        lines.append(f"- {label}: {len(ratios)} layers, measured / predicted median {statistics.median(ratios):.2f} "
                     f"(from {min(ratios):.2f} to {max(ratios):.2f}); all layers together {total_m * 1e3:.3f} ms "
                     f"measured against {total_p * 1e3:.3f} ms predicted, {total_m / total_p:.2f}.")
    return lines


def main(argv: Optional[List[str]] = None) -> int:
    cli = argparse.ArgumentParser(prog="python -m benchmarks.gpu_products", description=__doc__.splitlines()[0])
    cli.add_argument("--hardware", default="H200-SXM-141GB", help="the catalogued GPU to predict for")
    cli.add_argument("--small", action="store_true", help="tiny models (a check that runs anywhere)")
    cli.add_argument("--out", type=Path, default=RESULTS)
    cli.add_argument("--repeats", type=int, default=REPEATS, help="timed runs of each fp8 product")
    args = cli.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cases = SMALL if args.small else CASES
    hardware = Hardware.named(args.hardware)
    rows = measure(cases, hardware, device, args.repeats)
    attention = measure_attention(cases, hardware, device)
    command = "python -m benchmarks.gpu_products" + (" --small" if args.small else "") + \
        ("" if args.hardware == "H200-SXM-141GB" else f" --hardware {args.hardware}")
    args.out.write_text(report(rows, attention, cases, hardware, args.hardware, device, command))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
