"""Routed experts: each token's hidden state goes through the ``top_k`` SwiGLU experts its router
chose, and their outputs are added up, weighted by the router.

The experts' weights are batched, ``(E, d, h)`` and ``(E, h, d)``, as Hugging Face and torchtitan
store them. Two ways of routing, both with shapes fixed by the input's (so they trace on shapes
alone, and the plan holds for any routing, not only the one seen when tracing):

- **dropless** (``dropless_experts``): every token is served. The ``B*T*k`` (token, expert) pairs
  are sorted by expert, each expert multiplies its run of rows (``grouped_mm``, PyTorch's grouped product, with
  the runs' ends as offsets: one per weight), and the rows are added back to their
  tokens. How many rows each expert gets depends on the routing, the total never does.
- **capacity** (``capacity_experts``): each expert serves at most ``capacity`` pairs of each
  sequence, in token order; the pairs beyond it are dropped (they add nothing). The pairs are
  placed in an ``(E, B*capacity, d)`` buffer and every expert multiplies all its slots, used or
  not (``torch.bmm``): a fixed amount of work, as a GShard-style layer does.

Both are one op of nbscaler's graph (``register_op``) with one axis a policy may split: the tokens
``n`` (dropless) or the sequences ``b`` (capacity), each device routing its own through every
expert, whose weights it holds whole and whose gradients are summed over the devices. Capacity is
counted per sequence so that splitting the batch changes nothing of what is dropped. The experts'
own axes stay whole: splitting them (expert parallelism, tensor-parallel experts) needs the routing
in the graph, not inside one op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from nbscaler.ir.registry import register_op


@torch.library.custom_op("nbscaler::grouped_mm", mutates_args=())
def grouped_mm(rows: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``rows (m, a) @ weights (E, a, b) -> (m, b)``, the rows of run ``e`` (ending at ``offsets[e]``)
    by ``weights[e]``: PyTorch's grouped product. Its own op because PyTorch's shape function for
    ``torch._grouped_mm`` admits bf16 only (its CUDA kernel's rule), while the CPU kernel takes any
    float dtype: here the shapes are traced for every dtype."""
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


def _swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each expert's SwiGLU over its run of ``x``'s rows (runs end at ``offsets``)."""
    gate = grouped_mm(x, w1, offsets)                                          # (rows, h)
    up = grouped_mm(x, w3, offsets)                                            # (rows, h)
    return grouped_mm(F.silu(gate) * up, w2, offsets)                          # (rows, d)


@register_op("n d^, n k^, n k^, e^ d^ h^, e^ d^ h^, e^ h^ d^ -> n d^", name="dropless_experts")
def dropless_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor,
                     w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """``sum_j weights[t, j] * expert[experts[t, j]](x[t])`` for every token ``t`` (rows of ``x``).

    ``x`` ``(n, d)``; ``weights`` ``(n, k)`` the router's weights of the chosen experts;
    ``experts`` ``(n, k)`` their indices; ``w1``, ``w3`` ``(E, d, h)``; ``w2`` ``(E, h, d)``.
    """
    n, k = experts.shape
    flat = experts.reshape(-1)                                                 # (n*k,) pair -> expert
    order = flat.argsort(stable=True)                                          # pairs sorted by expert
    token = order // k                                                         # (n*k,) pair -> token
    counts = torch.zeros(w1.shape[0], dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))                    # (E,) pairs per expert
    rows = _swiglu(x[token], w1, w3, w2, counts.cumsum(0, dtype=torch.int32))  # (n*k, d)
    rows = rows * weights.reshape(-1)[order].unsqueeze(-1).to(rows.dtype)
    return torch.zeros_like(x).index_add(0, token, rows)                      # (n, d)


@register_op("b t^ d^, b t^ k^, b t^ k^, e^ d^ h^, e^ d^ h^, e^ h^ d^ -> b t^ d^", name="capacity_experts")
def capacity_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w1: torch.Tensor,
                     w3: torch.Tensor, w2: torch.Tensor, capacity: int) -> torch.Tensor:
    """As ``dropless_experts``, but each expert serves at most ``capacity`` (token, expert) pairs of
    each sequence, the first in token order; the others are dropped.

    ``x`` ``(b, t, d)``; ``weights``, ``experts`` ``(b, t, k)``; the weights as in ``dropless_experts``.
    """
    b, t, k = experts.shape
    n_experts = w1.shape[0]
    chosen = F.one_hot(experts.reshape(b, t * k), n_experts)                   # (b, t*k, E)
    slot = ((chosen.cumsum(1) - 1) * chosen).sum(-1)                           # (b, t*k) place in its expert's queue
    kept = slot < capacity
    seq = torch.arange(b, device=x.device).unsqueeze(1)                        # (b, 1)
    # pair -> its row of the (E * b * capacity) buffer; a dropped pair writes a zero row to row 0
    where = (experts.reshape(b, t * k) * b + seq) * capacity + slot.clamp(max=capacity - 1)
    where = torch.where(kept, where, torch.zeros_like(where)).reshape(-1)
    token = (seq * t + torch.arange(t * k, device=x.device) // k).reshape(-1)  # (b*t*k,) pair -> token
    rows = x.reshape(b * t, -1)[token] * kept.reshape(-1, 1).to(x.dtype)
    buffer = torch.zeros(n_experts * b * capacity, x.shape[-1], dtype=x.dtype, device=x.device).index_add(0, where, rows)
    buffer = buffer.view(n_experts, b * capacity, -1)                          # (E, b*capacity, d)
    out = torch.bmm(F.silu(torch.bmm(buffer, w1)) * torch.bmm(buffer, w3), w2)  # (E, b*capacity, d)
    back = out.reshape(n_experts * b * capacity, -1)[where]                    # (b*t*k, d)
    back = back * (weights.reshape(-1) * kept.reshape(-1)).unsqueeze(-1).to(back.dtype)
    return torch.zeros(b * t, x.shape[-1], dtype=x.dtype, device=x.device).index_add(0, token, back).view(b, t, -1)
