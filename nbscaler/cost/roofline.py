"""Op times on a target GPU from each op's FLOPs and bytes: a roofline with efficiencies.

Every op, whatever its kind, is limited by its arithmetic or by its memory traffic, whichever is
slower, and never takes less than a kernel's minimum duration::

    t = max(flops / rate, bytes / (memory_bw * MEMORY_EFFICIENCY), KERNEL_FLOOR_S)

Its FLOPs are those the cost pass wrote on its node (``cost.annotate``), so an op with FLOPs is
always bound by them; only the rate depends on its class:

- a **matrix product** (``node.meta["product"]``, ``cost.products``: linear, matmul, bmm,
  ``addmm``, ``baddbmm``, convolutions, a contracting ``einsum``, a registered user op whose
  annotation contracts) runs at ``peak(dtype) * clock * eff``, ``eff`` as below;
- **attention** at ``peak(dtype) * Hardware.attention_efficiency`` (flash), or as its kernels;
- **everything else** at the vector rate, ``Hardware.vector_flops``: the fp32 peak of the CUDA
  cores, where PyTorch computes elementwise ops, norms and reductions of half-precision tensors.

``peak * clock`` is the rate at the clock the GPU holds under sustained load
(``Hardware.sustained_flops``: 1,305 of 1,410 MHz on an A100, the boost clock where no sustained
one is sourced):

- **matrix products** reach at most the GPU's measured matmul ceiling
  (``Hardware.matmul_efficiency``: the best cuBLAS bf16 throughput over a sweep of shapes, 85.9%
  of the peak on an A100 SXM, 80.1% on an H100 SXM, both burst figures at the boost clock) and
  less when small: filling the GPU with tiles and draining the last wave costs about
  ``MATMUL_RAMP_S`` per product, so a product of ``f`` FLOPs takes
  ``f / (peak * clock * eff) + MATMUL_RAMP_S``: its efficiency grows with its size. At the boost
  clock a 1024^3 bf16 product reaches 57% of an A100's peak, a 4096^3 one 85%; at its sustained
  clock 54% and 79%. Each gradient of the backward is one such product, moving the forward's bytes.
- **attention** as the target's software computes it (``Software.attention``):

  - ``flash`` (the default): the FLOPs FlashAttention's kernel performs, ``2 (d + e)`` per
    query-key pair it computes: a causal kernel skips the blocks above the diagonal, so it performs
    ``causal_fraction`` of the pairs (about half; ``node.meta["causal_fraction"]``), a sliding
    window's kernel (``nbscaler.attention.window``) the pairs of its band, never a
    materialised T x T matrix, at ``Hardware.attention_efficiency`` of the boost-clock peak (FlashAttention-2's
    measured fraction on that GPU: 0.55 on the A100, 0.35 on the H100 and H200): that figure was
    measured on real GPUs at whatever clock they held, and on FLOPs that count causal work as half,
    so neither the clock nor the mask is counted again. Its backward recomputes the scores, so it
    runs 2.5 forwards of arithmetic (the four products of the gradients and the scores again); it
    moves q, k, v and the output, and twice that in the backward. MFU still counts the model's
    FLOPs, every pair (``cost.flops``); HFU counts what the kernels perform (``performed_flops``);
  - ``cudnn``: the same kernel's work on cuDNN's faster kernels, its forward and its backward each
    ``attention_speedup`` times FlashAttention-2's rate (measured side by side on the H100);
  - ``materialized``: as frameworks computed it before FlashAttention (Megatron-LM in 2021), five
    kernels in the forward and the backward each: batched products that write or read the
    (B, heads, T, T) scores, each priced as a product *and* by the bytes it moves, whichever is
    slower, and a fused scale-mask-softmax that reads the scores and writes the probabilities
    (its backward reads the probabilities and their gradient and writes the scores' gradient);
    without that fusion (``Software.fused_softmax=False``) the scale, the mask and the softmax
    are three passes over the scores each way. Every pair is computed, masked or not.
    When the software drops attention probabilities (``Software.attention_dropout > 0``, as
    Megatron-LM does with ``--attention-dropout 0.1``) the dropout is one more elementwise kernel:
    its forward reads the probabilities and writes them and the mask (``DROPOUT_MASK_BYTES`` an
    element), its backward reads the gradient and the mask and writes the gradient.
    (FlashAttention drops them on chip, from a regenerated random state: no pass to price.)
- **dropout** (``F.dropout`` in training, ``p > 0``) is PyTorch's fused ``native_dropout`` on a GPU:
  its forward reads the input and writes the output and the mask (``DROPOUT_MASK_BYTES`` an
  element), its backward reads the output's gradient and the mask and writes the input's gradient;
  in eval mode or at ``p = 0`` it returns its input and costs nothing. A dropout traced before a
  residual add (``node.meta["into_add"]``) is its own kernel, then the add its own, unless the
  software fuses them (``Software.fused_bias_dropout_add``, Megatron-LM's ``--bias-dropout-fusion``,
  on by default; Narayanan et al. 2021, section 4.2): the fused kernel reads the input and the
  residual and writes the sum and the mask, ``2 * itemsize`` bytes an element fewer than the two
  kernels (the dropout's output written, then read by the add). The add is priced as it stands;
  the fused dropout adds only its mask, and no launch of its own. In the backward the fused
  kernel's pass is the dropout's: the add's gradient passes through to the residual.
- **everything else** (elementwise, norms, softmax, losses, copies) moves the bytes of its local
  inputs and outputs (far more time than its FLOPs at the vector rate on every catalogued GPU); its
  backward reads the output's gradient and what was saved and writes the inputs' gradients, twice
  the forward's bytes, or its own FLOPs at the vector rate if slower. Views (reshape, transpose, split,
  indexing) launch no kernel and cost nothing. An embedding reads the rows it gathers, not the
  whole table; its backward writes the whole table's gradient.

Constants and their sources:

=======================  =======  ===========================================================
``MATMUL_RAMP_S``        4 us     an estimate, not a measurement: the fill and drain of about
                                  one wave of tiles at full speed (NVIDIA's *Matrix
                                  Multiplication Background User's Guide*, "Wave Quantization",
                                  explains why throughput grows with size; it publishes plots,
                                  not figures to fit)
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
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from nbscaler.cost.flops import attention_flops
from nbscaler.cost.fusion import VIEW_OPS, compiled_unit, kept_in_registers
from nbscaler.cost.hardware import Hardware
from nbscaler.cost.software import AttentionKind
from nbscaler.cost.local import OpCall
from nbscaler.cost.optimizers import step_tensors
from nbscaler.ir.float8_layers import LINEAR, takes_float8
from nbscaler.ir.graph import IRNode
from nbscaler.ir.layer_rules import context_group, context_ring
from nbscaler.ir.shape_rules import arg
from nbscaler.recipe import Float8Scaling, Recipe

_FP8 = torch.float8_e4m3fn
MATMUL_RAMP_S = 4e-6
MEMORY_EFFICIENCY = 0.80
KERNEL_FLOOR_S = 3e-6

#: Flash attention's backward arithmetic in forwards: dV, dP, dQ and dK (two forwards) and the
#: scores recomputed (half of one).
FLASH_BACKWARD_FORWARDS = 2.5

#: cuDNN's attention over FlashAttention-2's, (forward, backward), by head dim: both measured on an
#: H100 SXM5 in BF16 at a sequence of 4k without a mask (Shah et al., "FlashAttention-3", 2024,
#: Figures 5 and 6): head dim 64, forward 408 against 321 TFLOP/s, backward 417 against 279; head dim
#: 128, forward 609 against 368, backward 499 against 310. A head takes the nearest head dim's row; no
#: side-by-side is published for another GPU, so there the H100's ratios stand.
CUDNN_OVER_FLASH2 = {64: (408 / 321, 417 / 279), 128: (609 / 368, 499 / 310)}


def attention_speedup(kind: AttentionKind, head_dim: int) -> Tuple[float, float]:
    """How much faster than FlashAttention-2 (``Hardware.attention_efficiency``) the software's fused
    attention runs its forward and its backward, for heads of ``head_dim`` channels."""
    if kind != AttentionKind.CUDNN:
        return 1.0, 1.0
    return CUDNN_OVER_FLASH2[min(CUDNN_OVER_FLASH2, key=lambda d: (abs(d - head_dim), d))]


#: Bytes a dropout mask keeps an element: PyTorch's ``native_dropout`` saves a ``torch.bool`` mask.
DROPOUT_MASK_BYTES = 1
DROPOUT_TARGET = "torch.nn.functional.dropout"

#: One dynamic fp8 cast of a tensor, kernel by kernel, as (what it reads, what it writes) per element:
#: ``OWN`` the tensor in its own dtype, else a number of bytes (``FP32`` 4, ``FP8`` 1, ``NOTHING`` 0).
#: Eager, torchao 0.18 runs its ops one by one (``tensor_to_amax``, ``amax_to_scale``,
#: ``_ToFloat8ConstrFunc``): ``abs``, the ``amax`` reduction, the upcast to fp32 it makes "to match
#: numerics between eager and compile", the multiply by the scale, the saturating ``clamp`` and the
#: cast to fp8. Compiled, an amax kernel reads the tensor and a cast kernel reads it and writes its
#: fp8 copy.
OWN, FP32, FP8, NOTHING = "own", 4, 1, 0
EAGER_CAST = ((OWN, OWN), (OWN, NOTHING), (OWN, FP32), (FP32, FP32), (FP32, FP32), (FP32, FP8))
COMPILED_CAST = ((OWN, NOTHING), (OWN, FP8))
#: Eager, ``torch._scaled_mm`` takes its first operand row-major and its second column-major, and
#: torchao's fp8 ``mm`` copies an operand that is not (an fp8 read and write per element): the
#: weight in the forward, and the output's gradient and the input for the weight's gradient.
#: Compiled, the copy is taken as fused into the cast kernel, which writes the layout the product needs.
LAYOUT_COPY_BYTES = 2 * FP8

#: Tensors the reducer's copies in and out of its flat buckets read and write per element (the
#: optimizer's own come from ``cost.optimizers.step_tensors``).
REDUCER_TENSORS = 4

#: Passes over the gradients (in the optimizer's dtype) a training loop may add before the step, as
#: tensors read or written per element. Clipping the global norm reads them for the norm and reads and
#: writes them to scale them (``torch.nn.utils.clip_grad_norm_`` always scales; Megatron-LM's
#: ``clip_grad_norm_fp32`` only when the norm is over the bound: counted as always). An fp16 loss scaler
#: unscales them and checks them for infinities in one read and one write
#: (``torch._amp_foreach_non_finite_check_and_unscale_``, which Megatron-LM's fp16 optimizer calls).
#: Each also all-reduces one float over the model-parallel ranks: a few microseconds, not counted.
CLIP_TENSORS = 3
UNSCALE_TENSORS = 2


def _bytes(shapes) -> int:
    return sum(math.prod(s[0]) * s[1].itemsize for s in shapes)


def memory_bytes(op: OpCall, compiled: Optional[Tuple[str, ...]] = None) -> int:
    """Bytes an op's forward moves: its local inputs and outputs; an embedding reads only the rows
    it gathers (its output's worth) and the indices. ``compiled``: the modules a compiler fuses
    (empty: all of them; ``Software.compiled_modules``): less what a fused element-wise chain keeps
    out of memory (``cost.fusion``: inputs made inside the chain, outputs read only there)."""
    outputs = _bytes(op.out_shapes)
    if op.node.op == "embedding":
        return _bytes(op.in_shapes[:1]) + 2 * outputs
    if compiled is None:
        return _bytes(op.in_shapes) + outputs
    reads, kept = kept_in_registers(op.node, compiled)
    if len(reads) != len(op.in_shapes):
        raise ValueError(f"{op.node.name}: {len(op.in_shapes)} local inputs but {len(reads)} fusion flags; "
                         "annotate_costs(graph) again after changing the graph.")
    return _bytes(s for s, fused in zip(op.in_shapes, reads) if not fused) + (0 if kept else outputs)


def backward_bytes(op: OpCall, compiled: Optional[Tuple[str, ...]] = None) -> int:
    """Bytes an op's backward moves: twice its forward's (it reads the output's gradient and what was
    saved, and writes the inputs' gradients); an embedding's writes its whole table's gradient too."""
    if op.node.op == "embedding":
        return _bytes(op.in_shapes[1:2]) + memory_bytes(op)
    return 2 * memory_bytes(op, compiled)


def cast_bytes(elements: int, itemsize: int, compiled: bool) -> List[int]:
    """Bytes each kernel of one dynamic fp8 cast of ``elements`` of ``itemsize`` moves
    (``EAGER_CAST`` or ``COMPILED_CAST``)."""
    size = lambda side: itemsize if side == OWN else side
    return [elements * (size(reads) + size(writes)) for reads, writes in (COMPILED_CAST if compiled else EAGER_CAST)
            if not (reads == OWN and writes == FP32 and itemsize == FP32)]    # an fp32 tensor's upcast is itself


def fp8_product(node: IRNode, recipe_float8: Optional[Float8Scaling], skipped: Tuple[str, ...] = ()) -> bool:
    """Whether a recipe with ``float8`` that leaves out the modules ``skipped`` (``Recipe.float8_skip``)
    takes ``node``'s product in fp8: an ``nn.Linear`` layer's (``ir.float8_layers``)."""
    if recipe_float8 is None or node.target != LINEAR:
        return False
    layer = node.meta.get("linear_layer")
    if layer is None:
        raise ValueError(f"{node.name}: planned before float8 recipes knew which layers are nn.Linear; plan the "
                         "module again (reuse='override') to price Recipe(float8=...).")
    return takes_float8(layer, node.module_path, skipped)


def drops(node: IRNode) -> bool:
    """Whether ``node`` is a dropout that drops: ``F.dropout`` in training with ``p > 0`` (otherwise it
    returns its input, no kernel launched)."""
    return node.target == DROPOUT_TARGET and arg(node, 2, "training", True) and arg(node, 1, "p", 0.5) > 0


def dropout_bytes(elements: int, itemsize: int) -> int:
    """Bytes one pass of ``native_dropout`` moves, forward or backward: a tensor of ``elements`` read and
    one written, and the mask written (forward) or read (backward)."""
    return elements * (2 * itemsize + DROPOUT_MASK_BYTES)


def skips_masked_pairs(hardware: Hardware) -> bool:
    """Whether ``hardware``'s attention kernel skips the pairs a causal mask or a sliding window hides
    (fused kernels do; materialised scores compute every pair, then mask them). Where it does, an
    op's performed FLOPs are its model FLOPs less ``masked_flops``: HFU counts those, MFU every pair."""
    return hardware.software.attention.fused


def masked_flops(meta: Dict, flops: float) -> float:
    """Of ``flops`` counted for an op (its ``node.meta``), those a causal mask hides (zero unless a
    causal attention)."""
    return flops * (1.0 - meta.get("causal_fraction", 1.0))


def matmul_seconds(flops: float, peak: float, efficiency: float) -> float:
    """Seconds of one matrix product of ``flops`` on a GPU of dense ``peak`` FLOP/s whose best
    products reach ``efficiency`` of it."""
    return flops / (peak * efficiency) + MATMUL_RAMP_S if flops else 0.0


def memory_seconds(nbytes: float, bandwidth: float) -> float:
    return nbytes / (bandwidth * MEMORY_EFFICIENCY)


def _whole_keys(op: OpCall) -> List[Tuple]:
    """An attention's queries, keys and values as it computes them: under a context-parallel ring the
    keys and values in hand are one device's block, and the ring brings every other one, so the
    queries meet ``parts`` times as many keys (``nbscaler.attention``)."""
    q, k, v = op.in_shapes[:3]
    if not context_ring(op.node):
        return [q, k, v]
    parts = len(context_group(op.node))
    longer = lambda shape: (*shape[0][:-2], shape[0][-2] * parts, shape[0][-1])
    return [q, (longer(k), *k[1:]), (longer(v), *v[1:])]


class RooflineOps:
    """Op times on ``hardware`` (one GPU), from the op's local shapes and its FLOPs on ``node.meta``."""

    overhead_s = 0.0            # the autograd engine's start-up runs on the host, ahead of the GPU

    def __init__(self, hardware: Hardware, float8: Optional[Float8Scaling] = None, float8_skip: Tuple[str, ...] = ()):
        """``float8`` and ``float8_skip``: the recipe's (``Recipe.float8``): linear layers' products in fp8."""
        self.hardware = hardware
        self.float8, self.float8_skip = float8, tuple(float8_skip)
        software = hardware.software
        self.compiled = software.compiled_modules if software.compiled else None    # None: eager
        if float8 is not None:
            hardware.require_fp8(f"Recipe(float8={float8.value!r})")
        self._times: Dict[Tuple, Tuple[float, float]] = {}   # what ``time`` reads of an op -> its times

    def profile(self, ops: Iterable[OpCall]) -> None:
        """Nothing to measure: a roofline needs only the shapes."""

    def save(self) -> None:
        """Nothing to store."""

    @staticmethod
    def key(op: OpCall) -> Tuple:
        """All ``time`` reads of ``op``: its kind, local shapes, FLOPs and whether it drops (a
        sweep's placements repeat their ops, so their times are worked out once per key)."""
        node = op.node
        meta = node.meta
        return (node.op, node.target, op.in_shapes, op.out_shapes, meta.get("local_flops_fwd"),
                meta.get("local_flops_bwd"), meta.get("flops_fwd"), meta.get("flops_bwd"), meta.get("product"),
                node.target == DROPOUT_TARGET and drops(node), meta.get("causal_fraction", 1.0),
                meta.get("into_add", False), meta.get("fused_reads"), meta.get("fused_readers"), node.module_path)

    def time(self, op: OpCall, key: Optional[Tuple] = None) -> Tuple[float, float]:
        """Forward and backward seconds of ``op`` on one GPU of the target, worked out once per
        ``key`` (``self.key(op)``, which a caller that keeps it may pass)."""
        key = self.key(op) if key is None else key
        if key not in self._times:
            self._times[key] = self._time(op)
        fwd, bwd = self._times[key]
        return fwd * op.scale, bwd * op.scale       # the busiest expert-parallel device's share of a routing

    def _time(self, op: OpCall) -> Tuple[float, float]:
        """Every op by one rule: its arithmetic at its class's rate, its memory traffic or a kernel's
        floor, whichever is slowest, each pass (``_pass``); only the class and the bytes differ."""
        node = op.node
        dtype = next((d for _, d, _ in op.in_shapes if d.is_floating_point), torch.float32)
        grads = any(g for _, _, g in op.in_shapes)
        if node.op in VIEW_OPS or (node.target == DROPOUT_TARGET and not drops(node)):
            return 0.0, 0.0
        if node.op == "attention":
            fwd, bwd = self._attention(op, dtype)
            return fwd, (bwd if grads else 0.0)
        meta = node.meta
        fwd_flops, bwd_flops = meta["local_flops_fwd"], meta["local_flops_bwd"]
        if fp8_product(node, self.float8, self.float8_skip):
            return self._fp8_linear(op, dtype)
        if meta["product"]:                   # the backward's products: one per operand with a gradient
            t = self._pass(fwd_flops, memory_bytes(op), dtype, product=True)
            return t, (meta["flops_bwd"] / meta["flops_fwd"] * t if meta["flops_fwd"] else 0.0)
        if node.target == DROPOUT_TARGET:     # one pass each way, the mask written, then read
            (shape, out_dtype), = op.out_shapes
            elements, item = math.prod(shape), out_dtype.itemsize
            back = self._pass(fwd_flops, dropout_bytes(elements, item), dtype)
            if self.hardware.software.fused_bias_dropout_add and meta.get("into_add", False):
                fwd = memory_seconds(elements * DROPOUT_MASK_BYTES, self.hardware.memory_bytes_per_s)
                return fwd, (back if grads else 0.0)
            return back, (back if grads else 0.0)
        if self.compiled is not None and kept_in_registers(node, self.compiled)[1]:   # inside a chain's kernel
            t = max(fwd_flops / self.hardware.vector_flops(),
                    memory_seconds(memory_bytes(op, self.compiled), self.hardware.memory_bytes_per_s))
            return t, (max(2 * t, bwd_flops / self.hardware.vector_flops()) if grads else 0.0)
        t = self._pass(fwd_flops, memory_bytes(op, self.compiled), dtype)
        if node.op == "embedding":
            bwd = self._pass(bwd_flops, backward_bytes(op), dtype)
        else:                                 # reads the output's gradient and what was saved, writes the inputs'
            bwd = max(2 * t, self._pass(bwd_flops, 0, dtype))
        return t, (bwd if grads else 0.0)

    def _compiles(self, node: IRNode) -> bool:
        """Whether the target's compiler sees ``node`` (``Software.compiled_modules``)."""
        return self.compiled is not None and compiled_unit(node.module_path, self.compiled) is not None

    def _cast(self, shape: Tuple[int, ...], dtype: torch.dtype, compiled: bool) -> float:
        """Seconds of one dynamic fp8 cast of a tensor of ``shape``: its kernels, each memory-bound."""
        bw = self.hardware.memory_bytes_per_s
        return sum(max(memory_seconds(b, bw), KERNEL_FLOOR_S) for b in cast_bytes(math.prod(shape), dtype.itemsize, compiled))

    def _fp8_linear(self, op: OpCall, dtype: torch.dtype) -> Tuple[float, float]:
        """A linear layer with fp8 products, as torchao's float8 training runs it: the forward casts
        the input and the weight and takes one product; the backward casts the output's gradient and
        the weight for the input's gradient, the output's gradient and the input again for the
        weight's, each product at the fp8 peak reading its operands in fp8 and writing in ``dtype``.
        Eager, the operands ``_scaled_mm`` needs in the other layout are copied (``LAYOUT_COPY_BYTES``)."""
        (x, _, x_grad), (w, _, w_grad) = op.in_shapes[:2]
        (out, _), = op.out_shapes[:1]
        flops, h = op.node.meta["local_flops_fwd"], dtype.itemsize
        fp8 = lambda shapes, written: sum(map(math.prod, shapes)) + math.prod(written) * h
        product = lambda operands, written: self._pass(flops, fp8(operands, written), _FP8, product=True)
        compiled = self._compiles(op.node)
        cast = lambda shape: self._cast(shape, dtype, compiled)
        copy = lambda shape: 0.0 if compiled else self._pass(0, math.prod(shape) * LAYOUT_COPY_BYTES, _FP8)
        fwd = cast(x) + cast(w) + copy(w) + product((x, w), out)
        bwd = 0.0
        if x_grad:                            # dX = dY W
            bwd += cast(out) + cast(w) + product((out, w), x)
        if w_grad:                            # dW = dY^T X
            bwd += cast(out) + cast(x) + copy(out) + copy(x) + product((out, x), w)
        return fwd, bwd

    def _pass(self, flops: float, nbytes: float, dtype: torch.dtype, product: bool = False) -> float:
        """Seconds of one kernel: ``flops`` at the matmul rate (``product``) or the vector rate, or its
        memory traffic, or the floor, whichever is slowest."""
        arithmetic = self._matmul(flops, dtype) if product else flops / self.hardware.vector_flops()
        return max(arithmetic, memory_seconds(nbytes, self.hardware.memory_bytes_per_s), KERNEL_FLOOR_S)

    def _matmul(self, flops: float, dtype: torch.dtype) -> float:
        return matmul_seconds(flops, self.hardware.sustained_flops(dtype), self.hardware.matmul_efficiency)

    def _kernel(self, flops: float, nbytes: float, dtype: torch.dtype) -> float:
        """One kernel of products (or of none): ``_pass`` at the matmul rate."""
        return self._pass(flops, nbytes, dtype, product=True)

    def _attention(self, op: OpCall, dtype: torch.dtype) -> Tuple[float, float]:
        """Forward and backward seconds of attention as the target's software computes it: a fused
        kernel (its backward 2.5 forwards of arithmetic over twice the forward's bytes), FlashAttention-2's
        or cuDNN's faster one (``attention_speedup``), or the scores written to memory
        (``_materialized_attention``)."""
        kind = self.hardware.software.attention
        if not kind.fused:
            return self._materialized_attention(op, dtype)
        (q, _, _), (k, _, _), (v, _, _) = _whole_keys(op)
        rate = self.hardware.peak_flops(dtype) * self.hardware.attention_efficiency      # measured: clock and mask included
        performed = attention_flops(q, k, v) * op.node.meta.get("causal_fraction", 1.0)
        arithmetic, bw = performed / rate, self.hardware.memory_bytes_per_s
        faster_fwd, faster_bwd = attention_speedup(kind, q[-1])
        fwd = max(arithmetic / faster_fwd, memory_seconds(memory_bytes(op), bw), KERNEL_FLOOR_S)
        bwd = max(FLASH_BACKWARD_FORWARDS * arithmetic / faster_bwd, memory_seconds(backward_bytes(op), bw),
                  KERNEL_FLOOR_S)
        return fwd, bwd

    def _materialized_attention(self, op: OpCall, dtype: torch.dtype) -> Tuple[float, float]:
        """Forward and backward seconds of attention with the scores written to memory: ``S = Q K^T``,
        ``P = softmax(S)``, ``O = P V``; backward ``dP = dO V^T``, ``dV = P^T dO``, ``dS`` from ``P`` and
        ``dP``, ``dQ = dS K``, ``dK = dS^T Q``; with ``Software.attention_dropout`` one more pass over
        ``P`` each way; without ``Software.fused_softmax`` the scale and the mask are passes of their own."""
        (q, qt, _), (k, _, _), (v, _, _) = _whole_keys(op)
        *lead, t, d = q
        s, e = k[-2], v[-1]
        item = qt.itemsize
        pairs = math.prod(lead) * t * s                          # (B, heads, T, S) scores
        scores = pairs * item
        q_b, k_b, v_b = (math.prod(x) * item for x in (q, k, v))
        o_b = math.prod(lead) * t * e * item
        qk, pv = 2 * pairs * d, 2 * pairs * e
        software = self.hardware.software
        apart = 0.0 if software.fused_softmax else 2 * self._kernel(0, 2 * scores, dtype)  # scale, mask
        fwd = (self._kernel(qk, q_b + k_b + scores, dtype)                     # S = Q K^T
               + self._kernel(0, 2 * scores, dtype) + apart                    # P = softmax(S)
               + self._kernel(pv, scores + v_b + o_b, dtype))                  # O = P V
        bwd = (self._kernel(pv, o_b + v_b + scores, dtype)                     # dP = dO V^T
               + self._kernel(pv, scores + o_b + v_b, dtype)                   # dV = P^T dO
               + self._kernel(0, 3 * scores, dtype)                            # dS from P and dP
               + self._kernel(qk, scores + k_b + q_b, dtype)                   # dQ = dS K
               + self._kernel(qk, scores + q_b + k_b, dtype)                   # dK = dS^T Q
               + apart)                                                        # through the mask, the scale
        if software.attention_dropout > 0:
            dropout = self._kernel(0, dropout_bytes(pairs, item), dtype)               # P -> dropped P, mask
            fwd, bwd = fwd + dropout, bwd + dropout                                    # dP', mask -> dP
        return fwd, bwd

    def update(self, numels: List[int], dtype: torch.dtype, recipe: Recipe) -> float:
        """Seconds of the reducer's copies, the passes over the gradients ``recipe``'s loop makes
        (``Recipe.clip_grad_norm``, ``Recipe.loss_scaling``) and one step of its optimizer over
        parameters of ``numels`` (``dtype``): memory-bound passes over that many tensors per element."""
        tensors = (step_tensors(recipe.optimizer, recipe.kwargs) + REDUCER_TENSORS
                   + CLIP_TENSORS * (recipe.clip_grad_norm is not None)
                   + UNSCALE_TENSORS * (recipe.loss_scaling is not None))
        nbytes = tensors * sum(numels) * dtype.itemsize
        return memory_seconds(nbytes, self.hardware.memory_bytes_per_s) if numels else 0.0
