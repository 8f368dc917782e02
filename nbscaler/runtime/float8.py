"""fp8 products for generated code: ``float8_linear``, what ``Recipe(float8=...)`` turns a linear
layer's ``F.linear`` into.

The numerics are torchao's float8 training (``torchao.float8``): each operand of each of a linear
layer's three products (the output; in the backward, the input's and the weight's gradients) is
cast to fp8 with a scale from its largest magnitude, per tensor (``tensorwise``) or per row along
the product's inner dimension (``rowwise``); the product is taken in fp8 with an output in the
input's dtype. torchao's recipe (``Float8LinearConfig.from_recipe_name``) chooses each cast's fp8
type and granularity, the backward's included (tensorwise: e4m3 forward, e5m2 gradients).

What this module adds is the parallel part. A rank may hold a slice of an operand: the batch (a
data split), the inner dimension (a row-parallel weight and its input) or the output features (a
column-parallel weight and its gradient). A scale taken from a slice would differ from the one a
single process takes from the whole tensor, so each largest magnitude is first reduced (max) over
the group of every split dimension it spans. With those scales every rank casts its slice exactly
as one process casts the whole tensor, and a parallel run equals the one-process fp8 run up to the
order of its sums.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Optional, Tuple

import torch
import torch.distributed as dist

#: The dimensions of a linear layer's product ``(..., K) x (N, K) -> (..., N)``: its rows (the
#: batch and sequence, ``m``), its inner dimension (``k``, the input features) and its columns
#: (``n``, the output features). Generated code names the group splitting each.
DIMS = ("m", "k", "n")


def require_torchao() -> Any:
    """``torchao.float8``, or an ImportError that says how to install it."""
    try:
        import torchao.float8 as float8
    except ImportError as err:
        raise ImportError("Recipe(float8=...) computes linear layers with torchao's float8 training, and torchao "
                          "is not installed: pip install 'nbscaler[float8]' (torchao>=0.18), naming your torch "
                          "version in the same command so that pip keeps it, e.g. "
                          "pip install torch==2.13.0 torchao==0.18.0.") from err
    return float8


@functools.lru_cache(maxsize=None)
def recipe_config(scaling: str) -> Tuple[Any, Any]:
    """torchao's ``Float8LinearConfig`` of recipe ``scaling`` ('tensorwise' or 'rowwise') and the
    ``LinearMMConfig`` of its three products (as torchao's ``Float8Linear`` builds it)."""
    require_torchao()
    from torchao.float8.config import Float8LinearConfig
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig
    config = Float8LinearConfig.from_recipe_name(scaling)
    products = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
    mm = LinearMMConfig(*(ScaledMMConfig(config.emulate, g.use_fast_accum, False, config.pad_inner_dim)
                          for g in products))
    return config, mm


def _cast(t: torch.Tensor, cast: Any, role: Any, dim: int, spans: Tuple[str, ...], groups: Dict[str, Any],
          mm: Any, round_pow2: bool) -> torch.Tensor:
    """``t`` in fp8 as ``cast`` (a torchao ``CastConfig``) says. ``dim``: the axis a rowwise scale
    reduces; ``spans``: the product dimension (``DIMS``) each of t's axes stands for, in order, to
    find the groups whose slices the largest magnitude must cover (all of t's for a tensorwise
    scale, ``dim``'s for a rowwise one)."""
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale
    if cast.scaling_type is ScalingType.DISABLED:
        return t
    rowwise = cast.scaling_granularity is ScalingGranularity.AXISWISE
    with torch.no_grad():
        amax = torch.amax(torch.abs(t), dim=dim, keepdim=True) if rowwise else torch.max(torch.abs(t))
        reduced = {spans[dim]} if rowwise else set(spans)
        for name in sorted(reduced):
            if groups.get(name) is not None:      # a slice here: the whole tensor's largest magnitude
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=groups[name])
        scale = amax_to_scale(amax, cast.target_dtype, round_pow2)
    return hp_tensor_and_scale_to_float8(t, scale, cast.target_dtype, mm, role, dim if rowwise else None)


def _spans(ndim: int, last: str) -> Tuple[str, ...]:
    """The product dimension of each axis of a ``(..., last)`` tensor: ``m`` for the leading ones."""
    return ("m",) * (ndim - 1) + (last,)


