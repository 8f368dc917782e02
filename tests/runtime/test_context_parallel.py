"""Context parallelism trains as one process does: the sequence split over 2 and 4 ranks, keys
and values all-gathered or passed round a ring, on the shipped GPT (``scaled_dot_product_attention``
with ``is_causal=True``), the shipped Llama (an attention written out with an explicit causal mask
and rotary positions) and Hugging Face's Llama (its own mask through SDPA)
(``tests.multiprocess.check_equivalence``: losses, merged gradients and parameters over 3 steps)."""

import pytest

from tests.multiprocess import (Case, check_equivalence, context_parallel, pipeline, run_ranks,
                                train_parallel, zero)


def _check(cases, nranks, tmp_path):
    per_rank = run_ranks(train_parallel, nranks, cases, str(tmp_path), timeout=600)
    for i, case in enumerate(cases):
        check_equivalence(case, [res[i] for res in per_rank])


@pytest.mark.multiprocess
def test_context_parallel_trains_like_one_process_on_two_ranks(tmp_path):
    cases = [Case("gpt", "tp", 2, 2, config=context_parallel(2)),
             Case("gpt", "tp", 2, 2, config=context_parallel(2, "ring")),
             Case("llama", "tp", 2, 2, config=context_parallel(2)),
             Case("hf_llama", "tp", 2, 2, config=context_parallel(2)),
             Case("hf_llama", "tp", 2, 2, config=context_parallel(2, "ring"))]
    _check(cases, 2, tmp_path)


@pytest.mark.multiprocess
def test_context_parallel_trains_like_one_process_on_four_ranks(tmp_path):
    cases = [Case("gpt", "tp", 4, 4, config=context_parallel(4, "ring")),
             Case("llama", "tp", 4, 4, config=context_parallel(4)),
             Case("hf_llama", "tp", 4, 4, config=context_parallel(4, "ring")),
             Case("gpt", "tp", 4, 4, config=context_parallel(4))]
    _check(cases, 4, tmp_path)


@pytest.mark.multiprocess
def test_context_parallel_composes_with_data_parallelism_pipelines_zero_and_recompute(tmp_path):
    """Two context-parallel units side by side; two stages of two context-parallel devices;
    ZeRO stages 1 and 3 over the units; recomputed layers."""
    cases = [Case("gpt", "tp", 2, 4, config=context_parallel(2, "ring")),
             Case("llama_e2e", "hybrid", 4, 4, config=pipeline("1f1b", 2, 2) + context_parallel(2)),
             Case("gpt", "tp", 2, 4, config=context_parallel(2) + zero(2, 1)),
             Case("llama", "tp", 2, 4, config=context_parallel(2) + zero(2, 3)),
             Case("gpt", "tp", 2, 4, config=context_parallel(2, "ring", recompute="full"))]
    _check(cases, 4, tmp_path)


def test_the_ring_takes_the_fused_cpu_kernel_only_without_a_mask_over_mirrored_chunks():
    """The fused CPU flash kernel per block where the call allows it, the written-out math where it
    does not; on one device both equal SDPA, values and gradients, grouped-query heads included."""
    import torch
    import torch.nn.functional as F

    from nbscaler.blocks import MIRRORED
    from nbscaler.attention import context_attention, fused_ring

    q = torch.randn(2, 4, 16, 8)
    assert fused_ring(q, None, MIRRORED)
    assert not fused_ring(q, torch.ones(16, 16, dtype=torch.bool), MIRRORED)
    assert not fused_ring(q, None, 2)
    for causal in (True, False):
        for kv_heads in (4, 2):
            torch.manual_seed(0)
            q = torch.randn(2, 4, 16, 8, requires_grad=True)
            k, v = (torch.randn(2, kv_heads, 16, 8, requires_grad=True) for _ in range(2))
            out = context_attention(q, k, v, is_causal=causal, enable_gqa=True, kind="ring", blocks=MIRRORED, group=None)
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
            grad = torch.randn_like(ref)
            torch.testing.assert_close(out, ref)
            for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
                torch.testing.assert_close(a, b)
