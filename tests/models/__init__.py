"""Small real models the equivalence tests run: each builds deterministically from a seed and
comes with a batch maker, so every rank and the single-process reference see the same thing.

``hf`` holds transformers models from tiny configs, ``vision`` torchvision's ResNet-18 and
MobileNetV3-small and a timm ViT, all small."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nbscaler import register_op
from nbscaler.models import torchvision_compat
from tests.models import hf, vision

# transformers imports torchvision whenever it is installed: make that import work first.
torchvision_compat.declare_missing_ops()


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


def Llama(**config) -> nn.Module:
    """The shipped Llama-style decoder (RMSNorm, RoPE, GQA, SwiGLU), small; ``config`` overrides
    fields of ``LlamaConfig``."""
    from nbscaler.models.llama import Llama as Decoder, LlamaConfig
    small = dict(vocab_size=64, seq_len=16, n_layer=2, d_model=32, n_head=4, n_kv_head=2)
    return Decoder(LlamaConfig(**{**small, **config}))


def MoE(**config) -> nn.Module:
    """The shipped mixture-of-experts Llama, small: 4 experts, 2 per token, dropless, softmax router;
    ``config`` overrides fields of ``MoEConfig``."""
    from nbscaler.models.moe import MoEConfig, MoELlama
    small = dict(vocab_size=64, seq_len=16, n_layer=2, d_model=32, n_head=4, n_kv_head=2, n_experts=4, top_k=2,
                 expert_hidden=16, aux_loss_coef=0.1)
    return MoELlama(MoEConfig(**{**small, **config}))


def MoECapacity() -> nn.Module:
    """``MoE`` with a sigmoid router, a shared expert and a capacity factor of 0.75, which drops
    pairs in most sequences."""
    return MoE(router="sigmoid", n_shared_experts=1, capacity_factor=0.75)


def MoEWindow() -> nn.Module:
    """``MoE`` attending as GPT-OSS does: every other layer over a sliding window (of 3 keys here),
    through ``sliding_window_attention``; the others over every earlier key."""
    return MoE(sdpa=True, sliding_window=3, window_layers="alternate")


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


class FusedGQA(nn.Module):
    """Grouped-query attention behind one fused projection, as many Llama ports write it: q, k and
    v come out of one ``Linear`` in blocks of unequal size (4 query heads, 2 key/value heads)."""

    def __init__(self, d: int = 32, n_head: int = 4, n_kv_head: int = 2, classes: int = 4):
        super().__init__()
        self.n_head, self.n_kv_head, self.hd = n_head, n_kv_head, d // n_head
        self.qkv = nn.Linear(d, (n_head + 2 * n_kv_head) * self.hd)
        self.proj = nn.Linear(d, d)
        self.head = nn.Linear(d, classes)

    def forward(self, x, y):
        B, T, C = x.shape
        kv = self.n_kv_head * self.hd
        q, k, v = self.split_qkv(self.qkv(x), [C, kv, kv])
        q = q.view(B, T, self.n_head, self.hd).transpose(1, 2)               # (B, nh, T, hs)
        k = k.view(B, T, self.n_kv_head, self.hd).transpose(1, 2)            # (B, nkv, T, hs)
        v = v.view(B, T, self.n_kv_head, self.hd).transpose(1, 2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = x + self.proj(att.transpose(1, 2).reshape(B, T, C))
        return F.cross_entropy(self.head(h.mean(1)), y)

    def split_qkv(self, qkv: torch.Tensor, sizes: list) -> tuple:
        return qkv.split(sizes, dim=-1)


class FusedGQAByKeyword(FusedGQA):
    """``FusedGQA`` with the split's sizes given by keyword, as ``torch.split`` lets them be."""

    def split_qkv(self, qkv: torch.Tensor, sizes: list) -> tuple:
        return torch.split(qkv, split_size_or_sections=sizes, dim=-1)


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


