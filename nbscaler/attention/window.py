"""Sliding-window attention: each query attends the ``window`` latest keys, up to its own position.

GPT-OSS attends over a window of 128 keys in every other layer, Mistral 7B over 4,096 in all of
them. ``sliding_window_attention`` takes part in torch's ``__torch_function__`` protocol, as
``F.scaled_dot_product_attention`` does, so the tracer records it as one call, and the op registry
annotates it as attention (``ir.registry``, ``ir.layer_rules.window_of``): policies split it by batch
or heads as they split SDPA, and a target prices it as a windowed kernel runs it, the pairs in the
band alone (``cost.flops.causal_fraction``), where an explicit mask would be priced as every pair
computed.

How it runs: on a CPU, PyTorch's fused flash kernel with the band as an additive mask, saving what
that kernel saves for causal attention (queries, keys, values, output and log-sum-exp) and building
the band again in the backward, so nothing ``(T, S)`` is kept between the passes. On any other
device, SDPA with the band as a mask, its forward computed again in the backward for the same
reason (it keeps the queries, keys and values).

>>> q = k = v = torch.randn(1, 2, 8, 4)
>>> y = sliding_window_attention(q, k, v, window=3)          # (1, 2, 8, 4)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch.autograd import Function

A = torch.ops.aten


def band(t: int, s: int, window: int, device=None) -> torch.Tensor:
    """Which keys each query sees, ``(t, s)`` booleans: key ``j`` for query ``i`` when
    ``i - window < j <= i`` (aligned to the top-left corner, as ``is_causal`` is)."""
    i = torch.arange(t, device=device).unsqueeze(1)
    j = torch.arange(s, device=device).unsqueeze(0)
    return (j <= i) & (j > i - window)


def _additive(t: int, s: int, window: int, like: torch.Tensor) -> torch.Tensor:
    """``band`` as the additive mask the fused kernels take: 0 where seen, -inf elsewhere, in ``like``'s dtype."""
    seen = band(t, s, window, like.device)
    return torch.zeros(seen.shape, dtype=like.dtype, device=like.device).masked_fill(~seen, float("-inf"))


class _WindowedAttention(Function):
    """The band's attention; saves no mask (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, k, v, window: int, scale: Optional[float]):
        t, s = q.shape[-2], k.shape[-2]
        ctx.window, ctx.scale = window, scale
        if q.device.type == "cpu":
            out, lse = A._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False,
                                                                     attn_mask=_additive(t, s, window, q), scale=scale)
            ctx.save_for_backward(q, k, v, out, lse)
            return out
        ctx.save_for_backward(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=band(t, s, window, q.device), scale=scale)

    @staticmethod
    def backward(ctx, dout):
        t, s = ctx.saved_tensors[0].shape[-2], ctx.saved_tensors[1].shape[-2]
        if len(ctx.saved_tensors) == 5:
            q, k, v, out, lse = ctx.saved_tensors
            grads = A._scaled_dot_product_flash_attention_for_cpu_backward(
                dout.contiguous(), q, k, v, out, lse, 0.0, False, attn_mask=_additive(t, s, window=ctx.window, like=q),
                scale=ctx.scale)
            return (*grads, None, None)
        q, k, v = (x.detach().requires_grad_(x.requires_grad) for x in ctx.saved_tensors)
        with torch.enable_grad():
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=band(t, s, ctx.window, q.device), scale=ctx.scale)
            needs = [x for x in (q, k, v) if x.requires_grad]
            found = iter(torch.autograd.grad(out, needs, dout))
        return (*(next(found) if x.requires_grad else None for x in (q, k, v)), None, None)


def sliding_window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int,
                             scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention of queries ``(..., h, t, d)`` over keys ``(..., h, s, d)`` and values
    ``(..., h, s, e)``, each query seeing the ``window`` latest keys up to its own position
    (``band``): ``(..., h, t, e)``. ``scale`` as ``F.scaled_dot_product_attention``'s."""
    if torch.overrides.has_torch_function((q, k, v)):       # a tracer or a tensor subclass: one call
        given = {} if scale is None else {"scale": scale}     # the call as written, defaults left out
        return torch.overrides.handle_torch_function(sliding_window_attention, (q, k, v), q, k, v,
                                                     window=window, **given)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"sliding_window_attention: window={window!r} must be a positive number of keys.")
    return _WindowedAttention.apply(q, k, v, window, scale)

