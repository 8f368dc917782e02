"""Differentiable collectives: what generated code calls where a tensor changes layout.

Each function is a forward collective paired with the collective its gradient needs (see
``nbscaler.comm.layout`` for the layouts). Reading them side by side is a compact lesson in tensor
parallelism:

=========================  =================================  ===================================
function                   forward                            backward
=========================  =================================  ===================================
``all_gather``             concatenate every device's slice   keep this device's slice
``all_gather_sum_grad``    concatenate every device's slice   sum the partial gradients, keep this
                                                              device's slice (a reduce-scatter)
``chunk``                  keep this device's slice           all-gather the slices
``all_reduce``             sum the partial values             pass the (full) gradient through
``reduce_scatter``         sum, then keep this device's slice all-gather
``all_to_all``             re-split along another dim         the reverse re-split
``sum_grad``               pass through                       sum the partial gradients
``first_only``             the value on device 0, else zeros  pass the gradient through
``batch_norm``             BatchNorm with whole-batch stats   sums the statistics' gradients
=========================  =================================  ===================================

``group=None`` means a group of one device, where every function is the identity.

A reduce-scatter and an all-to-all run as ``torch.distributed``'s own (``reduce_scatter_single``,
once ``reduce_scatter_tensor``, and ``all_to_all_single``) unless ``nbscaler.layouts.EMULATED`` says the group's backend has no call
for one, in which case an all-reduce or an all-gather runs and each device keeps its slice: what
runs is what the cost model prices.

``all_gather`` and ``chunk`` take ``blocks`` (``nbscaler.blocks``): the tensor is that many blocks
along ``dim`` (q, k and v of a fused projection, equal or not), each split across the devices, so a
device's slice is its share of every block (its own heads), not one contiguous piece.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd import Function

from nbscaler import blocks as strided
from nbscaler.blocks import Blocks
from nbscaler.layouts import Collective, emulation

Group = Optional[dist.ProcessGroup]


def _size_rank(group: Group):
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _gather(x: torch.Tensor, dim: int, group: Group, blocks: Blocks = 1) -> torch.Tensor:
    size, _ = _size_rank(group)
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    # parts[r] is (block 0 share r, block 1 share r, ...): regrouped block by block
    return strided.join(parts, dim, blocks)


def _slice(x: torch.Tensor, dim: int, group: Group, blocks: Blocks = 1) -> torch.Tensor:
    size, rank = _size_rank(group)
    return strided.take(x, dim, blocks, size, rank).contiguous()


def _sum(x: torch.Tensor, group: Group) -> torch.Tensor:
    out = x.contiguous().clone()
    dist.all_reduce(out, group=group)
    return out


def _runtime_emulates(primitive: Collective, group: Group) -> bool:
    """Whether the group's backend has no call for ``primitive``, so the runtime emulates it."""
    found = emulation(dist.get_backend(group), primitive)
    return found is not None and not found.in_backend


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group: Group) -> None:
    """Sum ``x`` (contiguous, dim 0 ``n`` times ``out``'s) over the group into this device's
    slice ``out``: the backend's reduce-scatter, or where it has none an all-reduce and a copy."""
    if _runtime_emulates(Collective.REDUCE_SCATTER, group):
        _, rank = _size_rank(group)
        out.copy_(_sum(x, group).narrow(0, rank * out.shape[0], out.shape[0]))
    else:
        # torch 2.13 names reduce_scatter_tensor reduce_scatter_single, and the old name warns
        getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)(out, x, group=group)


