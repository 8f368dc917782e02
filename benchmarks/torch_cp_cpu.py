"""PyTorch's context-parallel ring attention on the CPU kernel, for ``benchmarks/native.py``'s "cp" rows.

PyTorch 2.13's ``torch.distributed.tensor.experimental.context_parallel`` registers its ring
attention only for the CUDA kernels of ``scaled_dot_product_attention`` (flash, efficient, cuDNN:
the ``custom_ops`` table of ``_context_parallel/_attention.py``). On CPU, SDPA on the sequence-sharded
DTensors it makes lowers to ``aten._scaled_dot_product_flash_attention_for_cpu``, which has no
handler, and the forward fails with ``NotImplementedError: Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy
registered``.

``register_cpu_ring()`` adds two entries to that same table, one for the CPU flash kernel and one for
its backward. Each unwraps the local shards and calls PyTorch's own ``_templated_ring_attention`` /
``_templated_ring_attention_backward`` with the CPU kernel as the per-block op, exactly as PyTorch's
CUDA handlers do with theirs: the load balancing, the rotation (``set_rotate_method``), the
log-sum-exp merge and the gradient ring are PyTorch's. Nothing here is registered on CUDA, where
PyTorch's own handlers apply.
"""

from __future__ import annotations

from typing import Dict, Tuple

import torch

aten = torch.ops.aten
SEQ_DIM = 2                   # (batch, heads, sequence, head dim), as PyTorch's handlers assume

FORWARD_ARGS = ("query", "key", "value", "dropout_p", "is_causal")
BACKWARD_ARGS = ("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal")


def _named(names: Tuple[str, ...], args: tuple, kwargs: Dict[str, object]) -> Dict[str, object]:
    """The op's arguments by name, DTensors as their local shards; and the mesh they live on."""
    from torch.distributed.tensor import DTensor
    named = dict(zip(names, args), **kwargs)
    mesh = next(v.device_mesh for v in named.values() if isinstance(v, DTensor))
    return {k: (v._local_tensor if isinstance(v, DTensor) else v) for k, v in named.items()}, mesh


def _sharded(tensors, mesh) -> tuple:
    from torch.distributed.tensor import DTensor, Shard
    return tuple(DTensor.from_local(t, mesh, [Shard(SEQ_DIM)], run_check=False) for t in tensors)


def _ring_forward(op_call, args, kwargs):
    from torch.distributed.tensor.experimental._context_parallel import _attention
    a, mesh = _named(FORWARD_ARGS, args, kwargs)
    if a.get("attn_mask") is not None:
        raise NotImplementedError("the CPU ring adapter, like PyTorch's CUDA handlers, takes no attn_mask")
    a.pop("attn_mask", None)
    q, k, v = a.pop("query"), a.pop("key"), a.pop("value")
    out, lse = _attention._templated_ring_attention(
        mesh.get_group(), SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu.default,
        q, k, v, is_causal=a.pop("is_causal", False), **a)
    return _sharded((out, lse), mesh)


def _ring_backward(op_call, args, kwargs):
    from torch.distributed.tensor.experimental._context_parallel import _attention
    a, mesh = _named(BACKWARD_ARGS, args, kwargs)
    if a.get("attn_mask") is not None:
        raise NotImplementedError("the CPU ring adapter, like PyTorch's CUDA handlers, takes no attn_mask")
    a.pop("attn_mask", None)
    grads = _attention._templated_ring_attention_backward(
        mesh.get_group(), SEQ_DIM, aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
        grad_out=a.pop("grad_out"), grad_out_name="grad_out", query=a.pop("query"), key=a.pop("key"),
        value=a.pop("value"), out=a.pop("out"), logsumexp=a.pop("logsumexp"), is_causal=a.pop("is_causal"), **a)
    return _sharded(grads[:3], mesh)


def register_cpu_ring() -> bool:
    """Add the CPU kernel's ring handlers to PyTorch's context-parallel table; ``False`` (nothing
    registered) where CUDA runs the model, whose kernels PyTorch handles itself."""
    if torch.cuda.is_available():
        return False
    from torch.distributed.tensor.experimental._context_parallel import _attention
    _attention.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu.default] = _ring_forward
    _attention.custom_ops[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = _ring_backward
    return True
