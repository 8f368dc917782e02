"""A small mixture-of-experts Llama: the shipped ``Llama`` whose SwiGLU MLP is replaced, in every
block, by ``n_experts`` routed SwiGLU experts of which each token uses ``top_k``, plus optional
shared experts that every token uses (as DeepSeek-V3 and Qwen3-MoE have them).

- **Router**: a linear layer scoring every expert, then ``softmax`` (Mixtral, Qwen3-MoE) or
  ``sigmoid`` (DeepSeek-V3) scores; the ``top_k`` best are chosen and their scores, renormalised
  to sum to one, weight the experts' outputs.
- **Routing**: dropless (``capacity_factor=None``: every token served) or with a capacity factor
  (each expert serves at most ``ceil(capacity_factor * T * top_k / n_experts)`` token slots per
  sequence of ``T`` tokens; the rest are dropped). ``nbscaler.experts`` computes both.
- **Load balancing**: the auxiliary loss of Switch Transformer taken per sequence, as DeepSeek-V3
  takes its sequence-wise balance loss: ``n_experts * sum_e f_e * P_e``, ``f_e`` the share of the
  sequence's slots routed to expert ``e`` and ``P_e`` its mean router probability; averaged over
  sequences and blocks, weighted by ``aux_loss_coef`` and added to the next-token loss. Per
  sequence, a loss of a batch is the mean of its sequences' losses, whichever way it is split.

>>> model = MoELlama(MoEConfig(n_layer=2, d_model=64, n_head=4, n_kv_head=2, n_experts=4, top_k=2))
>>> loss = model(**sample_batch(model.config, batch_size=2))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from nbscaler.columns import StrEnum
from nbscaler.experts import capacity_experts, dropless_experts
from nbscaler.models.llama import Attention, Llama, LlamaConfig, RMSNorm, SwiGLU, sample_batch

__all__ = ["MoEConfig", "MoELlama", "Router", "sample_batch"]


class Router(StrEnum):
    """How router logits become scores: ``softmax`` over the experts, or each expert's ``sigmoid``."""

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"


@dataclass
class MoEConfig(LlamaConfig):
    n_experts: int = 4
    top_k: int = 2
    expert_hidden: int = 64         # each routed expert's SwiGLU width
    n_shared_experts: int = 0       # experts every token uses, of the same width, as one SwiGLU
    capacity_factor: Optional[float] = None     # None: dropless
    router: str = Router.SOFTMAX
    aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} must be between 1 and n_experts={self.n_experts}.")
        if self.router not in set(Router):
            raise ValueError(f"MoEConfig.router={self.router!r} is invalid: use one of "
                             f"{', '.join(repr(r.value) for r in Router)}.")
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(f"MoEConfig.capacity_factor={self.capacity_factor!r} must be positive, or None for "
                             "dropless routing.")

    def capacity(self, seq_len: int) -> Optional[int]:
        """Token slots each expert serves per sequence of ``seq_len`` tokens (``None``: dropless)."""
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * seq_len * self.top_k / self.n_experts)


class Experts(nn.Module):
    """``n_experts`` SwiGLU experts with batched weights: ``w1``, ``w3`` ``(E, d, h)``, ``w2`` ``(E, h, d)``."""

    def __init__(self, n_experts: int, d: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, d, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, d, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, d))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Each expert as an ``nn.Linear`` of its shape would start (uniform in ``1/sqrt(fan_in)``)."""
        for w in (self.w1, self.w3, self.w2):
            bound = 1.0 / math.sqrt(w.shape[1])
            nn.init.uniform_(w, -bound, bound)


class MoE(nn.Module):
    """Routed experts (and shared ones) in place of a block's MLP; returns the output and the
    block's load-balancing loss, one per sequence."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = Experts(cfg.n_experts, cfg.d_model, cfg.expert_hidden)
        shared = cfg.n_shared_experts * cfg.expert_hidden
        self.shared = SwiGLU(cfg.d_model, shared) if shared else None

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        cfg = self.cfg
        logits = self.router(x)                                                # (B, T, E)
        scores = logits.softmax(-1) if cfg.router == Router.SOFTMAX else logits.sigmoid()
        top, chosen = scores.topk(cfg.top_k, dim=-1)                           # (B, T, k)
        weights = top / top.sum(-1, keepdim=True)
        w = self.experts
        capacity = cfg.capacity(T)
        if capacity is None:
            out = dropless_experts(x.reshape(B * T, C), weights.reshape(B * T, -1), chosen.reshape(B * T, -1),
                                   w.w1, w.w3, w.w2).view(B, T, C)
        else:
            out = capacity_experts(x, weights, chosen, w.w1, w.w3, w.w2, capacity)
        if self.shared is not None:
            out = out + self.shared(x)
        routed = F.one_hot(chosen, cfg.n_experts).sum(2).float()               # (B, T, E) slots per expert
        share = routed.mean(1) / cfg.top_k                                     # (B, E) f_e per sequence
        probs = (scores / scores.sum(-1, keepdim=True)).mean(1)                # (B, E) P_e per sequence
        return out, cfg.n_experts * (share * probs).sum(-1)                    # (B, T, C), (B,)


class Block(nn.Module):
    def __init__(self, cfg: MoEConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg, cfg.window(layer))
        self.moe_norm = RMSNorm(cfg.d_model)
        self.moe = MoE(cfg)

    def forward(self, x: torch.Tensor, aux: Union[float, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
        """The block's output, and ``aux`` (the load-balancing losses of the blocks before it) plus
        its own: the sum runs inside each block, so every block traces the same ops (a sweep stands
        one block for every later one)."""
        x = x + self.attn(self.attn_norm(x))
        out, block_aux = self.moe(self.moe_norm(x))
        return x + out, aux + block_aux


class MoELlama(Llama):
    """``Llama`` with experts in every block; its loss adds the blocks' load-balancing losses."""

    block = Block

    def __init__(self, cfg: MoEConfig = MoEConfig()):
        super().__init__(cfg)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)                                                   # (B, T, C)
        aux = 0.0
        for block in self.blocks:
            x, aux = block(x, aux)                                            # aux: (B,)
        logits = self.head(self.norm(x))                                      # (B, T, vocab)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return loss + self.config.aux_loss_coef * aux.mean() / len(self.blocks)
