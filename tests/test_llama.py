"""The shipped Llama's options: a head size of its own, and attention through SDPA."""

import pytest
import torch

from nbscaler.models.llama import Llama, LlamaConfig, sample_batch


def test_sdpa_attention_computes_the_written_out_attentions_loss_and_gradients():
    cfg = LlamaConfig(n_layer=2, d_model=48, n_head=4, n_kv_head=2, head_dim=16, seq_len=16)
    torch.manual_seed(0)
    written = Llama(cfg)
    fused = Llama(LlamaConfig(**{**cfg.__dict__, "sdpa": True}))
    fused.load_state_dict(written.state_dict())
    batch = sample_batch(cfg, batch_size=3)
    a, b = written(**batch), fused(**batch)
    a.backward(), b.backward()
    assert written.blocks[0].attn.q.weight.shape == (4 * 16, 48)       # heads of 16 channels, not 48 / 4
    assert torch.allclose(a, b, rtol=1e-5, atol=0)
    for (name, p), q in zip(written.named_parameters(), fused.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-6), name


@pytest.mark.parametrize("kwargs, message", [
    (dict(d_model=50, n_head=4), "d_model .* a multiple of n_head unless head_dim is given"),
    (dict(n_head=4, n_kv_head=3), r"n_head \(4\) must be a multiple of n_kv_head \(3\)"),
    (dict(head_dim=15), "head_dim=15 must be a positive even number"),
])
def test_a_shape_the_attention_cannot_take_is_refused_with_the_rule(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LlamaConfig(**kwargs)
