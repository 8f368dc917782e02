"""Real-size op times from runs at small shapes: shrink a free dimension, time, scale.

The profiler (``cost.profile``) times each op at the local shapes a rank runs it with. At real
sizes that is most of the work of pricing a plan on this machine: the output head of Llama-3-70B on
one of 8 tensor-parallel devices is a (2048 x 8192) by (8192 x 16032) product, half a TFLOP
forward, and profiling every distinct op of that plan took minutes. An op's time does not need its
real shape, though, when one of its dimensions only repeats the same work: the tokens of a linear
layer, the heads of attention, the rows of a loss. Halving such a dimension halves the FLOPs and the
bytes that depend on it, and nothing else.

So an op whose forward would be *large* (over ``FLOPS_BUDGET`` FLOPs, or over ``BYTES_BUDGET`` bytes
of the tensors that are not weights) is run at a *proxy* shape instead:

1. **The dimension**, read from the op's annotation (``ir.annotation``): one that is in an activation
   input and in the output (a loss's rows, summed into a scalar, count too), in no weight input (a
   weight keeps the shape the device holds), and not a reduction (``k+``: a shorter reduction is a
   different product). The largest such dimension is taken: for ``linear`` (``'* k+, n k+ -> * n'``)
   the tokens, for a norm or an elementwise op the tokens too.
2. **The size**: the largest that brings the forward under both budgets, with two floors. No
   smaller than ``MIN_EXTENT``: below about 64 rows a CPU product loses throughput (a bf16 (m x 8192)
   by (8192 x 1024) product ran at 145 GFLOP/s for m = 256, 119 for 64, 79 for 16 on this project's
   2-core machine), so a smaller proxy would time another regime. And a tensor over
   ``MIN_TENSOR_BYTES`` stays over it: a CPU allocates large tensors differently (see the constant).
3. **The factors**, forward and backward: the op's FLOPs at the real shape over its FLOPs at the proxy
   shape for products and attention (compute-bound, and their FLOPs are exact from the annotation),
   the bytes ratio for the others (elementwise ops, norms, embeddings, losses: memory-bound, and their
   weights do not shrink, so their bytes do not shrink as their FLOPs do), the bytes counted as the
   roofline counts them (``cost.roofline.memory_bytes``: an embedding reads the rows it gathers, and
   its backward writes its whole table's gradient, which does not shrink).

**Attention** is the exception the annotation cannot see: the causal mask ties the queries ``t`` to
the keys ``s`` (a query attends to the keys before it), so fewer queries alone would run the first
rows of the mask only. Its heads are shrunk when the key-value heads allow it (a group of query heads
per key-value head, kept whole), else ``t`` and ``s`` together, and it is scaled by its FLOPs
(``cost.flops.attention_flops``: ``2 t s (d + e)`` per head).

A view (reshape, transpose, indexing) of large tensors launches no kernel: it is not run, and costs
nothing, as on the roofline. An op with no such dimension (or no annotation) that is still large is not run at all: its time is
its bytes through this device's measured streaming bandwidth plus its FLOPs at its measured product
rate (``Rates``, timed once and cached with the op times), its backward twice its forward as for a
memory-bound op. A proxy whose call fails (a constant argument that spells a shrunk size) falls back
to the same estimate.

The profile table stores the proxy's measurement under the proxy's own key (``cost.profile.op_key``),
and the factor is applied when the real op's time is read: a table entry is always a time measured
at the shape its key names, so a proxy shape that also occurs for real (a smaller model, a shorter
sequence) reads the same, true entry.

The optimizer step after the backward is memory-bound over the device's parameters; over more than
``UPDATE_BUDGET`` elements it is timed with every tensor scaled down alike (``shrink_update``).

>>> proxy = shrink(op)                      # doctest: +SKIP
>>> proxy.dims, proxy.factor, proxy.basis   # 70B's output head: its 2,048 tokens run at 64
(('*1',), (32.0, 32.0), 'flops')
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from dataclasses import dataclass
from enum import StrEnum
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from nbscaler.cost.flops import attention_flops, shape_flops
from nbscaler.cost.local import OpCall
from nbscaler.cost.products import is_product
from nbscaler.cost.roofline import VIEW_OPS, backward_bytes, memory_bytes
from nbscaler.cost.speed import sync
from nbscaler.ir.registry import spec_of

#: Forward FLOPs and forward bytes (inputs and outputs that are not weights) an op may have and still
#: be run at its real shape: about 30 to 80 ms of a CPU core for a product, and a few tenths of a
#: second for a memory-bound op of that many bytes.
FLOPS_BUDGET = 4e9
BYTES_BUDGET = 256 * 2 ** 20
#: The smallest a shrunk dimension is made (see the module's docstring).
MIN_EXTENT = 64
#: A shrunk tensor is kept at least this large when its real one is. On a CPU, glibc serves an
#: allocation over 32 MiB with fresh pages from the kernel, faulted in on first touch, every time, and a
#: step's allocations of that size pay it too; a proxy of smaller tensors reuses the heap's pages and does not. Scaled from
#: 32 MiB proxies, memory-bound ops of 64 MiB to 250 MiB came out 0.05 to 0.55 times their real time here
#: (``benchmarks/results/shrink_accuracy.md``).
MIN_TENSOR_BYTES = 64 * 2 ** 20

#: Parameter elements the optimizer step (``cost.profile.time_update``) is timed over at most: 64 MiB
#: of each fp32 tensor it reads or writes. A real-size device's step (1.1 billion elements for a
#: sixty-fourth of Llama-3-70B) took gigabytes and minutes to time here.
UPDATE_BUDGET = 2 ** 24

def compute_bound(op: OpCall) -> bool:
    """Whether ``op`` is scaled by its FLOPs: a matrix product (``cost.products``) or attention."""
    return op.node.op == "attention" or is_product(op.node)


class Basis(StrEnum):
    """What the proxy's time is multiplied by."""

    AS_IS = "as-is"         # small: run at its real shape
    FLOPS = "flops"         # compute-bound: FLOPs at the real shape over FLOPs at the proxy's
    BYTES = "bytes"         # memory-bound: bytes at the real shape over bytes at the proxy's
    RATES = "rates"         # large and nothing to shrink: priced from measured rates, not run
    VIEW = "view"           # a view of large tensors: no kernel, nothing to time


