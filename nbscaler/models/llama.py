"""A small Llama-style decoder: RMSNorm, rotary position embeddings (RoPE), grouped-query attention
(GQA) and a SwiGLU MLP, with the next-token loss inside ``forward``.

It is the second model of the demo, the benchmarks and the equivalence tests, because it exercises
what the GPT does not: normalisation without a bias, key/value heads shared by several query heads,
non-persistent buffers (the rotary tables) and three-matrix MLPs. With ``sliding_window`` its layers
(all, or every other one as GPT-OSS's) attend over the latest keys only (``nbscaler.attention.window``).

>>> model = Llama(LlamaConfig(n_layer=2, d_model=64, n_head=4, n_kv_head=2))
>>> loss = model(**sample_batch(model.config, batch_size=2))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from nbscaler.attention.window import band, sliding_window_attention
from nbscaler.columns import StrEnum


class WindowLayers(StrEnum):
    """Which layers of a model with a ``sliding_window`` attend over it."""

    ALL = "all"                  # every layer (Mistral 7B)
    ALTERNATE = "alternate"      # the first, third, ...; the others attend over every key (GPT-OSS)


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    seq_len: int = 32
    n_layer: int = 2
    d_model: int = 64
    n_head: int = 4
    n_kv_head: int = 2          # each key/value head serves n_head // n_kv_head query heads
    rope_base: float = 10000.0
    head_dim: Optional[int] = None      # None: d_model // n_head; GPT-OSS's 64 with d_model 2880 is not
    sdpa: bool = False          # F.scaled_dot_product_attention(is_causal=True) for the written-out attention
    sliding_window: Optional[int] = None    # keys a query of a windowed layer sees (None: every earlier key)
    window_layers: str = "all"  # which layers attend over the window: WindowLayers

    def __post_init__(self) -> None:
        if self.n_head % self.n_kv_head or (self.head_dim is None and self.d_model % self.n_head):
            raise ValueError(f"n_head ({self.n_head}) must be a multiple of n_kv_head ({self.n_kv_head}), and "
                             f"d_model ({self.d_model}) a multiple of n_head unless head_dim is given")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window={self.sliding_window!r} must be a positive number of keys, or None")
        if self.window_layers not in set(WindowLayers):
            raise ValueError(f"window_layers={self.window_layers!r} is invalid: use one of "
                             f"{', '.join(repr(w.value) for w in WindowLayers)}")
        if self.head_dim is not None and (self.head_dim <= 0 or self.head_dim % 2):
            raise ValueError(f"head_dim={self.head_dim} must be a positive even number (the rotary embedding "
                             "turns pairs of channels)")

    def window(self, layer: int) -> Optional[int]:
        """The window layer ``layer`` attends over (``None``: full causal attention)."""
        if self.sliding_window is None or (self.window_layers == WindowLayers.ALTERNATE and layer % 2):
            return None
        return self.sliding_window

    @property
    def head_size(self) -> int:
        """Channels of one attention head."""
        return self.head_dim or self.d_model // self.n_head


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(d))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings and a causal mask, over the latest ``window``
    keys when it has one."""

    def __init__(self, cfg: LlamaConfig, window: Optional[int] = None):
        super().__init__()
        self.n_head, self.n_kv_head, self.hd, self.sdpa = cfg.n_head, cfg.n_kv_head, cfg.head_size, cfg.sdpa
        self.window = window
        self.q = nn.Linear(cfg.d_model, cfg.n_head * self.hd, bias=False)
        self.k = nn.Linear(cfg.d_model, cfg.n_kv_head * self.hd, bias=False)
        self.v = nn.Linear(cfg.d_model, cfg.n_kv_head * self.hd, bias=False)
        self.o = nn.Linear(cfg.n_head * self.hd, cfg.d_model, bias=False)
        self.seq_len, self.rope_base = cfg.seq_len, cfg.rope_base
        self.register_buffer("cos", torch.empty(cfg.seq_len, self.hd), persistent=False)    # (T, hs)
        self.register_buffer("sin", torch.empty(cfg.seq_len, self.hd), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Compute this module's own tensors, the rotary tables, where they live (the projections
        reset themselves). On the meta device this does nothing, and a rank that materialises the
        module calls it again on real memory: the tables are computed, never loaded."""
        inv = 1.0 / (self.rope_base ** (torch.arange(0, self.hd, 2, device=self.cos.device).float() / self.hd))
        freqs = torch.outer(torch.arange(self.seq_len, device=self.cos.device).float(), inv)   # (T, hs/2)
        emb = torch.cat((freqs, freqs), dim=-1)                                                  # (T, hs)
        self.cos.copy_(emb.cos())
        self.sin.copy_(emb.sin())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.n_head, self.hd).transpose(1, 2)        # (B, nh, T, hs)
        k = self.k(x).view(B, T, self.n_kv_head, self.hd).transpose(1, 2)     # (B, nkv, T, hs)
        v = self.v(x).view(B, T, self.n_kv_head, self.hd).transpose(1, 2)     # (B, nkv, T, hs)
        cos, sin = self.cos[:T], self.sin[:T]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.n_head // self.n_kv_head
        k = k.repeat_interleave(rep, dim=1)                                   # (B, nh, T, hs)
        v = v.repeat_interleave(rep, dim=1)
        if self.sdpa and self.window:
            y = sliding_window_attention(q, k, v, window=self.window)         # (B, nh, T, hs)
        elif self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)       # (B, nh, T, hs)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)              # (B, nh, T, T)
            if self.window:
                mask = ~band(T, T, self.window, att.device)                   # (T, T) True: not in the window
            else:
                mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=att.device), diagonal=1)
            att = att.masked_fill(mask, float("-inf"))
            y = F.softmax(att, dim=-1) @ v                                    # (B, nh, T, hs)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg, cfg.window(layer))
        self.mlp_norm = RMSNorm(cfg.d_model)
        self.mlp = SwiGLU(cfg.d_model, 2 * cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    block = Block           # what each layer is (``nbscaler.models.moe`` swaps in one with experts)

    def __init__(self, cfg: LlamaConfig = LlamaConfig()):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(self.block(cfg, i) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)                                                   # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))                                      # (B, T, vocab)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def sample_batch(cfg: LlamaConfig, batch_size: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Forward arguments: random tokens, and the same tokens shifted by one as targets."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=g)
    return {"idx": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}
