"""Context parallelism's attention on this machine's device: each block on a fused kernel, checked
and timed.

Under ``pas_config={"context_parallel": n}`` a device attends its queries to one block of keys at a
time and merges the blocks by their log-sum-exp (``nbscaler.attention``). Without a mask, over
mirrored chunks, each block runs on one of PyTorch's fused kernels (``nbscaler.attention.kernels``:
the CPU's flash kernel; on a GPU the kernel SDPA itself would pick: cuDNN's or FlashAttention-2 in
bf16 and fp16, the memory-efficient kernel in fp32); anything else writes each block's scores out.
This script, on the device it runs on (the GPU where there is one):

1. runs every kind of block a device computes in the load-balanced causal ring (its own chunks
   under the mask; all its queries against a block's first chunk; its second chunk of queries
   against a whole block), merged as the ring merges them, forward and backward, and compares
   them with the same steps on the CPU in fp32 (the CPU's path is the one the multi-rank tests
   hold to one process); and each kind of context parallelism on one device end to end against
   ``F.scaled_dot_product_attention``. Tolerances: 4 units of roundoff of the dtype's (every input
   is rounded once to it), 1e-5 in fp32 (the project's fp32 oracle);
2. times one device's causal attention over a long sequence, forward and backward (Llama-3-8B's
   heads: 32 query heads sharing 8 key-value heads of 128 channels, bf16): SDPA itself, the ring
   on fused blocks, and the written-out blocks where their scores fit.

Every figure and verdict is computed here.

    python -m benchmarks.gpu_context                   # on a GPU: benchmarks/results/gpu_context.md
    python -m benchmarks.gpu_context --small --out /tmp/c.md
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from nbscaler.attention import context_attention
from nbscaler.attention.fused import _expand_heads, _fused_backward_step, _fused_forward_step
from nbscaler.attention.kernels import kernel_of
from nbscaler.blocks import MIRRORED

RESULTS = Path(__file__).parent / "results" / "gpu_context.md"
#: The ring's steps as the load-balanced causal mask leaves them (``nbscaler.attention.fused._fused_work``).
STEPS = (("causal",), ("all",), ("causal", "first_keys"), ("causal", "last_queries"))
#: (dtype, head channels): each GPU kernel, and heads that are not a multiple of 8 (padded).
CHECKED = ((torch.bfloat16, 20), (torch.float32, 20), (torch.bfloat16, 64), (torch.float16, 64),
           (torch.float32, 64), (torch.bfloat16, 128))
#: Llama-3-8B's attention: query heads, key-value heads, channels a head (Meta's released
#: ``Meta-Llama-3-8B`` config: 32 heads, 8 key-value heads, width 4,096).
HEADS, KV_HEADS, HEAD = 32, 8, 128
LENGTHS = (8192, 32768)
WRITTEN_MAX = 8192          # written-out blocks keep (heads, T, T) fp32 scores: 16 GiB here, 128 GiB at 32,768


def tolerance(dtype: torch.dtype) -> float:
    """4 units of roundoff of ``dtype`` (1e-5 in fp32: the fp32 oracle's)."""
    return 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps / 2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _steps(q, k, v, dout, works: Tuple[str, ...]) -> Tuple[torch.Tensor, ...]:
    """The merged output and log-sum-exp of ``works``' blocks, and their gradients."""
    scale = q.shape[-1] ** -0.5
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    kb, vb = (_expand_heads(t, q.shape[-3]) for t in (k, v))
    for work in works:
        out, lse = _fused_forward_step(q, kb, vb, work, scale, out, lse)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    grads = [_fused_backward_step(dout, q, out.to(q.dtype), lse, k, v, work, scale, dq) for work in works]
    return out, lse, dq, sum(g[0] for g in grads), sum(g[1] for g in grads)


def _kernel(q: torch.Tensor, k: torch.Tensor) -> str:
    """The kernel a block of ``q`` over ``k`` runs on: the blocks' keys come with the queries' heads."""
    keys = _expand_heads(k, q.shape[-3]).detach()
    return str(kernel_of(q.detach(), keys, keys, True))


def check_blocks(device: torch.device, length: int) -> List[Dict[str, object]]:
    """One row per (dtype, head, steps): the worst relative error of the five results against the CPU's fp32."""
    rows = []
    for dtype, head in CHECKED:
        torch.manual_seed(0)
        q = torch.randn(2, 8, length, head).to(dtype)
        k, v = (torch.randn(2, 4, length, head).to(dtype) for _ in range(2))
        dout = torch.randn(2, 8, length, head).to(dtype)
        for works in STEPS:
            here = _steps(*(t.to(device) for t in (q, k, v, dout)), works)
            reference = _steps(*(t.float() for t in (q, k, v, dout)), works)
            errors = [_rel(a, b) for a, b in zip(here, reference)]
            rows.append({"kernel": _kernel(q.to(device), k.to(device)), "dtype": dtype, "head": head, "what": " + ".join(works),
                         "errors": errors, "tolerance": tolerance(dtype)})
    return rows


def check_end_to_end(device: torch.device, length: int) -> List[Dict[str, object]]:
    """Each kind over one device's whole sequence against SDPA in fp32, output and gradients."""
    rows = []
    for dtype, head in CHECKED:
        torch.manual_seed(1)
        q = torch.randn(2, 8, length, head, device=device).to(dtype).requires_grad_()
        k, v = (torch.randn(2, 2, length, head, device=device).to(dtype).requires_grad_() for _ in range(2))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True)
        grad = torch.randn_like(ref)
        want = (ref, *torch.autograd.grad(ref, (q, k, v), grad))
        for kind in ("ring", "all_gather"):
            out = context_attention(q, k, v, is_causal=True, enable_gqa=True, kind=kind, blocks=MIRRORED, group=None)
            got = (out, *torch.autograd.grad(out, (q, k, v), grad.to(dtype)))
            rows.append({"kernel": _kernel(q, k), "dtype": dtype, "head": head, "what": f"{kind}, end to end",
                         "errors": [_rel(a, b) for a, b in zip(got, want)], "tolerance": tolerance(dtype)})
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_long(device: torch.device, length: int, heads: Tuple[int, int, int], written: bool) -> List[Dict[str, object]]:
    """Forward and backward of one device's causal attention over ``length`` tokens, each call the
    second of two runs: seconds, and on a GPU its peak memory above the inputs."""
    h, kvh, d = heads
    torch.manual_seed(2)
    q = torch.randn(1, h, length, d, dtype=torch.bfloat16, device=device, requires_grad=True)
    k, v = (torch.randn(1, kvh, length, d, dtype=torch.bfloat16, device=device, requires_grad=True) for _ in range(2))
    calls = {"F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(
                 q, k, v, is_causal=True, enable_gqa=True),
             "ring, fused blocks": lambda: context_attention(
                 q, k, v, is_causal=True, enable_gqa=True, kind="ring", blocks=MIRRORED, group=None)}
    if written:     # chunks not mirrored (blocks=1): the written-out blocks, as on a device without a kernel
        calls["ring, written-out blocks"] = lambda: context_attention(
            q, k, v, is_causal=True, enable_gqa=True, kind="ring", blocks=1, group=None)
    flops = 3.5 * 4 * h * length * length * d / 2       # causal: the forward's 2 products and the backward's 5, halved
    rows = []
    for name, call in calls.items():
        for _ in range(2):
            _sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            start = time.perf_counter()
            out = call()
            out.backward(torch.ones_like(out))
            _sync(device)
            seconds = time.perf_counter() - start
            q.grad = k.grad = v.grad = None
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2 ** 30 if device.type == "cuda" else None
        rows.append({"length": length, "call": name, "seconds": seconds, "tflops": flops / seconds / 1e12, "peak": peak})
    return rows