def _pieces_first(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` cut into ``size`` equal pieces along ``dim``, stacked on a new dim 0, contiguous (as
    the backends need it; no copy for dim 0)."""
    return x.unflatten(dim, (size, -1)).movedim(dim, 0).contiguous()


def _scatter_sum(x: torch.Tensor, dim: int, group: Group, blocks: Blocks = 1) -> torch.Tensor:
    """This device's slice along ``dim`` (its share of each of ``blocks``) of the sum over the group."""
    size, rank = _size_rank(group)
    parts = [strided.take(x, dim, blocks, size, r) for r in range(size)]     # rank r's share, in order
    if len({p.shape for p in parts}) > 1:          # an axis that does not divide: no equal pieces to scatter
        return _slice(_sum(x, group), dim, group, blocks)
    out = torch.empty((1,) + parts[0].shape, dtype=x.dtype, device=x.device)
    reduce_scatter_into(out, torch.stack(parts) if strided.is_strided(blocks) else _pieces_first(x, dim, size), group)
    return out[0]


def _exchange(x: torch.Tensor, split_dim: int, gather_dim: int, group: Group) -> torch.Tensor:
    """Split along ``gather_dim`` -> split along ``split_dim``: piece ``j`` of ``x`` along
    ``split_dim`` goes to device ``j``, and the pieces received are joined along ``gather_dim``."""
    size, _ = _size_rank(group)
    if _runtime_emulates(Collective.ALL_TO_ALL, group) or x.shape[split_dim] % size:
        return _slice(_gather(x, gather_dim, group), split_dim, group)
    send = _pieces_first(x, split_dim, size)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllGather(Function):
    @staticmethod
    def forward(ctx, x, dim, group, blocks):
        ctx.dim, ctx.group, ctx.blocks = dim, group, blocks
        return _gather(x, dim, group, blocks)

    @staticmethod
    def backward(ctx, grad):
        return _slice(grad, ctx.dim, ctx.group, ctx.blocks), None, None, None


class _AllGatherSumGrad(_AllGather):
    """The all-gather whose backward sums the gradient over the group before slicing it (a
    reduce-scatter): its output feeds ops that leave partial gradients, as sequence parallelism's."""

    @staticmethod
    def backward(ctx, grad):
        return _scatter_sum(grad, ctx.dim, ctx.group, ctx.blocks), None, None, None


class _Chunk(Function):
    @staticmethod
    def forward(ctx, x, dim, group, blocks):
        ctx.dim, ctx.group, ctx.blocks = dim, group, blocks
        return _slice(x, dim, group, blocks)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group, ctx.blocks), None, None, None


class _AllReduce(Function):
    @staticmethod
    def forward(ctx, x, group):
        return _sum(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReduceScatter(Function):
    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _scatter_sum(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group), None, None


class _AllToAll(Function):
    @staticmethod
    def forward(ctx, x, split_dim, gather_dim, group):
        ctx.dims, ctx.group = (split_dim, gather_dim), group
        return _exchange(x, split_dim, gather_dim, group)

    @staticmethod
    def backward(ctx, grad):
        split_dim, gather_dim = ctx.dims
        return _exchange(grad, gather_dim, split_dim, ctx.group), None, None, None


class _SumGrad(Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _sum(grad, ctx.group), None


class _FirstOnly(Function):
    @staticmethod
    def forward(ctx, x, group):
        _, rank = _size_rank(group)
        return x.view_as(x) if rank == 0 else torch.zeros_like(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def all_gather(x: torch.Tensor, dim: int, group: Group, blocks: Blocks = 1) -> torch.Tensor:
    """Split along ``dim`` (strided in ``blocks``) -> replicated."""
    return x if group is None else _AllGather.apply(x, dim, group, blocks)


def all_gather_sum_grad(x: torch.Tensor, dim: int, group: Group, blocks: Blocks = 1) -> torch.Tensor:
    """Split along ``dim`` -> replicated, for an op whose devices each make a partial gradient of the
    whole (a column-parallel linear): the backward sums them and keeps this device's slice, a
    reduce-scatter. Sequence parallelism's all-gather before the column-parallel linear."""
    return x if group is None else _AllGatherSumGrad.apply(x, dim, group, blocks)


def chunk(x: torch.Tensor, dim: int, group: Group, blocks: Blocks = 1) -> torch.Tensor:
    """Replicated -> this device's slice along ``dim`` (of each of ``blocks`` equal blocks); no
    communication forward."""
    return x if group is None else _Chunk.apply(x, dim, group, blocks)


def all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Partial sums -> replicated total."""
    return x if group is None else _AllReduce.apply(x, group)


def reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Partial sums -> this device's slice of the total along ``dim``."""
    return x if group is None else _ReduceScatter.apply(x, dim, group)


def all_to_all(x: torch.Tensor, dim: int, dim2: int, group: Group) -> torch.Tensor:
    """Split along ``dim2`` -> split along ``dim``."""
    return x if group is None else _AllToAll.apply(x, dim, dim2, group)


def sum_grad(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward; the backward sums the partial gradients the devices computed."""
    return x if group is None or not x.requires_grad else _SumGrad.apply(x, group)


def first_only(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Keep the value on the group's first device and zeros elsewhere, so a sum counts it once."""
    return x if group is None else _FirstOnly.apply(x, group)


def batch_norm(x: torch.Tensor, running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
               weight: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None, training: bool = False,
               momentum: float = 0.1, eps: float = 1e-5, group: Group = None) -> torch.Tensor:
    """``F.batch_norm`` on a batch split across ``group``, with the statistics of the whole batch.

    Each device sums its share per channel; an all-reduce makes the whole batch's mean, then its
    variance (two passes, as one process computes them). ``sum_grad`` after each all-reduce sums
    the gradients that flow back into the statistics, so the backward equals one process's too.
    Running statistics are updated with the whole batch's mean and unbiased variance, the same on
    every device.
    """
    if group is None or not training:
        return F.batch_norm(x, running_mean, running_var, weight, bias, training, momentum, eps)
    size, _ = _size_rank(group)
    dims = [0] + list(range(2, x.ndim))                       # every axis but the channels
    count = x.numel() // x.shape[1] * size
    shape = [1, -1] + [1] * (x.ndim - 2)                      # (1, C, 1, 1) to broadcast per channel
    mean = sum_grad(all_reduce(x.sum(dims), group), group) / count
    centred = x - mean.view(shape)
    var = sum_grad(all_reduce((centred * centred).sum(dims), group), group) / count
    y = centred * torch.rsqrt(var + eps).view(shape)
    if weight is not None:
        y = y * weight.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    if running_mean is not None and running_var is not None:
        with torch.no_grad():
            running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
            running_var.mul_(1 - momentum).add_(var.detach() * count / max(count - 1, 1), alpha=momentum)
    return y
