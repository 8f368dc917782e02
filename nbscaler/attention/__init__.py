"""Context parallelism's two calls: attention over a sequence split across devices, and the
loss of a split sequence. Generated code calls them through ``nbscaler.runtime.context``; the
cost model calls the same functions on fake tensors (``group=None``), which is why they live in
this leaf module, below both.

A plan that splits the sequence (``pas_config={"context_parallel": n}``) leaves every op but
attention and the loss on this device's chunks: device ``i`` of ``n`` holds chunks ``i`` and
``2n-1-i`` of ``2n`` (``nbscaler.blocks.MIRRORED``), so under a causal mask each device does the
same work. Attention needs every key:

- ``all_gather`` (Llama 3's way): the keys and values arrive whole, gathered by the generated
  code's ``all_gather_sum_grad`` (its backward reduce-scatters their gradients), and
  ``context_attention`` masks by position: a query at global position ``p`` sees keys ``<= p``.
- ``ring`` (Ring Attention; torchtitan's and Megatron-LM's way): the keys and values stay split.
  Each device computes its queries against the block in hand while it passes that block to the
  next device and receives the previous one's; after ``n`` steps every query has seen every key.
  The blocks are merged by their log-sum-exp (the online softmax), so nothing ``(T, T)`` is kept:
  the forward saves this device's queries, keys, values, output and log-sum-exp, and the backward
  passes the keys and values round the ring again with their gradients, which arrive home after
  ``n`` steps.

Both kinds compute each block one of two ways, chosen by what the call is, never by catching an
error (gathered keys are taken a device's block at a time, as the ring would bring them): without a
mask, over mirrored chunks, on a CPU or a CUDA GPU, they call one of PyTorch's fused kernels per
block (``nbscaler.attention.kernels``: the CPU's flash kernel; on a GPU the one SDPA would pick,
cuDNN's, FlashAttention-2 or the memory-efficient kernel), and do only the work the causal mask
leaves: the first step its own chunks under a causal mask; each later step,
with keys from a device before it, all its queries against the keys' first chunk (their second is
in every query's future), and with keys from a device after it, its second chunk of queries
against all the keys (its first chunk sees none of them). Anything else (an explicit mask, other
chunkings, other devices) computes every block in full with the mask written out (``_block``), the
math of the same online softmax.

``group=None`` is a ring of one device: the cost model calls it so on fake tensors, to learn
what the ring saves.

The loss of the whole sequence is ``nbscaler.runtime.losses.split_cross_entropy``: each device's
tokens' part of the mean.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from nbscaler.attention.fused import _FusedGatheredAttention, _FusedRingAttention, fused_ring
from nbscaler.attention.online import Group, positions
from nbscaler.attention.written import _RingAttention
from nbscaler.blocks import Blocks
from nbscaler.layouts import ContextKind

__all__ = ["context_attention", "fused_ring", "positions"]


def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
                      dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                      enable_gqa: bool = False, *, kind: str, blocks: Blocks, group: Group) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of this device's queries, at their global positions.

    ``q`` ``(..., h, Tq, d)`` holds this device's rows of the sequence (``blocks``, of the devices of
    ``group``); ``attn_mask`` its rows too, with every key column. Under ``kind='all_gather'`` ``k``
    and ``v`` are whole; under ``'ring'`` they are this device's rows, passed round the group.
    """
    if dropout_p:
        raise ValueError("context_attention: attention dropout under context parallelism is not supported; "
                         "set the attention's dropout to 0 or plan without context_parallel.")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if kind == ContextKind.RING:
        if fused_ring(q, attn_mask, blocks):
            return _FusedRingAttention.apply(q, k, v, is_causal, scale, group)
        return _RingAttention.apply(q, k, v, attn_mask, is_causal, scale, blocks, group)
    if fused_ring(q, attn_mask, blocks):
        return _FusedGatheredAttention.apply(q, k, v, is_causal, scale, group)
    return _RingAttention.apply(q, k, v, attn_mask, is_causal, scale, blocks, group, True)