class PostNormLM(nn.Module):
    """A post-norm decoder (the original Transformer's and BERT's order: add, then normalise), two
    layers of the example GPT's attention and MLP: its first attention reads the token embedding
    directly, beside the residual, so a vocabulary-parallel lookup's partial sums have consumers
    that want them whole and whole with summed gradients."""

    def __init__(self, vocab: int = 64, d: int = 32, n_head: int = 4, layers: int = 2):
        super().__init__()
        from nbscaler.models.gpt import MLP as Feed, CausalSelfAttention, GPTConfig
        cfg = GPTConfig(vocab_size=vocab, seq_len=8, n_layer=layers, d_model=d, n_head=n_head)
        self.tok = nn.Embedding(vocab, d)
        self.attn = nn.ModuleList(CausalSelfAttention(cfg) for _ in range(layers))
        self.mlp = nn.ModuleList(Feed(cfg) for _ in range(layers))
        self.norm1 = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.norm2 = nn.ModuleList(nn.LayerNorm(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, batch):                    # one argument, so that pipelines take it (end2end)
        idx, targets = batch["idx"], batch["targets"]
        x = self.tok(idx)                                                   # (B, T, C)
        for attn, mlp, norm1, norm2 in zip(self.attn, self.mlp, self.norm1, self.norm2):
            x = norm1(x + attn(x))
            x = norm2(x + mlp(x))
        return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())


class End2EndLlama(nn.Module):
    """The shipped Llama, small, as an end2end module: forward(batch) -> loss (4 layers, so that
    eight pipeline stages still hold half a layer each)."""

    def __init__(self):
        super().__init__()
        self.llama = Llama(n_layer=4)

    def forward(self, batch):
        return self.llama(batch["idx"], batch["targets"])


class End2EndMoE(nn.Module):
    """``MoE`` (dropless; or ``model``) as an end2end module: forward(batch) -> loss, for pipelines."""

    def __init__(self, model: nn.Module = None):
        super().__init__()
        self.moe = model if model is not None else MoE()

    def forward(self, batch):
        return self.moe(batch["idx"], batch["targets"])


def batch(name: str, seed: int, n: int = 8):
    """A deterministic batch for model ``name`` (a dict of forward arguments)."""
    g = torch.Generator().manual_seed(seed)
    if name == "gpt":
        tokens = torch.randint(0, 64, (2, 9), generator=g)
        return {"batch": {"idx": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}}
    if name == "post_norm":
        tokens = torch.randint(0, 64, (n // 2, 9), generator=g)
        return {"batch": {"idx": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}}
    if name in ("llama_e2e", "moe_e2e", "moe_window_e2e"):
        return {"batch": batch("llama", seed, n)}
    if name == "llama_one_sequence":        # long-context training's batch: one sequence of 16 tokens
        idx = torch.randint(0, 64, (1, 17), generator=g)
        return {"idx": idx[:, :-1].contiguous(), "targets": idx[:, 1:].contiguous()}
    if name in ("llama", "moe", "moe_capacity", "moe_window"):
        idx = torch.randint(0, 64, (n // 2, 9), generator=g)
        return {"idx": idx[:, :-1].contiguous(), "targets": idx[:, 1:].contiguous()}
    if name in hf.BUILDERS:
        return hf.batch(name, g)
    if name in vision.BUILDERS:
        return vision.batch(name, g)
    if name in ("fused_gqa", "fused_gqa_keyword"):
        return {"x": torch.randn(n // 2, 6, 32, generator=g), "y": torch.randint(0, 4, (n // 2,), generator=g)}
    if name == "cnn":
        return {"x": torch.randn(n // 2, 3, 8, 8, generator=g), "y": torch.randint(0, 4, (n // 2,), generator=g)}
    return {"x": torch.randn(n, 16, generator=g), "y": torch.randint(0, 4, (n,), generator=g)}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if name in hf.BUILDERS:
        return hf.build(name)
    if name in vision.BUILDERS:
        return vision.BUILDERS[name]()
    return {"mlp": MLP, "llama": Llama, "llama_one_sequence": Llama, "cnn": CNN, "branch": TrainingBranch, "with_trunk": WithTrunk, "gpt": End2EndGPT,
            "llama_e2e": End2EndLlama, "post_norm": PostNormLM, "moe": MoE, "moe_capacity": MoECapacity, "moe_e2e": End2EndMoE,
            "moe_window": MoEWindow, "moe_window_e2e": lambda: End2EndMoE(MoEWindow()),
            "user_op": UserOp, "fused_gqa": FusedGQA, "fused_gqa_keyword": FusedGQAByKeyword}[name]()


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
