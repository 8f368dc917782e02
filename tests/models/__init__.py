"""Small real models the equivalence tests run: each builds deterministically from a seed and
comes with a batch maker, so every rank and the single-process reference see the same thing.

``hf`` holds transformers models from tiny configs, ``vision`` convolutional networks built from
ResNet and MobileNetV3 blocks."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from nbscaler import register_op
from tests.models import hf, vision


class MLP(nn.Module):
    def __init__(self, d: int = 16, hidden: int = 32, classes: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x, y):
        h = F.gelu(self.fc1(x))
        h = torch.tanh(self.fc2(h)) + h
        return F.cross_entropy(self.head(h), y)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings and a causal mask."""

    def __init__(self, d: int, n_head: int, n_kv_head: int, max_len: int):
        super().__init__()
        self.n_head, self.n_kv_head, self.hd = n_head, n_kv_head, d // n_head
        self.q = nn.Linear(d, n_head * self.hd, bias=False)
        self.k = nn.Linear(d, n_kv_head * self.hd, bias=False)
        self.v = nn.Linear(d, n_kv_head * self.hd, bias=False)
        self.o = nn.Linear(n_head * self.hd, d, bias=False)
        inv = 1.0 / (10000 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        freqs = torch.outer(torch.arange(max_len).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.n_head, self.hd).transpose(1, 2)
        k = self.k(x).view(B, T, self.n_kv_head, self.hd).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_kv_head, self.hd).transpose(1, 2)
        cos, sin = self.cos[:T], self.sin[:T]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.n_head // self.n_kv_head
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        att = att.masked_fill(mask, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d, hidden, bias=False)
        self.w3 = nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, d, n_head, n_kv_head, max_len):
        super().__init__()
        self.attn_norm = RMSNorm(d)
        self.attn = Attention(d, n_head, n_kv_head, max_len)
        self.mlp_norm = RMSNorm(d)
        self.mlp = SwiGLU(d, 2 * d)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """A Llama-style decoder: RMSNorm, RoPE, GQA, SwiGLU, causal mask, next-token loss."""

    def __init__(self, vocab: int = 64, d: int = 32, n_layer: int = 2, n_head: int = 4, n_kv_head: int = 2,
                 max_len: int = 16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, n_head, n_kv_head, max_len) for _ in range(n_layer))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx, targets):
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class CNN(nn.Module):
    def __init__(self, classes: int = 4):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, classes)

    def forward(self, x, y):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return F.cross_entropy(self.head(x.mean((2, 3))), y)


class TrainingBranch(nn.Module):
    """Behaves differently in train and eval mode, like many real models do."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.fc1 = nn.Linear(d, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x, y):
        h = F.relu(self.fc1(x))
        if self.training:
            h = h * 0.5 + 1.0
        return F.cross_entropy(self.fc2(h), y)


class End2EndGPT(nn.Module):
    """The example GPT, small, as an end2end module: forward(batch) -> loss."""

    def __init__(self):
        super().__init__()
        from nbscaler.models.gpt import GPT, GPTConfig
        self.gpt = GPT(GPTConfig(vocab_size=64, seq_len=8, n_layer=4, d_model=32, n_head=4))

    def forward(self, batch):
        return self.gpt(batch)


def batch(name: str, seed: int, n: int = 8):
    """A deterministic batch for model ``name`` (a dict of forward arguments)."""
    g = torch.Generator().manual_seed(seed)
    if name == "gpt":
        tokens = torch.randint(0, 64, (2, 9), generator=g)
        return {"batch": {"idx": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}}
    if name == "llama":
        idx = torch.randint(0, 64, (n // 2, 9), generator=g)
        return {"idx": idx[:, :-1].contiguous(), "targets": idx[:, 1:].contiguous()}
    if name in hf.BUILDERS:
        return hf.batch(name, g)
    if name in vision.BUILDERS:
        return vision.batch(name, g)
    if name == "cnn":
        return {"x": torch.randn(n // 2, 3, 8, 8, generator=g), "y": torch.randint(0, 4, (n // 2,), generator=g)}
    return {"x": torch.randn(n, 16, generator=g), "y": torch.randint(0, 4, (n,), generator=g)}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if name in hf.BUILDERS:
        return hf.build(name)
    if name in vision.BUILDERS:
        return vision.BUILDERS[name]()
    return {"mlp": MLP, "llama": Llama, "cnn": CNN, "branch": TrainingBranch, "with_trunk": WithTrunk, "gpt": End2EndGPT,
            "user_op": UserOp}[name]()


class Trunk(nn.Module):
    """The heavy middle of ``WithTrunk``: the part that gets parallelized on its own."""

    def __init__(self, d: int = 16, hidden: int = 32):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class WithTrunk(nn.Module):
    """Plain layers around a submodule: the reference's "parallelize submodules" example."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(16, 16)
        self.trunk = Trunk()
        self.head = nn.Linear(16, 4)

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.trunk(torch.tanh(self.pre(x)))), y)


@register_op("* k+, k+ n -> * n")
def project(x, w):
    """A user op: the tracer records it as one node, split by its annotation."""
    return torch.einsum("...k,kn->...n", x, w)


class UserOp(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(16, 32) / 4)
        self.w2 = nn.Parameter(torch.randn(32, 4) / 6)

    def forward(self, x, y):
        return F.cross_entropy(project(torch.tanh(project(x, self.w1)), self.w2), y)
