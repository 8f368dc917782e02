"""The memory model against the activation formulas of Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", Table 2: bytes one transformer layer keeps for its
backward, with s the sequence, b the micro-batch, h the hidden size, a the heads and t the tensor
parallel size (fp16 activations, 1-byte dropout masks):

    no parallelism                     sbh (34 + 5as/h)
    tensor parallel                    sbh (10 + 24/t + 5as/(ht))
    tensor + sequence parallel         sbh/t (34 + 5as/h)
    selective + tensor + sequence      sbh 34/t
    full recomputation                 2sbh

They assume Megatron-LM's layer exactly: LayerNorm, a fused QKV projection, materialised scores
with attention dropout, a 4h GELU MLP and dropout before each residual add. The shipped GPT calls
``scaled_dot_product_attention`` (no scores kept, no attention dropout), so the layer is written
here. It is built on the meta device in fp16 with GPT-3 175B's shapes and a small one; a layer's
bytes are those of three layers less those of two (``LocalRun.saved_bytes`` of device 0).

What PyTorch keeps differs from the paper's count in three named places, each sized below:

- ``mask``: a dropout keeps its mask in one byte (a bool) only where CUDA's fused kernel runs; on
  the CPU it keeps the scaled mask in the activations' dtype (2 bytes). Where the cost model fakes
  the CPU, each mask element costs one byte more than the paper's.
- ``stats``: each LayerNorm keeps its per-token mean and reciprocal standard deviation, 2 sb numbers
  (the paper leaves them out; 8 bytes a token for the two norms in fp16, on a sequence slice under
  sequence parallelism).
- ``gathered``: under sequence parallelism the two column-parallel linears (QKV and the MLP's first)
  keep the input the all-gather made, 2sbh each, where Megatron-LM keeps its sequence slice (2sbh/t)
  and gathers again in the backward: 4sbh (1 - 1/t) more.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.cost.local import fake_device


class MegatronLayer(nn.Module):
    """Megatron-LM's transformer layer (the paper's section 4.1), batch first."""

    def __init__(self, h: int, a: int, s: int, p: float = 0.1):
        super().__init__()
        self.a, self.p = a, p
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)
        self.register_buffer("causal", torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1), persistent=False)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
        q, k, v = (t.view(b, s, self.a, h // self.a).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(h // self.a))
        probs = F.softmax(scores.masked_fill(self.causal, float("-inf")), dim=-1)
        y = F.dropout(probs, self.p, self.training) @ v
        x = x + F.dropout(self.proj(y.transpose(1, 2).reshape(b, s, h)), self.p, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc(self.ln2(x)))), self.p, self.training)


class Layers(nn.Module):
    def __init__(self, n: int, h: int, a: int, s: int):
        super().__init__()
        self.layers = nn.ModuleList(MegatronLayer(h, a, s) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.float().sum()


def saved_itemsizes():
    """The bytes of one element of a dropout's mask and of a LayerNorm's statistics, as autograd
    keeps them for fp16 activations on the device the cost model fakes."""
    kept = []
    with FakeTensorMode(), torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        x = torch.empty(4, 8, dtype=torch.float16, device=fake_device(), requires_grad=True)
        F.dropout(x, 0.1, True)
        mask = kept[-1].element_size()
        w = torch.ones(8, dtype=torch.float16, device=fake_device(), requires_grad=True)
        F.layer_norm(x, (8,), w, w)
        stats = next(t for t in kept if tuple(t.shape) == (4, 1)).element_size()
    return mask, stats


def layer_bytes(h: int, a: int, s: int, b: int, t: int, policy: str, pas_config: dict) -> int:
    """What the memory model says one layer keeps for the backward on device 0."""
    def saved(n: int) -> int:
        with torch.device("meta"):
            model = Layers(n, h, a, s).to(torch.float16)
        x = torch.empty(b, s, h, dtype=torch.float16, device="meta")
        plan = nbscaler.plan(model, {"x": x}, policy, ComputeConfig(t, t, pas_config=pas_config))
        return plan.local_runs[0][None].saved_bytes
    return saved(3) - saved(2)


#: (a, h, s, b, t): GPT-3 175B as the paper's Table 3 runs it, and a small layer.
SHAPES = [pytest.param(96, 12288, 2048, 1, 8, id="gpt3-175b"), pytest.param(4, 64, 32, 2, 4, id="small")]


@pytest.mark.parametrize("a, h, s, b, t", SHAPES)
@pytest.mark.parametrize("setting", ["none", "tensor", "tensor+sequence", "selective+tensor+sequence", "full"])
def test_layer_activations_follow_table_2(a, h, s, b, t, setting):
    sbh, F_ = s * b * h, Fraction
    policy, pas_config, formula = {
        "none": ("dp", {}, sbh * (34 + F_(5 * a * s, h))),
        "tensor": ("tp", {}, sbh * (10 + F_(24, t) + F_(5 * a * s, h * t))),
        "tensor+sequence": ("tp", {"sequence_parallel": True}, F_(sbh, t) * (34 + F_(5 * a * s, h))),
        "selective+tensor+sequence": ("tp", {"sequence_parallel": True, "recompute": "selective"}, F_(sbh * 34, t)),
        "full": ("dp", {"recompute": "full"}, 2 * sbh),
    }[setting]
    if setting in ("none", "full"):
        t = 1
    heads = 1 if t == 1 else t                      # the attention's tensors are split by heads
    slice_ = t if "sequence" in setting else 1     # the rest is whole, or a sequence slice
    mask_bytes, stat_bytes = saved_itemsizes()
    differences = {
        # a dropout mask element in mask_bytes, not 1: the attention's (as²b) and the two residual ones (sbh)
        "mask": (mask_bytes - 1) * ((0 if "selective" in setting else F_(a * s * s * b, heads)) + F_(2 * sbh, slice_)),
        # mean and 1/std of two LayerNorms, per token
        "stats": F_(2 * 2 * s * b * stat_bytes, slice_),
        # the all-gathered inputs of the QKV and first MLP linears, kept whole
        "gathered": 4 * sbh * (1 - F_(1, t)) if "sequence" in setting else 0,
    }
    if setting == "full":
        differences = {}                            # a recomputed layer keeps its input only
    assert layer_bytes(h, a, s, b, t, policy, pas_config) == formula + sum(differences.values())
