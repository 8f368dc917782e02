"""A small GPT, readable in one sitting: the model the demo, the benchmarks and the notebooks use.

Pre-norm transformer blocks (LayerNorm, causal self-attention, GELU MLP), learned position
embeddings, and the next-token loss computed inside ``forward`` so that the module is end2end: the
first argument is the batch, the return value is the loss.

``GPTConfig.dropout`` drops the attention projection's and the MLP's outputs before each residual
add (nanoGPT's residual dropout, Megatron-LM's hidden dropout). At 0, the default, the blocks hold no
dropout module at all: nothing reads ``self.training``, so the model traces once, to the same ops as
a model without the option.

>>> model = GPT(GPTConfig(n_layer=2, d_model=64, n_head=4))
>>> loss = model(sample_batch(model.config, batch_size=2))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 32
    n_layer: int = 2
    d_model: int = 64
    n_head: int = 4
    dropout: float = 0.0        # residual dropout after attention and MLP; 0 builds no dropout at all

    def __post_init__(self) -> None:
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout={self.dropout!r} must be a probability in [0, 1); "
                             "0 turns it off")


def residual_dropout(cfg: GPTConfig) -> Optional[nn.Dropout]:
    """The dropout before a residual add, or ``None`` when ``cfg.dropout`` is 0: an ``nn.Dropout(0)``
    would still read ``self.training`` and make the tracer trace the eval mode apart."""
    return nn.Dropout(cfg.dropout) if cfg.dropout > 0 else None


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.drop = residual_dropout(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = self.proj(y.transpose(1, 2).reshape(B, T, C))                  # (B, T, C)
        return y if self.drop is None else self.drop(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = residual_dropout(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(F.gelu(self.fc(x)))
        return y if self.drop is None else self.drop(y)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.config = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        idx, targets = batch["idx"], batch["targets"]
        T = idx.size(1)
        x = self.tok(idx)                                                   # (B, T, C)
        x = x + self.pos(torch.arange(T, device=x.device))                  # on the weights' device, meta too
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def sample_batch(cfg: GPTConfig, batch_size: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Random tokens, and the same tokens shifted by one as targets."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=g)
    return {"idx": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}