@dataclass(frozen=True)
class Proxy:
    """How ``op`` is timed: ``run``'s forward and backward times ``factor`` (None for ``Basis.RATES``
    and ``Basis.VIEW``: nothing is run)."""

    op: OpCall
    run: Optional[OpCall]
    dims: Tuple[str, ...]
    factor: Tuple[float, float]      # (forward, backward)
    basis: Basis


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def op_flops(op: OpCall) -> float:
    """Forward FLOPs of ``op`` at its local shapes (``cost.flops``'s count)."""
    if op.node.op == "attention":
        return attention_flops(*(s for s, _, _ in op.in_shapes[:3]))
    return shape_flops(op.node, [s for s, _, _ in op.in_shapes], [s for s, _ in op.out_shapes])


def activation_bytes(op: OpCall) -> int:
    """Forward bytes of ``op``'s local inputs and outputs, weights left out."""
    weights = {i for i, t in enumerate(op.node.inputs) if t.is_weight}
    return (sum(_nbytes(s, d) for i, (s, d, _) in enumerate(op.in_shapes) if i not in weights)
            + sum(_nbytes(s, d) for s, d in op.out_shapes))


def is_large(op: OpCall) -> bool:
    """Whether running ``op`` at its real shape is over the budgets (FLOPs counted for the
    compute-bound ops only: an embedding's annotation sums over its table, which it does not compute)."""
    return (compute_bound(op) and op_flops(op) > FLOPS_BUDGET) or activation_bytes(op) > BYTES_BUDGET


def free_dims(op: OpCall) -> List[str]:
    """Dimensions of ``op`` that may be shrunk, largest first (see the module's docstring)."""
    ann = op.node.annotation
    if ann is None or spec_of(op.node.target) is not None and spec_of(op.node.target).shape_args:
        return []
    names_in = [n or () for n in ann.inputs]
    weights = {name for names, t in zip(names_in, op.node.inputs) if t.is_weight for name in names}
    activations = {name for names, t in zip(names_in, op.node.inputs) if not t.is_weight for name in names}
    outputs = {name for names in ann.outputs if names for name in names}
    summed = op.node.op == "loss"
    free = [n for n in activations - weights - ann.reduce if n in outputs or summed]
    size = _sizes(op)
    return sorted((n for n in free if size.get(n, 1) > 1), key=lambda n: (-size[n], n))


def _sizes(op: OpCall) -> Dict[str, int]:
    """Each annotated name's local size (the largest where a grouped name differs between tensors)."""
    size: Dict[str, int] = {}
    ann = op.node.annotation
    shapes = [s for s, _, _ in op.in_shapes] + [s for s, _ in op.out_shapes]
    for names, shape in zip(list(ann.inputs) + list(ann.outputs), shapes):
        for name, n in zip(names or (), shape):
            size[name] = max(size.get(name, 1), n)
    return size


