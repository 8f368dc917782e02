"""Context parallelism trains as one process does: the sequence split over 2 and 4 ranks (with
tensor parallelism inside each context-parallel device, too), keys and values all-gathered or
passed round a ring, on the shipped GPT (``scaled_dot_product_attention``
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
def test_tensor_parallelism_inside_context_parallel_groups_trains_like_one_process(tmp_path):
    """Four ranks as two context-parallel groups of two tensor-parallel neighbours (Megatron's
    tp x cp): the sequence split across the groups, heads and hidden units inside each, keys and
    values gathered or passed round the ring of each tensor-parallel place, with SDPA's causal
    flag (GPT), an explicit mask written out (Llama) and Hugging Face's own mask (HF Llama);
    recomputed layers too."""
    cases = [Case("gpt", "tp", 4, 4, config=context_parallel(2)),
             Case("gpt", "tp", 4, 4, config=context_parallel(2, "ring")),
             Case("llama", "tp", 4, 4, config=context_parallel(2)),
             Case("hf_llama", "tp", 4, 4, config=context_parallel(2)),
             Case("hf_llama", "tp", 4, 4, config=context_parallel(2, "ring")),
             Case("gpt", "tp", 4, 4, config=context_parallel(2, "ring", recompute="full")),
             # one sequence: the loss splits its tokens across the groups and its classes inside each
             Case("llama_one_sequence", "tp", 4, 4, config=context_parallel(2), optimizer="adamw"),
             # sequence parallel inside each pair: norms and residuals on half of the group's chunks
             Case("gpt", "tp", 4, 4, config=context_parallel(2, "ring", sequence_parallel=True)),
             Case("llama", "tp", 4, 4, config=context_parallel(2, sequence_parallel=True), optimizer="adamw"),
             Case("hf_llama", "tp", 4, 4, config=context_parallel(2, sequence_parallel=True))]
    _check(cases, 4, tmp_path)


@pytest.mark.multiprocess
def test_tp_x_cp_composes_with_pipelines_and_data_parallel_units_on_eight_ranks(tmp_path):
    """Two pipeline stages of tp 2 x cp 2 (Llama, keys gathered; GPT through a ring, with ZeRO over
    the units and each slice's holders), and two units of tp 2 x cp 2 side by side."""
    cases = [Case("llama_e2e", "hybrid", 8, 8, config=pipeline("1f1b", 2, 2) + context_parallel(2)),
             Case("gpt", "hybrid", 8, 8, config=pipeline("1f1b", 2, 2) + context_parallel(2, "ring") + zero(1, 1),
                  optimizer="adamw"),
             Case("gpt", "tp", 4, 8, config=context_parallel(2, "ring") + zero(2, 2), optimizer="adamw")]
    _check(cases, 8, tmp_path)


@pytest.mark.multiprocess
def test_zero_splits_tp_x_cp_state_over_the_devices_that_hold_the_same_slice(tmp_path):
    """ZeRO over a tp2 x cp2 unit spans each weight slice's two holders (the devices at the same
    place in both context-parallel groups), as torchtitan's FSDP spans its context-parallel ranks
    while tensor parallelism splits the weights: stages 1, 2 and 3, clipped, gathered and ring."""
    cases = [Case("gpt", "tp", 4, 4, config=context_parallel(2), optimizer="adamw"),
             Case("gpt", "tp", 4, 4, config=context_parallel(2) + zero(1, 1), optimizer="adamw", clip=0.5),
             Case("llama", "tp", 4, 4, config=context_parallel(2) + zero(1, 2), optimizer="adamw"),
             Case("hf_llama", "tp", 4, 4, config=context_parallel(2, "ring") + zero(1, 3), optimizer="adamw",
                  clip=0.5)]
    per_rank = run_ranks(train_parallel, 4, cases, str(tmp_path), timeout=600)
    for i, case in enumerate(cases):
        check_equivalence(case, [res[i] for res in per_rank])
    whole, sharded = per_rank[0][0]["optimizer_bytes"], per_rank[0][1]["optimizer_bytes"]
    assert abs(sharded - whole / 2) < 1024, (whole, sharded)        # half of this rank's slice's state


@pytest.mark.multiprocess
def test_context_parallel_composes_with_data_parallelism_pipelines_zero_and_recompute(tmp_path):
    """Two context-parallel units side by side; two stages of two context-parallel devices;
    ZeRO stages 1 and 3 with a group per unit; recomputed layers."""
    cases = [Case("gpt", "tp", 2, 4, config=context_parallel(2, "ring")),
             Case("llama_e2e", "hybrid", 4, 4, config=pipeline("1f1b", 2, 2) + context_parallel(2)),
             Case("gpt", "tp", 2, 4, config=context_parallel(2) + zero(2, 1)),
             Case("llama", "tp", 2, 4, config=context_parallel(2) + zero(2, 3)),
             Case("gpt", "tp", 2, 4, config=context_parallel(2, "ring", recompute="full"))]
    _check(cases, 4, tmp_path)


@pytest.mark.multiprocess
def test_zero_splits_the_state_over_the_context_parallel_devices_too(tmp_path):
    """ZeRO's groups span the units and the devices of each context-parallel group, as torchtitan's
    FSDP does: each rank keeps 1/(units x cp) of AdamW's state, and every stage trains as one
    process, clipped, under a pipeline, with weights tied across stages and with ops run on the
    whole sequence (bf16 with fp32 masters: ``test_mixed_precision``)."""
    cases = [Case("gpt", "tp", 2, 4, config=context_parallel(2), optimizer="adamw"),
             Case("gpt", "tp", 2, 4, config=context_parallel(2) + zero(1, 1), optimizer="adamw", clip=0.5),
             Case("gpt", "tp", 2, 4, config=context_parallel(2, "ring") + zero(1, 2), optimizer="adamw"),
             Case("llama", "tp", 4, 4, config=context_parallel(4) + zero(1, 3), optimizer="adamw", clip=0.5),
             Case("hf_llama", "tp", 2, 4, config=context_parallel(2, "ring") + zero(1, 3), optimizer="adamw"),
             Case("llama_e2e", "hybrid", 4, 4, config=pipeline("1f1b", 2, 2) + context_parallel(2) + zero(1, 3)),
             # GPT-2's embedding tied across the two stages, and ops that run on the gathered sequence
             # (its Conv1D merges the batch into the sequence): each device sends half their gradient
             Case("hf_gpt2", "hybrid", 4, 4, config=pipeline("1f1b", 2, 2) + context_parallel(2) + zero(1, 1),
                  optimizer="adamw", clip=0.5)]
    per_rank = run_ranks(train_parallel, 4, cases, str(tmp_path), timeout=600)
    for i, case in enumerate(cases):
        check_equivalence(case, [res[i] for res in per_rank])
    state = [[res[i]["optimizer_bytes"] for res in per_rank] for i in range(3)]
    whole = state[0][0]                                 # the GPT without ZeRO: every rank the whole state
    for sharded in state[1:]:      # 4 ranks split it (padding, and a step count per tensor: under 1 KiB)
        assert all(abs(held - whole / 4) < 1024 for held in sharded), (whole, sharded)


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


def _attention_on_ranks(n: int):
    """On each of ``n`` ranks: this rank's mirrored queries, keys and values of one sequence, and its
    rows of a padding mask; each kind's output and gradients against SDPA's rows of the same."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from nbscaler import blocks as strided
    from nbscaler.attention import context_attention
    from nbscaler.runtime.collectives import all_gather_sum_grad
    from nbscaler.runtime.groups import get_group

    group, rank = get_group(range(n)), dist.get_rank()
    torch.manual_seed(0)
    T = 8 * n
    q, k, v = (torch.randn(2, 4, T, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = torch.ones(2, 1, T, T, dtype=torch.bool)
    mask[0, ..., T - 3:] = False                                       # the first sequence's last keys are padding
    mine = lambda t, dim=-2: strided.take(t.detach(), dim, strided.MIRRORED, n, rank)
    errors = {}
    for kind in ("ring", "all_gather"):
        for masked in (False, True):
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask if masked else None, is_causal=not masked)
            grad = torch.randn_like(ref)
            expected = torch.autograd.grad(ref, (q, k, v), grad)
            ql, kl, vl = (mine(t).clone().requires_grad_() for t in (q, k, v))
            keys = [kl, vl] if kind == "ring" else [all_gather_sum_grad(t, 2, group, strided.MIRRORED) for t in (kl, vl)]
            out = context_attention(ql, *keys, attn_mask=mine(mask) if masked else None, is_causal=not masked,
                                    kind=kind, blocks=strided.MIRRORED, group=group)
            got = torch.autograd.grad(out, (ql, kl, vl), mine(grad))
            errors[kind, masked] = max([(out - mine(ref)).abs().max().item()]
                                       + [(g - mine(e)).abs().max().item() for g, e in zip(got, expected)])
    return errors


@pytest.mark.multiprocess
def test_each_kind_attends_as_sdpa_with_a_causal_flag_or_a_mask():
    """Both kinds, fused (a causal flag on CPU) and written out (a padding mask), on 4 ranks in
    float64: the rows and gradients each rank holds are SDPA's to rounding."""
    for per_rank in run_ranks(_attention_on_ranks, 4, 4):
        assert max(per_rank.values()) < 1e-12, per_rank


def test_a_head_padded_to_the_gpu_kernels_multiple_attends_as_the_unpadded_one():
    """The GPU kernels read heads in multiples of 8 channels; ``nbscaler.attention.kernels`` pads a
    head of 20 with zeros and keeps the caller's scale: the same output, log-sum-exp and
    gradients (checked here on the CPU's flash kernel; on a GPU by ``benchmarks.gpu_context``)."""
    import torch

    from nbscaler.attention.kernels import BlockKernel, _pad, block_backward, block_forward, has_block_kernels, kernel_of

    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(2, 4, 16, 20, dtype=torch.float64) for _ in range(4))
    assert kernel_of(q, k, v, True) == BlockKernel.CPU_FLASH and has_block_kernels(q)
    assert not has_block_kernels(q.to("meta"))                 # no kernel there: the ring writes its blocks out
    scale = 20 ** -0.5
    out, lse = block_forward(q, k, v, True, scale)
    padded = _pad(q, k, v, dout)
    assert padded[0].shape[-1] == 24 and torch.equal(padded[0][..., :20], q)
    pout, plse = block_forward(*padded[:3], True, scale)
    torch.testing.assert_close(pout[..., :20], out)
    torch.testing.assert_close(plse, lse)
    grads = block_backward(dout, q, k, v, out, lse, True, scale)
    pgrads = block_backward(padded[3], *padded[:3], pout, plse, True, scale)
    for g, pg in zip(grads, pgrads):
        torch.testing.assert_close(pg[..., :20], g)
