"""``sliding_window_attention`` computes SDPA under the band mask, keeps nothing of size (T, S)
between its passes, and is traced as one attention op that a policy splits like SDPA."""

import pytest
import torch
import torch.nn.functional as F

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.attention.window import band, sliding_window_attention
from nbscaler.ir.layer_rules import WINDOW_TARGET, window_of
from nbscaler.models.llama import Llama, LlamaConfig, sample_batch


def _qkv(dtype=torch.float32, t=12, s=12):
    g = torch.Generator().manual_seed(0)
    shape = lambda n: (2, 3, n, 8)
    return [torch.randn(shape(n), generator=g, dtype=dtype).requires_grad_() for n in (t, s, s)]


@pytest.mark.parametrize("window", [1, 3, 12, 40])
def test_it_is_sdpa_under_the_band_forward_and_backward(window):
    q, k, v = _qkv()
    out = sliding_window_attention(q, k, v, window=window)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=band(12, 12, window))
    ref_grads = torch.autograd.grad(ref.square().sum(), (q2, k2, v2))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    causal = F.scaled_dot_product_attention(q2, k2, v2, is_causal=True)
    assert (window >= 12) == torch.allclose(out, causal, atol=1e-6)


def test_the_band_keeps_the_latest_keys_up_to_each_query():
    assert band(4, 4, 2).int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]


def test_it_keeps_what_a_flash_kernel_keeps_and_no_mask():
    q, k, v = _qkv(t=64, s=64)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda x: saved.append(tuple(x.shape)) or x, lambda x: x):
        sliding_window_attention(q, k, v, window=5)
    assert (64, 64) not in saved and len(saved) == 5            # q, k, v, output, log-sum-exp
    assert (2, 3, 64) in saved


def test_off_the_cpu_it_computes_its_forward_again_in_the_backward():
    q, k, v = (x.detach().to("meta").requires_grad_() for x in _qkv())
    out = sliding_window_attention(q, k, v, window=3)
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert out.shape == dq.shape == (2, 3, 12, 8) and dk.shape == dv.shape == (2, 3, 12, 8)


def test_a_bad_window_names_what_it_must_be():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="positive number of keys"):
        sliding_window_attention(q, k, v, window=0)
    with pytest.raises(ValueError, match="sliding_window=0 must be a positive number"):
        LlamaConfig(sliding_window=0)
    with pytest.raises(ValueError, match="window_layers='odd' is invalid"):
        LlamaConfig(sliding_window=4, window_layers="odd")


def test_alternate_layers_attend_over_the_window_as_gpt_oss_does():
    model = Llama(LlamaConfig(n_layer=4, sliding_window=3, window_layers="alternate", sdpa=True))
    assert [b.attn.window for b in model.blocks] == [3, None, 3, None]


def test_the_written_out_and_the_fused_windowed_llama_agree():
    cfg = dict(n_layer=2, sliding_window=5, sdpa=True, seq_len=16)
    losses = []
    for sdpa in (True, False):
        torch.manual_seed(0)
        model = Llama(LlamaConfig(**{**cfg, "sdpa": sdpa}))
        losses.append(model(**sample_batch(model.config, 2)))
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)


def test_it_traces_as_one_attention_split_by_heads_and_priced_by_its_band():
    cfg = LlamaConfig(n_layer=2, sliding_window=5, window_layers="alternate", sdpa=True, seq_len=16)
    plan = nbscaler.plan(Llama(cfg), sample_batch(cfg, 4), "tp", ComputeConfig(2, 2))
    windowed, full = [n for n in plan.graph.nodes if n.op == "attention"]
    assert windowed.target == WINDOW_TARGET and window_of(windowed) == 5 and window_of(full) is None
    assert windowed.placement.split == full.placement.split == "h"
    kept = sum(min(i + 1, 5) for i in range(16))
    assert windowed.meta["causal_fraction"] == pytest.approx(kept / 256)
    assert full.meta["causal_fraction"] == pytest.approx(136 / 256)
    code = plan.sources[0]                                   # a rank's code imports and calls it as written
    assert "from nbscaler.attention.window import sliding_window_attention" in code
    assert "= sliding_window_attention(" in code and "window=5);" in code and "scale=" not in code
