"""Modules built on the meta device (shapes, no values) trace and plan like the same modules on the
CPU, and a forward that needs values they do not have is refused with the op, the module and the fix."""

import pytest
import torch
import torch.nn as nn

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.models import gpt, llama
from nbscaler.trace import TraceError

SHIPPED = {
    "gpt": (lambda: gpt.GPT(gpt.GPTConfig()), lambda m: {"batch": gpt.sample_batch(m.config, 4)}),
    "llama": (lambda: llama.Llama(llama.LlamaConfig()), lambda m: llama.sample_batch(m.config, 4)),
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
@pytest.mark.parametrize("policy", ["tp", "data"])
def test_shipped_models_plan_on_meta_as_on_the_cpu(name, policy):
    make, args = SHIPPED[name]
    with torch.device("meta"):
        meta = make()
    assert all(t.is_meta for t in (*meta.parameters(), *meta.buffers()))
    real = make()
    cfg = ComputeConfig(2, 2)
    assert nbscaler.plan(meta, args(meta), policy, cfg).sources == nbscaler.plan(real, args(real), policy, cfg).sources


def test_rotary_tables_follow_the_module():
    """The tables are computed by ``reset_parameters`` where the buffers live: empty on meta, the
    same values as a CPU build once a materialised copy is reset."""
    with torch.device("meta"):
        attn = llama.Attention(llama.LlamaConfig())
    assert attn.cos.is_meta
    attn.to_empty(device="cpu")
    attn.reset_parameters()
    reference = llama.Attention(llama.LlamaConfig())
    assert torch.equal(attn.cos, reference.cos) and torch.equal(attn.sin, reference.sin)


class ReadsWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum().item() > 0:                         # needs the parameters' values
            return y * 2
        return y


class BranchesOnBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        if bool((self.scale > 0).all()):               # a data-dependent branch on a buffer
            x = x * self.scale
        return self.lin(x)


class Outer(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x).sum()


@pytest.mark.parametrize("inner, op", [(ReadsWeights, "item()"), (BranchesOnBuffer, "__bool__()")])
def test_forward_that_needs_values_on_meta_names_op_module_and_fix(inner, op):
    with torch.device("meta"):
        model = Outer(inner())
    with pytest.raises(TraceError) as err:
        nbscaler.plan(model, {"x": torch.randn(2, 4)}, "dp", ComputeConfig(1, 1))
    message = str(err.value)
    assert op in message and "(in inner)" in message and "meta device" in message
    assert "torch.where" in message and "real device" in message
    assert Outer(inner())(torch.randn(2, 4)).shape == ()            # the same module traces on the CPU
    nbscaler.plan(Outer(inner()), {"x": torch.randn(2, 4)}, "dp", ComputeConfig(1, 1))