def report(checks: List[Dict[str, object]], timed: List[Dict[str, object]], device: torch.device,
           heads: Tuple[int, int, int], command: str) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    met = [r for r in checks if max(r["errors"]) <= r["tolerance"]]
    lines = ["# Context-parallel attention on fused kernels", "",
             f"Device: {name}; torch {torch.__version__}. Run on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.",
             "", f"Command: `{command}`", "", "## Each block against the CPU's, and each kind against SDPA", "",
             "Relative error (the norm of the difference over the reference's) of the merged output, the "
             "log-sum-exp and the gradients of the queries, keys and values.", "",
             "| kernel | dtype | head | blocks | output | log-sum-exp | dq | dk | dv | tolerance | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in checks:
        errs = " | ".join(f"{e:.1e}" for e in r["errors"]) if len(r["errors"]) == 5 else \
            f"{r['errors'][0]:.1e} | - | " + " | ".join(f"{e:.1e}" for e in r["errors"][1:])
        verdict = "within" if max(r["errors"]) <= r["tolerance"] else "**over**"
        lines.append(f"| {r['kernel']} | {str(r['dtype']).removeprefix('torch.')} | {r['head']} | {r['what']} | "
                     f"{errs} | {r['tolerance']:.1e} | {verdict} |")
    lines += ["", f"{len(met)} of {len(checks)} rows within their tolerance.", "",
              f"## One device's causal attention, forward and backward ({heads[0]} query heads sharing {heads[1]} "
              f"key-value heads of {heads[2]} channels, bf16)", "",
              "| tokens | call | ms | TFLOP/s | over SDPA's time | peak above the inputs (GiB) |",
              "| --- | --- | --- | --- | --- | --- |"]
    sdpa = {r["length"]: r["seconds"] for r in timed if r["call"] == "F.scaled_dot_product_attention"}
    for r in timed:
        peak = "-" if r["peak"] is None else f"{r['peak']:.2f}"
        lines.append(f"| {r['length']:,} | {r['call']} | {r['seconds'] * 1e3:.1f} | {r['tflops']:.3g} | "
                     f"{r['seconds'] / sdpa[r['length']]:.2f} | {peak} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    cli = argparse.ArgumentParser(prog="python -m benchmarks.gpu_context", description=__doc__.splitlines()[0])
    cli.add_argument("--small", action="store_true", help="short sequences and small heads (a check that runs anywhere)")
    cli.add_argument("--out", type=Path, default=RESULTS)
    args = cli.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    length = 64 if args.small else 256
    checks = check_blocks(device, length) + check_end_to_end(device, 2 * length)
    heads = (4, 2, 16) if args.small else (HEADS, KV_HEADS, HEAD)
    timed = [row for n in ((128, 256) if args.small else LENGTHS)
             for row in time_long(device, n, heads, written=args.small or n <= WRITTEN_MAX)]
    command = "python -m benchmarks.gpu_context" + (" --small" if args.small else "")
    args.out.write_text(report(checks, timed, device, heads, command))
    print(f"wrote {args.out}")
    return 0 if all(max(r["errors"]) <= r["tolerance"] for r in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
