"""``Hardware.local()``: this machine described as a ``Hardware``, from what nbscaler measures here.

A plan priced on it takes its op times from the profile and its collective times from the
calibrated alpha-beta model (``is_local=True``), exactly as without hardware; the figures below only
give the ratios a target reports: the peak behind ``mfu`` and ``hfu`` is the fp32 matrix-product
rate measured now (a CPU has no datasheet peak nbscaler could trust), the memory is the host's RAM,
and both links are the collectives' calibration (``1 / beta`` and ``alpha``), since ranks on one
host and ranks on several were not calibrated apart.
"""

from __future__ import annotations

import functools
import os
import time

import torch

from nbscaler.cost import comm_model
from nbscaler.cost.hardware import Hardware, NumberFormat
from nbscaler.cost.speed import device_key, sync


def _best_seconds(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measured_matmul_flops(device: torch.device, n: int = 512, repeats: int = 5) -> float:
    """FLOP/s of an ``n x n`` fp32 matrix product on ``device`` now (the fastest of ``repeats``)."""
    a = torch.randn(n, n, device=device)
    torch.mm(a, a)                                           # warm-up

    def run():
        torch.mm(a, a)
        sync(device)
    return 2 * n ** 3 / _best_seconds(run, repeats)


def measured_copy_bytes_per_s(device: torch.device, nbytes: int = 64 * 2 ** 20, repeats: int = 5) -> float:
    """Bytes/s read and written by a copy of ``nbytes`` on ``device`` now (the fastest of ``repeats``)."""
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)

    def run():
        dst.copy_(src)
        sync(device)
    return 2 * nbytes / _best_seconds(run, repeats)


def _memory_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


@functools.lru_cache(maxsize=1)
def local_hardware() -> Hardware:
    """This machine (measured once per process, about a tenth of a second); see the module docstring."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    comm = comm_model.load()
    per_node = torch.cuda.device_count() if device.type == "cuda" else (os.cpu_count() or 1)
    return Hardware(
        name=f"local ({device_key(device)})",
        peak_flops_by_precision={NumberFormat.FP32: measured_matmul_flops(device)},
        memory_bytes=_memory_bytes(device), memory_bytes_per_s=measured_copy_bytes_per_s(device),
        gpus_per_node=per_node,
        intra_node_bytes_per_s=1 / comm.beta_s_per_byte, intra_node_latency_s=comm.alpha_s,
        inter_node_bytes_per_s=1 / comm.beta_s_per_byte, inter_node_latency_s=comm.alpha_s,
        is_local=True,
        source="measured here: fp32 matmul rate, copy bandwidth, host memory, calibrated collectives"
               + ("" if comm.calibrated else " (collectives at their uncalibrated defaults)"))
