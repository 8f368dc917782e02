"""Op times on a target GPU from each op's FLOPs and bytes: a roofline with efficiencies.

An op on a GPU is limited by its arithmetic or by its memory traffic, whichever is slower, and never
takes less than a kernel's minimum duration::

    t = max(flops / (peak(dtype) * eff), bytes / (memory_bw * MEMORY_EFFICIENCY), KERNEL_FLOOR_S)

``eff`` depends on the kind of op:

- **matrix products** (linear, matmul, conv) reach at most ``MATMUL_EFFICIENCY`` of the dense peak,
  and less when small: filling the GPU with tiles and draining the last wave costs about
  ``MATMUL_RAMP_S`` per product, so a product of ``f`` FLOPs takes ``f / (peak * MATMUL_EFFICIENCY)
  + MATMUL_RAMP_S``: its efficiency ``MATMUL_EFFICIENCY * t / (t + MATMUL_RAMP_S)`` grows with its
  size ``t`` (its time at full speed). A 1024^3 bf16 product on an A100 reaches 55% of the peak, a
  4096^3 one 79%. Each gradient of the backward is one such product.
- **attention** runs as FlashAttention computes it: the full ``2 (d + e)`` FLOPs per query-key pair
  (causal masking is not subtracted, as published FLOP counts do not subtract it), never a
  materialised T x T matrix, at ``ATTENTION_EFFICIENCY``; its backward recomputes the scores, so
  it runs 2.5 forwards of arithmetic (the four products of the gradients and the scores again).
- **everything else** (elementwise, norms, softmax, losses, copies) is bound by memory: the bytes
  of its local inputs and outputs; its backward reads the output's gradient and what was saved and
  writes the inputs' gradients, twice the forward's bytes. Views (reshape, transpose, split,
  indexing) launch no kernel and cost nothing. An embedding reads the rows it gathers, not the
  whole table; its backward writes the whole table's gradient.

Efficiencies and their sources:

=======================  =======  ===========================================================
``MATMUL_EFFICIENCY``    0.80     the largest cuBLAS bf16 products reach about 80% of the dense
                                  peak on an H100 SXM and 85-87% on an A100 SXM (maximum achievable
                                  matmul FLOPS, S. Bekman, *Machine Learning Engineering*, ch.
                                  "Accelerators"); one figure for both, the lower
``MATMUL_RAMP_S``        4 us     about one wave of tiles on an A100 or H100 at full speed
``ATTENTION_EFFICIENCY`` 0.55     FlashAttention-2 (Dao, 2023) reaches 50-73% of the A100's peak
                                  in the forward and less in the backward
``MEMORY_EFFICIENCY``    0.80     streaming kernels reach 80-90% of HBM's datasheet bandwidth
``KERNEL_FLOOR_S``       3 us     the shortest a launched kernel takes end to end on the GPU
=======================  =======  ===========================================================

``RooflineOps`` serves the interface ``cost.profile.OpProfiler`` serves (``profile``, ``time``,
``overhead_s``, ``update``, ``save``), so the step model prices a plan on a target with no op run
on this machine.

>>> ops = RooflineOps(Hardware.named("A100-SXM-80GB"))              # doctest: +SKIP
>>> ops.time(op_call)                                               # (forward s, backward s)
"""

from __future__ import annotations

import math
from typing import Dict, Iterable, List, Tuple

import torch

from nbscaler.cost.flops import attention_flops
from nbscaler.cost.hardware import Hardware
from nbscaler.cost.local import OpCall

MATMUL_EFFICIENCY = 0.80
MATMUL_RAMP_S = 4e-6
ATTENTION_EFFICIENCY = 0.55
MEMORY_EFFICIENCY = 0.80
KERNEL_FLOOR_S = 3e-6

#: Flash attention's backward arithmetic in forwards: dV, dP, dQ and dK (two forwards) and the
#: scores recomputed (half of one).
FLASH_BACKWARD_FORWARDS = 2.5

MATMUL_OPS = frozenset({"linear", "matmul", "conv"})
VIEW_OPS = frozenset({"reshape", "transpose", "getitem", "split", "expand"})