class Float8Product(torch.autograd.Function):
    """``x @ weight_t`` (``weight_t``: the weight transposed, ``(K, N)``) with each product in
    fp8, the three products' operands cast and scaled as torchao's recipe says, their largest
    magnitudes reduced over ``groups`` (product dimension -> process group or None)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight_t: torch.Tensor, scaling: str,
                groups: Dict[str, Any]) -> torch.Tensor:
        from torchao.float8.float8_training_tensor import GemmInputRole
        config, mm = recipe_config(scaling)
        ctx.save_for_backward(x, weight_t)
        ctx.scaling, ctx.groups = scaling, groups
        pow2 = config.round_scales_to_power_of_2
        x8 = _cast(x, config.cast_config_input, GemmInputRole.INPUT, -1, _spans(x.ndim, "k"),
                   groups, mm, pow2)
        w8 = _cast(weight_t, config.cast_config_weight, GemmInputRole.WEIGHT, 0, ("k", "n"), groups, mm, pow2)
        out = torch.mm(x8.reshape(-1, x.shape[-1]), w8)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight_t = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        # An input that needs no gradient (the model's own) or a frozen weight skips its product. A
        # split backward (B, then W) still gets both each time: autograd tells a Python function what
        # its forward's inputs required, not what this backward call asks for.
        want_x, want_w = ctx.needs_input_grad[:2]
        grad_x = _input_grad(g2, weight_t, ctx).reshape(x.shape) if want_x else None
        grad_w = _weight_grad(g2, x.reshape(-1, x.shape[-1]), ctx).t() if want_w else None
        return grad_x, grad_w, None, None


def _input_grad(g2: torch.Tensor, weight_t: torch.Tensor, ctx: Any) -> torch.Tensor:
    """``grad_out @ weight`` in fp8, as the recipe casts the two for the input's gradient."""
    from torchao.float8.float8_training_tensor import GemmInputRole
    config, mm = recipe_config(ctx.scaling)
    pow2 = config.round_scales_to_power_of_2
    go = _cast(g2, config.cast_config_grad_output, GemmInputRole.GRAD_OUTPUT, -1, ("m", "n"), ctx.groups, mm, pow2)
    w = _cast(weight_t, config.cast_config_weight_for_grad_input, GemmInputRole.WEIGHT, -1, ("k", "n"),
              ctx.groups, mm, pow2)
    return torch.mm(go, w.t())


def _weight_grad(g2: torch.Tensor, x2: torch.Tensor, ctx: Any) -> torch.Tensor:
    """``grad_out.T @ x`` in fp8 (the weight's gradient, ``(N, K)``), cast as the recipe says."""
    from torchao.float8.float8_training_tensor import GemmInputRole
    config, mm = recipe_config(ctx.scaling)
    pow2 = config.round_scales_to_power_of_2
    go = _cast(g2, config.cast_config_grad_output_for_grad_weight, GemmInputRole.GRAD_OUTPUT, 0, ("m", "n"),
               ctx.groups, mm, pow2)
    x = _cast(x2, config.cast_config_input_for_grad_weight, GemmInputRole.INPUT, 0, ("m", "k"), ctx.groups, mm, pow2)
    return torch.mm(go.t(), x)

#: torch._scaled_mm on CUDA takes an fp8 product only when its inner and output dimensions are
#: multiples of this (its own shape check, from cuBLASLt's fp8 alignment rule); a linear layer's three products have the rows (tokens), the input and the
#: output features each as one of those. On the CPU it takes any shape.
CUDA_MULTIPLE = 16


def check_product_shape(rows: int, inner: int, out: int, device_type: str) -> None:
    """A ValueError naming the fix where the device's fp8 kernel cannot take a linear layer's
    products: ``rows`` tokens, ``inner`` input and ``out`` output features as this rank holds them
    (tensor parallelism divides the features, a data or sequence split the rows)."""
    sizes = {"tokens": rows, "input features": inner, "output features": out}
    odd = [f"{n} {name}" for name, n in sizes.items() if n % CUDA_MULTIPLE]
    if device_type == "cuda" and odd:
        raise ValueError(f"an fp8 product on CUDA needs a linear layer's tokens, input and output features to be "
                         f"multiples of {CUDA_MULTIPLE} (torch._scaled_mm), and this rank has {', '.join(odd)}: "
                         "choose sizes (after splitting) that are, or use Recipe(float8=None).")


#: The CUDA compute capability whose tensor cores take fp8 products: Ada (L4, 8.9) and Hopper (H100, 9.0) on
#: (NVIDIA's CUDA C++ Programming Guide, compute capabilities table; torch._scaled_mm refuses older GPUs).
FP8_CAPABILITY = (8, 9)


@functools.lru_cache(maxsize=None)
def check_fp8_device(device: torch.device) -> None:
    """A ValueError naming the fix on a GPU without fp8 tensor cores (an A100, a T4); nothing on the
    CPU, where ``torch._scaled_mm`` computes fp8 products, or on a GPU that has them."""
    if device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ValueError(f"Recipe(float8=...) needs fp8 tensor cores (CUDA compute capability "
                         f"{'.'.join(map(str, FP8_CAPABILITY))} or newer: L4, H100, H200), and {device} is a {name} "
                         f"({'.'.join(map(str, capability))}): use Recipe(float8=None) on it.")


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None, *,
                  scaling: str, m_group: Any = None, k_group: Any = None, n_group: Any = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with its products in fp8 (recipe ``scaling``: 'tensorwise' or
    'rowwise'), the output in ``x``'s dtype. ``m_group`` / ``k_group`` / ``n_group``: the process
    group over which this rank's slice of the rows, inner dimension or output features is split,
    where it is (``DIMS``); scales are then those of the whole tensors."""
    check_fp8_device(x.device)
    check_product_shape(x.numel() // max(x.shape[-1], 1), weight.shape[1], weight.shape[0], x.device.type)
    groups = {"m": m_group, "k": k_group, "n": n_group}
    out = Float8Product.apply(x, weight.t(), scaling, groups)
    return out if bias is None else out + bias.to(out.dtype)