def _resized(op: OpCall, new: Dict[str, int]) -> OpCall:
    """``op`` with every tensor's dimensions named in ``new`` scaled to it (a tensor whose dimension
    is smaller, a grouped one, keeps its share)."""
    ann, size = op.node.annotation, _sizes(op)

    def shape(names, s):
        return tuple(n * new[name] // size[name] if name in new else n for name, n in zip(names or (), s)) or tuple(s)
    ins = tuple((shape(names, s), d, g) for names, (s, d, g) in zip(ann.inputs, op.in_shapes))
    outs = tuple((shape(names, s), d) for names, (s, d) in zip(ann.outputs, op.out_shapes))
    return dataclasses.replace(op, in_shapes=ins, out_shapes=outs)


def _fits(op: OpCall) -> bool:
    return not is_large(op)


def _largest_tensor(op: OpCall) -> int:
    weights = {i for i, t in enumerate(op.node.inputs) if t.is_weight}
    return max([_nbytes(s, d) for i, (s, d, _) in enumerate(op.in_shapes) if i not in weights]
               + [_nbytes(s, d) for s, d in op.out_shapes])


def _floor_ok(op: OpCall, run: OpCall) -> bool:
    """Whether ``run`` keeps its largest tensor over ``MIN_TENSOR_BYTES`` where ``op``'s is."""
    return _largest_tensor(op) <= MIN_TENSOR_BYTES or _largest_tensor(run) >= MIN_TENSOR_BYTES


def _attention_dims(op: OpCall) -> List[Tuple[str, ...]]:
    """Attention's shrinkable dimensions, in order of preference: the heads when every tensor's
    heads divide into the same groups, else the query and key lengths together."""
    (q, _, _), (k, _, _) = op.in_shapes[:2]
    heads = [("h",)] if len(q) == 4 and q[1] > 1 and k[1] == q[1] else []
    return heads + [("t", "s")]


def _shrink_along(op: OpCall, dims: Tuple[str, ...]) -> Optional[OpCall]:
    """The proxy along ``dims``: the largest common size that fits the budgets, at least ``MIN_EXTENT``
    (or the real size when smaller); None when even that is not smaller than the real op."""
    size = _sizes(op)
    n = min(size[d] for d in dims)
    floor = min(n, MIN_EXTENT)
    lo, hi = floor, n                      # the largest m in [floor, n) whose proxy fits
    best = floor
    while lo <= hi:
        m = (lo + hi) // 2
        if m < n and _fits(_resized(op, {d: m for d in dims})):
            best, lo = m, m + 1
        else:
            hi = m - 1
    while best < n and not _floor_ok(op, _resized(op, {d: best for d in dims})):
        best = min(n, 2 * best)            # the largest tensor back over the floor
    return _resized(op, {d: best for d in dims}) if best < n else None


def shrink(op: OpCall) -> Proxy:
    """How ``op`` is timed: as it is when small, else a proxy shape and its factors, else from rates."""
    if not is_large(op):
        return Proxy(op, op, (), (1.0, 1.0), Basis.AS_IS)
    if op.node.op in VIEW_OPS:
        return Proxy(op, None, (), (0.0, 0.0), Basis.VIEW)
    ann = op.node.annotation
    candidates = _attention_dims(op) if op.node.op == "attention" and ann is not None else [(d,) for d in free_dims(op)]
    for dims in candidates:
        run = _shrink_along(op, dims)
        if run is None:
            continue
        if compute_bound(op):
            ratio = op_flops(op) / op_flops(run)
            return Proxy(op, run, dims, (ratio, ratio), Basis.FLOPS)
        factor = (memory_bytes(op) / memory_bytes(run), backward_bytes(op) / backward_bytes(run))
        return Proxy(op, run, dims, factor, Basis.BYTES)
    return Proxy(op, None, (), (1.0, 1.0), Basis.RATES)


def shrink_update(numels: Sequence[int]) -> Tuple[List[int], float]:
    """Parameter sizes to time an optimizer step over in place of ``numels``, and the factor its time
    is multiplied by: every tensor scaled by the same ratio when there are more than ``UPDATE_BUDGET``
    elements (a step reads and writes each element a fixed number of times: memory-bound, so its time
    goes as the elements; the number of tensors, and each one's fixed cost, is kept)."""
    total = sum(numels)
    if total <= UPDATE_BUDGET:
        return list(numels), 1.0
    small = [max(1, n * UPDATE_BUDGET // total) for n in numels]
    return small, total / sum(small)


def measure_rates(device: torch.device, repeats: int = 5) -> Tuple[float, float]:
    """Seconds per byte streamed (an in-place add over ``BYTES_BUDGET`` of floats, each read and
    written) and seconds per FLOP of a product (square fp32 ones of about ``FLOPS_BUDGET``) on
    ``device``: the medians of ``repeats`` runs, after one to warm up."""
    x = torch.ones(BYTES_BUDGET // 4, device=device)
    n = round((FLOPS_BUDGET / 2) ** (1 / 3))
    a, b = torch.ones(n, n, device=device), torch.ones(n, n, device=device)

    def median_s(fn) -> float:
        times = []
        for _ in range(repeats + 1):
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])
    return median_s(lambda: x.add_(1.0)) / (2 * x.numel() * 4), median_s(lambda: a @ b) / (2 * n ** 3)


def rate_seconds(op: OpCall, per_byte_s: float, per_flop_s: float) -> Tuple[float, float]:
    """Forward and backward seconds of an op priced from rates (``Basis.RATES``): its bytes streamed
    plus its FLOPs at the product rate; its backward moves ``roofline.backward_bytes`` and computes
    twice the forward's FLOPs."""
    fwd = memory_bytes(op) * per_byte_s + op_flops(op) * per_flop_s
    bwd = backward_bytes(op) * per_byte_s + 2 * op_flops(op) * per_flop_s
    return fwd, bwd if any(g for _, _, g in op.in_shapes) else 0.0
