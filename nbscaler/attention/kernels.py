"""One block of attention on PyTorch's fused kernels, forward and backward, with its log-sum-exp.

The ring and gathered keys (``nbscaler.attention.fused``) attend a device's queries to one block of
keys at a time and merge the blocks by their log-sum-exp, so each block needs a kernel that returns
it, and a backward that takes the *merged* output and log-sum-exp (the gradient of a block is then
its share of the whole attention's). PyTorch's fused kernels do both:

- on a CPU, ``aten._scaled_dot_product_flash_attention_for_cpu`` (any float dtype);
- on a CUDA GPU, the kernel ``F.scaled_dot_product_attention`` itself would pick for the block
  (``torch._fused_sdp_choice``, which honours ``torch.nn.attention.sdpa_kernel``): cuDNN's
  attention (``aten._scaled_dot_product_cudnn_attention``, what SDPA runs in bf16 on a Hopper GPU),
  FlashAttention-2 (``aten._scaled_dot_product_flash_attention``), or otherwise the
  memory-efficient kernel (``aten._scaled_dot_product_efficient_attention``, fp32 too), whose
  log-sum-exp is padded to a multiple of 32 rows. As PyTorch's own context parallelism does.

The GPU kernels read heads in multiples of 8 channels: a head of another size is padded with
zeros, as SDPA pads it (the scale stays the caller's). None keeps anything ``(Tq, Tk)``.
``has_block_kernels`` says whether a device has such kernels; where it has none, the ring writes each
block out (``nbscaler.attention.online``).
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from nbscaler.columns import StrEnum

Pair = Tuple[torch.Tensor, torch.Tensor]
Triple = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]
A = torch.ops.aten


class BlockKernel(StrEnum):
    """The fused kernel one block of attention runs on (``kernel_of``)."""

    CPU_FLASH = "cpu_flash"
    CUDA_CUDNN = "cuda_cudnn"
    CUDA_FLASH = "cuda_flash"
    CUDA_EFFICIENT = "cuda_efficient"


#: SDPA's choice on a GPU -> the kernel a block runs on (any other choice: the efficient kernel).
_CHOSEN = {int(SDPBackend.CUDNN_ATTENTION): BlockKernel.CUDA_CUDNN,
           int(SDPBackend.FLASH_ATTENTION): BlockKernel.CUDA_FLASH}
#: The efficient kernel keeps its log-sum-exp in rows padded to a multiple of this (PyTorch's
#: ``mem_eff_attention/kernel_forward.h``, ``kAlignLSE``; its backward refuses another shape).
EFFICIENT_LSE_ROWS = 32
#: The GPU kernels read a head's channels in multiples of this: SDPA pads to it
#: (``aten/src/ATen/native/transformers/attention.cpp``, ``pad_last_dim<8>``), and on an H200 the
#: efficient kernel refused a bf16 head of 20 unpadded ("query is not correctly aligned").
HEAD_MULTIPLE = 8


def has_block_kernels(q: torch.Tensor) -> bool:
    """Whether queries like ``q`` attend their blocks on fused kernels on their device (a CPU or a
    CUDA GPU); ``kernel_of`` says which kernel a block takes."""
    return q.device.type in ("cpu", "cuda")


def kernel_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> BlockKernel:
    """The kernel ``q`` attends the block ``k``, ``v`` on (see the module docstring)."""
    if q.device.type == "cpu":
        return BlockKernel.CPU_FLASH
    if q.device.type != "cuda":
        raise ValueError(f"no fused attention kernel on {q.device.type}: the ring writes its blocks out there "
                         "(nbscaler.attention.online).")
    return _CHOSEN.get(torch._fused_sdp_choice(*_pad(q, k, v), is_causal=causal), BlockKernel.CUDA_EFFICIENT)


def _pad(*tensors: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """``tensors`` with their last axis (a head's channels) padded with zeros to ``HEAD_MULTIPLE``."""
    extra = -tensors[0].shape[-1] % HEAD_MULTIPLE
    return tensors if not extra else tuple(F.pad(t, (0, extra)) for t in tensors)


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> Pair:
    """Attention of ``q`` over the block ``k``, ``v`` (as many heads as ``q``): its output, in ``q``'s
    dtype, and its log-sum-exp ``(..., h, Tq)`` in fp32. ``causal`` masks a square block's future."""
    kernel = kernel_of(q, k, v, causal)
    if kernel == BlockKernel.CPU_FLASH:
        return A._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    head, rows = q.shape[-1], q.shape[-2]
    padded = _pad(q, k, v)
    if kernel == BlockKernel.CUDA_CUDNN:
        out = A._scaled_dot_product_cudnn_attention(*padded, None, True, 0.0, causal, False, scale=scale)
        return out[0][..., :head], out[1].reshape(out[0].shape[:-1])
    if kernel == BlockKernel.CUDA_FLASH:
        out = A._scaled_dot_product_flash_attention(*padded, 0.0, causal, scale=scale)
        return out[0][..., :head], out[1]
    out = A._scaled_dot_product_efficient_attention(*padded, None, True, 0.0, causal, scale=scale)
    return out[0][..., :head], out[1][..., :rows]


def block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, scale: float) -> Triple:
    """The gradients of ``q``, ``k`` and ``v`` of one block, given the whole attention's output
    ``out`` and log-sum-exp ``lse`` (fp32) for these queries and its output's gradient ``dout``.
    No dropout and no packed sequences: the kernels' sequence offsets are left undefined (None) and
    their random state is not read."""
    kernel = kernel_of(q, k, v, causal)
    if kernel == BlockKernel.CPU_FLASH:
        return A._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal,
                                                                      scale=scale)
    head, (tq, tk) = q.shape[-1], (q.shape[-2], k.shape[-2])
    dout, q, k, v, out = _pad(dout, q, k, v, out.to(q.dtype))
    lse, seed = lse.contiguous(), torch.zeros((), dtype=torch.int64, device=q.device)
    if kernel == BlockKernel.CUDA_CUDNN:       # its log-sum-exp as its forward gives it: (..., h, Tq, 1)
        grads = A._scaled_dot_product_cudnn_attention_backward(dout, q, k, v, out, lse.unsqueeze(-1), seed, seed, None,
                                                               None, None, tq, tk, 0.0, causal, scale=scale)
    elif kernel == BlockKernel.CUDA_FLASH:
        grads = A._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, None, None, tq, tk, 0.0,
                                                               causal, None, None, scale=scale)
    else:
        padded = F.pad(lse, (0, -tq % EFFICIENT_LSE_ROWS)).contiguous()
        grads = A._scaled_dot_product_efficient_attention_backward(dout, q, k, v, None, out, padded, seed, seed, 0.0,
                                                                   [True, True, True, False], causal, scale=scale)
    return tuple(g[..., :head] for g in grads[:3])