#: Tensors an optimizer step reads and writes per parameter element, the gradient included:
#: SGD reads p and g and writes p; with momentum it also reads and writes its buffer; Adam reads p,
#: g and its two moments and writes p and the moments. The reducer's copies in and out of its flat
#: buckets add two reads and two writes.
OPTIMIZER_TENSORS = {"SGD": 3, "SGD+momentum": 5, "Adam": 7, "AdamW": 7}
REDUCER_TENSORS = 4


def _bytes(shapes) -> int:
    return sum(math.prod(s[0]) * s[1].itemsize for s in shapes)


def matmul_seconds(flops: float, peak: float) -> float:
    """Seconds of one matrix product of ``flops`` on a GPU of dense ``peak`` FLOP/s."""
    return flops / (peak * MATMUL_EFFICIENCY) + MATMUL_RAMP_S if flops else 0.0


def memory_seconds(nbytes: float, bandwidth: float) -> float:
    return nbytes / (bandwidth * MEMORY_EFFICIENCY)


class RooflineOps:
    """Op times on ``hardware`` (one GPU), from the op's local shapes and its FLOPs on ``node.meta``."""

    overhead_s = 0.0            # the autograd engine's start-up runs on the host, ahead of the GPU

    def __init__(self, hardware: Hardware):
        self.hardware = hardware

    def profile(self, ops: Iterable[OpCall]) -> None:
        """Nothing to measure: a roofline needs only the shapes."""

    def save(self) -> None:
        """Nothing to store."""

    def time(self, op: OpCall) -> Tuple[float, float]:
        """Forward and backward seconds of ``op`` on one GPU of the target."""
        node = op.node
        dtype = next((d for _, d, _ in op.in_shapes if d.is_floating_point), torch.float32)
        grads = sum(1 for _, _, g in op.in_shapes if g)
        if node.op in VIEW_OPS:
            return 0.0, 0.0
        if node.op in MATMUL_OPS:             # the backward's products: one per operand with a gradient
            fwd_flops, products = node.meta["local_flops_fwd"], node.meta["flops_bwd"] / max(node.meta["flops_fwd"], 1)
            t = max(matmul_seconds(fwd_flops, self.hardware.peak_flops(dtype)), KERNEL_FLOOR_S)
            return t, products * t
        if node.op == "attention":
            (q, _, _), (k, _, _), (v, _, _) = op.in_shapes[:3]
            flops = attention_flops(q, k, v)
            t = flops / (self.hardware.peak_flops(dtype) * ATTENTION_EFFICIENCY)
            return max(t, KERNEL_FLOOR_S), (max(FLASH_BACKWARD_FORWARDS * t, KERNEL_FLOOR_S) if grads else 0.0)
        fwd_bytes = self._memory_bytes(op)
        t = max(memory_seconds(fwd_bytes, self.hardware.memory_bytes_per_s), KERNEL_FLOOR_S)
        if node.op == "embedding":
            table = _bytes(op.in_shapes[1:2])
            return t, (max(memory_seconds(table + fwd_bytes, self.hardware.memory_bytes_per_s), KERNEL_FLOOR_S)
                       if grads else 0.0)
        return t, (2 * t if grads else 0.0)

    @staticmethod
    def _memory_bytes(op: OpCall) -> int:
        """Bytes an op's forward moves: its local inputs and outputs; an embedding reads only the rows
        it gathers (its output's worth) and the indices."""
        outputs = _bytes(op.out_shapes)
        if op.node.op == "embedding":
            return _bytes(op.in_shapes[:1]) + 2 * outputs
        return _bytes(op.in_shapes) + outputs

    def update(self, numels: List[int], dtype: torch.dtype, optimizer: type, optimizer_kwargs: Dict) -> float:
        """Seconds of the reducer's copies and one optimizer step over parameters of ``numels``
        (``dtype``): memory-bound passes over ``OPTIMIZER_TENSORS`` tensors per element."""
        name = optimizer.__name__
        if name == "SGD" and optimizer_kwargs.get("momentum"):
            name = "SGD+momentum"
        tensors = OPTIMIZER_TENSORS.get(name, OPTIMIZER_TENSORS["Adam"]) + REDUCER_TENSORS
        nbytes = tensors * sum(numels) * dtype.itemsize
        return memory_seconds(nbytes, self.hardware.memory_bytes_per_s) if numels else 0.0
