"""The experts' products: one grouped product per weight over rows sorted by expert (dropless),
or one batched product per weight over fixed buffers (capacity)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


@torch.library.custom_op("nbscaler::grouped_mm", mutates_args=())
def grouped_mm(rows: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``rows (m, a) @ weights (E, a, b) -> (m, b)``, the rows of run ``e`` (ending at ``offsets[e]``)
    by ``weights[e]``: PyTorch's grouped product. Its own op because PyTorch's shape function for
    ``torch._grouped_mm`` admits bf16 only (its CUDA kernel's rule), while the CPU kernel takes
    fp32, bf16 and fp16: here the shapes are traced for every dtype."""
    return torch._grouped_mm(rows, weights, offs=offsets)


@grouped_mm.register_fake
def _(rows: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], weights.shape[-1])


def _grouped_mm_setup(ctx, inputs, output) -> None:
    rows, weights, offsets = inputs
    ctx.save_for_backward(rows, weights, offsets)


def _grouped_mm_backward(ctx, grad: torch.Tensor):
    rows, weights, offsets = ctx.saved_tensors
    grad = grad.contiguous()
    d_rows = grouped_mm(grad, weights.transpose(-2, -1).contiguous(), offsets)       # (m, a)
    d_weights = torch._grouped_mm(rows.t(), grad, offs=offsets)                      # (E, a, b): run e's rows.T @ grad
    return d_rows, d_weights, None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def grouped_swiglu(rows: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor,
                   offsets: torch.Tensor) -> torch.Tensor:
    """Each expert's SwiGLU over its run of ``rows`` (runs end at ``offsets``): ``(m, d) -> (m, d)``."""
    gate = grouped_mm(rows, w1, offsets)                                       # (m, h)
    up = grouped_mm(rows, w3, offsets)                                         # (m, h)
    return grouped_mm(F.silu(gate) * up, w2, offsets)                          # (m, d)


def batched_swiglu(buffer: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Each expert's SwiGLU over all its slots: ``(E, slots, d) -> (E, slots, d)``."""
    return torch.bmm(F.silu(torch.bmm(buffer, w1)) * torch.bmm(buffer, w3), w2)


def grouped_mm_any_dtype(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor = None, bias=None,
                         out_dtype=None) -> torch.Tensor:
    """``torch._grouped_mm`` in its rows-by-expert form (2-D rows, 3-D weights, offsets) through
    ``grouped_mm``, whose shape function takes every dtype; any other form as ``torch._grouped_mm``.
    Shape-only calls take it in ``torch._grouped_mm``'s place (``FAKE_STAND_INS``): Hugging Face's
    mixture-of-experts models call ``torch._grouped_mm`` on fp32 weights, which its shape function
    refuses although the CPU kernel runs them."""
    if mat_a.dim() != 2 or mat_b.dim() != 3 or offs is None or bias is not None or out_dtype not in (None, mat_a.dtype):
        return torch._grouped_mm(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)
    return grouped_mm(mat_a, mat_b, offs)


FAKE_STAND_INS = {torch._grouped_mm: grouped_mm_any_dtype}
"""Ops whose shape functions refuse what their kernels run, and what shape-only calls (the tracer's
on shapes, the cost model's on fake tensors) call in their place: the same result, the same saved tensors."""
