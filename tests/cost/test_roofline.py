"""The roofline: each kind of op's time on a target follows its formula exactly."""

import dataclasses
import math

import pytest
import torch

import nbscaler
from nbscaler import ComputeConfig, Hardware
from nbscaler.cost import roofline as R
from nbscaler.cost.flops import attention_flops, causal_fraction
from nbscaler.cost.software import Software
from nbscaler.recipe import Float8Scaling, LossScaling, Recipe
from nbscaler.cost.hardware import NumberFormat
from nbscaler.cost.local import fake_device
from nbscaler.models.gpt import GPT, GPTConfig, sample_batch

A100 = Hardware.named("A100-SXM-40GB")
EAGER = A100.running(Software(attention="materialized"))
PEAK, BW = 312e12, 1555e9
RATE = PEAK * 1305 / 1410                  # the tensor cores at the A100's sustained clock, not its boost
B, T, C, H = 8, 256, 512, 8


@pytest.fixture(scope="module")
def ops():
    cfg = GPTConfig(vocab_size=256, seq_len=T, n_layer=1, d_model=C, n_head=H)
    p = nbscaler.plan(GPT(cfg), {"batch": sample_batch(cfg, B)}, "data", ComputeConfig(1, 1, use_end2end=True),
                      module_dtype=torch.bfloat16)
    return p.local_runs[0][None].ops


def first(ops, op):
    return next(o for o in ops if o.node.op == op)


def test_a_matrix_product_ramps_up_to_its_efficiency_and_its_backward_is_two_products(ops):
    qkv = first(ops, "linear")
    flops = 2 * B * T * C * 3 * C
    fwd, bwd = R.RooflineOps(A100).time(qkv)
    assert A100.matmul_efficiency == 0.859                     # the measured A100 ceiling, not a default
    assert fwd == pytest.approx(flops / (RATE * 0.859) + R.MATMUL_RAMP_S, rel=1e-12)
    assert bwd == pytest.approx(2 * fwd, rel=1e-12)
    assert qkv.node.meta["flops_bwd"] == 2 * flops              # the bias's gradient is a sum, not a product
    small, large = (R.matmul_seconds(2 * n ** 3, PEAK, 0.859) for n in (1024, 4096))
    assert 2 * 1024 ** 3 / small / PEAK == pytest.approx(0.57, abs=0.01)        # the docstring's figures
    assert 2 * 4096 ** 3 / large / PEAK == pytest.approx(0.85, abs=0.01)


def test_causal_flash_attention_performs_the_pairs_below_the_diagonal_at_its_measured_rate(ops):
    """The model's FLOPs count every pair (as MFU does); the causal kernel performs (T + 1) / 2T of
    them, at the GPU's attention efficiency of the boost peak: the measured rate already holds the clock."""
    attn = first(ops, "attention")
    flops = 2 * B * H * T * T * (C // H) * 2
    assert attention_flops((B, H, T, C // H), (B, H, T, C // H), (B, H, T, C // H)) == flops
    assert attn.node.meta["flops_fwd"] == flops and attn.node.meta["flops_bwd"] == 2 * flops
    assert attn.node.meta["causal_fraction"] == causal_fraction(T, T) == (T + 1) / (2 * T)
    fwd, bwd = R.RooflineOps(dataclasses.replace(A100, memory_bytes_per_s=1e30)).time(attn)
    assert fwd == pytest.approx(flops * (T + 1) / (2 * T) / (PEAK * 0.55), rel=1e-12)
    assert A100.attention_efficiency == 0.55                    # FlashAttention-2's A100 figure
    assert bwd == pytest.approx(2.5 * fwd, rel=1e-12)
    fwd, bwd = R.RooflineOps(A100).time(attn)                   # at these shapes q, k, v and the output's bytes bind
    assert fwd == pytest.approx(R.memory_bytes(attn) / (BW * R.MEMORY_EFFICIENCY), rel=1e-12)


@pytest.mark.parametrize("t, s, kept", [(4, 4, 10), (2, 4, 3), (4, 2, 7), (1, 5, 1)])
def test_the_causal_fraction_counts_the_top_left_triangle(t, s, kept):
    mask = torch.ones(t, s, dtype=torch.bool).tril()            # what is_causal=True keeps in PyTorch
    assert int(mask.sum()) == kept and causal_fraction(t, s) == pytest.approx(kept / (t * s))


PAIRS = B * H * T * T                                            # (B, heads, T, T) scores
SCORES, QKV_B = PAIRS * 2, B * H * T * (C // H) * 2                # bf16
PRODUCT = 2 * PAIRS * (C // H)                                     # Q K^T, P V and each gradient product


def kernel(flops, nbytes):
    return max(R.matmul_seconds(flops, RATE, 0.859), nbytes / (BW * R.MEMORY_EFFICIENCY), R.KERNEL_FLOOR_S)


def test_materialized_attention_writes_and_reads_the_scores_in_ten_kernels(ops):
    attn = first(ops, "attention")
    eager = R.RooflineOps(EAGER)
    scores, qkv_b, product = SCORES, QKV_B, PRODUCT
    fwd, bwd = eager.time(attn)
    assert fwd == pytest.approx(kernel(product, 2 * qkv_b + scores) + kernel(0, 2 * scores)
                                + kernel(product, scores + 2 * qkv_b), rel=1e-12)
    assert bwd == pytest.approx(4 * kernel(product, scores + 2 * qkv_b) + kernel(0, 3 * scores), rel=1e-12)
    flash = R.RooflineOps(A100).time(attn)
    assert fwd > flash[0] and bwd > flash[1]                    # the T x T traffic costs what flash saves
    apart = R.RooflineOps(A100.running(Software(attention="materialized", fused_softmax=False))).time(attn)
    assert apart[0] == pytest.approx(fwd + 2 * kernel(0, 2 * scores), rel=1e-12)     # the scale and the mask
    assert apart[1] == pytest.approx(bwd + 2 * kernel(0, 2 * scores), rel=1e-12)


def test_attention_dropout_is_one_pass_over_the_materialized_probabilities_each_way(ops):
    attn = first(ops, "attention")
    without = R.RooflineOps(EAGER).time(attn)
    fwd, bwd = R.RooflineOps(A100.running(Software(attention="materialized", attention_dropout=0.1))).time(attn)
    dropout = kernel(0, 2 * SCORES + PAIRS * 1)                 # P in, dropped P out, a one-byte mask
    assert dropout == pytest.approx((2 * SCORES + PAIRS) / (BW * R.MEMORY_EFFICIENCY), rel=1e-12)
    assert fwd == pytest.approx(without[0] + dropout, rel=1e-12)
    assert bwd == pytest.approx(without[1] + dropout, rel=1e-12)
    flash = A100.running(Software(attention_dropout=0.1))      # FlashAttention drops on chip: no pass
    assert R.RooflineOps(flash).time(attn) == R.RooflineOps(A100).time(attn)


@pytest.mark.parametrize("p", [1.0, -0.1, True, "0.1"])
def test_an_attention_dropout_that_is_not_a_probability_is_refused(p):
    with pytest.raises(ValueError, match=r"attention_dropout=.* is invalid: give a probability in \[0, 1\)"):
        Software(attention_dropout=p)


def test_compute_runs_at_the_sustained_clock_and_memory_at_the_datasheet_bandwidth(ops):
    qkv, norm = first(ops, "linear"), first(ops, "norm")
    flops = 2 * B * T * C * 3 * C
    boost = dataclasses.replace(A100, sustained_clock_ratio=1.0)
    assert A100.sustained_clock_ratio == 1305 / 1410 and A100.sustained_flops(torch.bfloat16) == RATE
    assert A100.peak_flops(torch.bfloat16) == PEAK               # MFU and HFU stay quoted against it
    assert R.RooflineOps(boost).time(qkv)[0] == pytest.approx(flops / (PEAK * 0.859) + R.MATMUL_RAMP_S, rel=1e-12)
    assert R.RooflineOps(A100).time(qkv)[0] == pytest.approx(flops / (RATE * 0.859) + R.MATMUL_RAMP_S, rel=1e-12)
    assert R.RooflineOps(A100).time(norm) == R.RooflineOps(boost).time(norm)     # bound by memory: no change


def test_targets_without_a_sourced_clock_or_dropout_price_as_before(ops):
    for name, hw in Hardware.catalogue().items():
        assert hw.software == Software()                           # today's PyTorch: flash, overlapped, unfused
        assert hw.sustained_clock_ratio == (1305 / 1410 if name.startswith("A100") else 1.0)
    h100, qkv = Hardware.named("H100-SXM-80GB"), first(ops, "linear")
    flops = 2 * B * T * C * 3 * C
    assert h100.sustained_flops(torch.bfloat16) == h100.peak_flops(torch.bfloat16) == 989.4e12
    assert R.RooflineOps(h100).time(qkv)[0] == pytest.approx(flops / (989.4e12 * 0.801) + R.MATMUL_RAMP_S, rel=1e-12)


def test_flash_attention_runs_at_its_own_gpus_measured_fraction_of_the_peak(ops):
    """FlashAttention-2 reaches 0.55 of an A100's peak and 0.35 of a Hopper's (its kernels do not use
    the Hopper's asynchronous tensor-core instructions): the same attention takes 0.55 / 0.35 of
    the A100's seconds over the H100's peak ratio."""
    attn = first(ops, "attention")
    slow = lambda hw: {k: v / 1e6 for k, v in hw.peak_flops_by_precision.items()}   # arithmetic binds at these shapes
    unbound = lambda hw: dataclasses.replace(hw, memory_bytes_per_s=1e30, peak_flops_by_precision=slow(hw))
    h100 = Hardware.named("H100-SXM-80GB")
    assert [Hardware.named(n).attention_efficiency for n in ("A100-SXM-80GB", "H100-SXM-80GB", "H200-SXM-141GB")] \
        == [0.55, 0.35, 0.35]
    a, h = (R.RooflineOps(unbound(hw)).time(attn)[0] for hw in (A100, h100))
    assert a / h == pytest.approx((989.4e12 * 0.35) / (PEAK * 0.55), rel=1e-12)
    with pytest.raises(ValueError, match=r"attention_efficiency=1.5 must be a fraction of the peak"):
        dataclasses.replace(h100, attention_efficiency=1.5)


def _arithmetic_bound(hw: Hardware) -> Hardware:
    """``hw`` with peaks a million times lower and endless bandwidth: arithmetic binds at these shapes."""
    return dataclasses.replace(hw, memory_bytes_per_s=1e30,
                               peak_flops_by_precision={k: v / 1e6 for k, v in hw.peak_flops_by_precision.items()})


def test_cudnn_attention_runs_flashs_work_at_its_measured_speedup_each_way(ops):
    """cuDNN's kernels do the pairs FlashAttention-2 does, faster by the ratios FlashAttention-3's
    paper measured beside it on an H100: at 64 channels a head 408/321 forward, 417/279 backward."""
    attn = first(ops, "attention")
    unbound = _arithmetic_bound(A100)
    flash = R.RooflineOps(unbound).time(attn)
    cudnn = R.RooflineOps(unbound.running(Software(attention="cudnn"))).time(attn)
    assert C // H == 64 and flash[0] / cudnn[0] == pytest.approx(408 / 321) and flash[1] / cudnn[1] == pytest.approx(417 / 279)
    assert R.attention_speedup(R.AttentionKind.CUDNN, 128) == (609 / 368, 499 / 310)
    assert R.skips_masked_pairs(unbound.running(Software(attention="cudnn")))
    assert not R.skips_masked_pairs(EAGER)


def test_a_sliding_window_is_priced_as_its_band_where_the_kernel_skips_blocks():
    """A windowed kernel performs the pairs of its band alone; materialised scores compute every pair."""
    from nbscaler.models.llama import Llama, LlamaConfig, sample_batch as llama_batch
    cfg = LlamaConfig(seq_len=T, n_layer=2, d_model=C, n_head=H, n_kv_head=H, sdpa=True, sliding_window=32,
                      window_layers="alternate")
    p = nbscaler.plan(Llama(cfg), llama_batch(cfg, B), "data", ComputeConfig(1, 1), module_dtype=torch.bfloat16)
    windowed, full = [o for o in p.local_runs[0][None].ops if o.node.op == "attention"]
    band = causal_fraction(T, T, 32)
    assert band == pytest.approx((32 * 33 / 2 + (T - 32) * 32) / T ** 2)
    unbound = _arithmetic_bound(A100)
    (wf, wb), (ff, fb) = (R.RooflineOps(unbound).time(o) for o in (windowed, full))
    assert wf == pytest.approx(attention_flops(*[s for s, _, _ in windowed.in_shapes[:3]]) * band / (PEAK / 1e6 * 0.55))
    assert wf / ff == pytest.approx(band / causal_fraction(T, T)) and wb / fb == pytest.approx(band / causal_fraction(T, T))
    eager = _arithmetic_bound(EAGER)
    assert R.RooflineOps(eager).time(windowed) == R.RooflineOps(eager).time(full)


@pytest.mark.parametrize("ratio", [0, 1.2, True])
def test_a_sustained_clock_above_the_boost_or_not_a_ratio_is_refused(ratio):
    with pytest.raises(ValueError, match=r"sustained_clock_ratio=.* must be the sustained clock over the boost"):
        dataclasses.replace(A100, sustained_clock_ratio=ratio)


def test_an_unknown_attention_kind_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="flash, cudnn, materialized"):
        Software(attention="xformers")


def test_norms_and_elementwise_ops_are_bound_by_memory_and_views_are_free(ops):
    norm = first(ops, "norm")
    nbytes = 2 * (B * T * C) * 2 + 2 * C * 2                   # input and output bf16, weight and bias
    fwd, bwd = R.RooflineOps(A100).time(norm)
    assert fwd == pytest.approx(max(nbytes / (BW * R.MEMORY_EFFICIENCY), R.KERNEL_FLOOR_S), rel=1e-12)
    assert fwd > R.KERNEL_FLOOR_S and bwd == 2 * fwd
    assert R.RooflineOps(A100).time(first(ops, "reshape")) == (0.0, 0.0)
    tiny = R.RooflineOps(Hardware.named("H200-SXM-141GB")).time(first(ops, "constructor"))
    assert tiny == (R.KERNEL_FLOOR_S, 0.0)                     # an arange: the kernel floor, no gradient


def test_an_embedding_reads_the_rows_it_gathers_and_its_backward_writes_the_table(ops):
    emb = first(ops, "embedding")
    gathered = B * T * 8 + 2 * B * T * C * 2                    # int64 indices, rows read and written
    fwd, bwd = R.RooflineOps(A100).time(emb)
    assert fwd == pytest.approx(gathered / (BW * R.MEMORY_EFFICIENCY), rel=1e-12)
    assert bwd == pytest.approx((gathered + 256 * C * 2) / (BW * R.MEMORY_EFFICIENCY), rel=1e-12)


def test_an_optimizer_step_streams_its_tensors():
    seconds = R.RooflineOps(A100).update([1000, 24], torch.bfloat16, Recipe(torch.optim.AdamW))
    assert seconds == pytest.approx((7 + 4) * 1024 * 2 / (BW * R.MEMORY_EFFICIENCY))
    sgd = R.RooflineOps(A100).update([1024], torch.float32, Recipe(torch.optim.SGD, optimizer_kwargs={"momentum": 0.9}))
    assert sgd == pytest.approx((5 + 4) * 1024 * 4 / (BW * R.MEMORY_EFFICIENCY))
    assert math.isclose(R.RooflineOps(A100).update([], torch.float32, Recipe(torch.optim.SGD)), 0.0)


def test_clipping_and_loss_scaling_add_their_passes_over_the_gradients():
    """The recipe's loop, not the target, says whether the gradients are clipped and unscaled."""
    plain = R.RooflineOps(A100).update([1024], torch.float32, Recipe(torch.optim.Adam))
    megatron = Recipe(torch.optim.Adam, clip_grad_norm=1.0, loss_scaling=LossScaling())
    seconds = R.RooflineOps(A100).update([1024], torch.float32, megatron)
    assert seconds == pytest.approx((7 + 4 + 3 + 2) * 1024 * 4 / (BW * R.MEMORY_EFFICIENCY))
    assert seconds - plain == pytest.approx((R.CLIP_TENSORS + R.UNSCALE_TENSORS) * 1024 * 4 / (BW * R.MEMORY_EFFICIENCY))


def test_a_gpu_without_the_plans_precision_is_refused(ops):
    with pytest.raises(ValueError, match="T4.*no bfloat16"):
        R.RooflineOps(Hardware.named("T4")).time(first(ops, "linear"))


@pytest.fixture(scope="module")
def dropped():
    """The fixture's GPT with Megatron-LM's hidden dropout (p = 0.1) before each residual add."""
    cfg = GPTConfig(vocab_size=256, seq_len=T, n_layer=1, d_model=C, n_head=H, dropout=0.1)
    return nbscaler.plan(GPT(cfg), {"batch": sample_batch(cfg, B)}, "data", ComputeConfig(1, 1, use_end2end=True),
                         module_dtype=torch.bfloat16)


def test_a_residual_dropout_is_one_pass_each_way_and_costs_nothing_in_eval_mode(dropped):
    drops = [o for o in dropped.local_runs[0][None].ops if o.node.target == R.DROPOUT_TARGET]
    assert [o.node.module_path for o in drops] == ["blocks.0.attn.drop", "blocks.0.mlp.drop"]
    one_pass = kernel(0, B * T * C * (2 * 2 + 1))                 # bf16 in, bf16 out, a one-byte mask
    assert one_pass > R.KERNEL_FLOOR_S
    for op in drops:
        assert op.node.meta["into_add"]                               # each feeds a residual add
        assert R.RooflineOps(A100).time(op) == (pytest.approx(one_pass, rel=1e-12), pytest.approx(one_pass, rel=1e-12))
        fused = R.RooflineOps(A100.running(Software(fused_bias_dropout_add=True))).time(op)
        assert fused == (pytest.approx(B * T * C * 1 / (BW * R.MEMORY_EFFICIENCY), rel=1e-12),   # its mask alone
                         pytest.approx(one_pass, rel=1e-12))
        evaluating = dataclasses.replace(op, node=dataclasses.replace(op.node, kwargs={**op.node.kwargs, "training": False}))
        assert R.RooflineOps(A100).time(evaluating) == (0.0, 0.0)


def test_a_plan_with_dropout_takes_its_passes_longer_and_saves_its_masks(dropped):
    cfg = GPTConfig(vocab_size=256, seq_len=T, n_layer=1, d_model=C, n_head=H)
    plain = nbscaler.plan(GPT(cfg), {"batch": sample_batch(cfg, B)}, "data", ComputeConfig(1, 1, use_end2end=True),
                          module_dtype=torch.bfloat16)
    before, after = (p.summary(torch.optim.Adam, hardware=A100).iloc[0] for p in (plain, dropped))
    one_pass = kernel(0, B * T * C * (2 * 2 + 1))
    assert after.step_time_s - before.step_time_s == pytest.approx(2 * 2 * one_pass, rel=1e-9)   # 2 dropouts, F and B
    # The mask autograd keeps: a bool on CUDA (native_dropout); the CPU's dropout keeps its scaled
    # mask in the input's dtype (bf16 here).
    mask = R.DROPOUT_MASK_BYTES if fake_device().type == "cuda" else 2
    assert after.activation_bytes - before.activation_bytes == 2 * B * T * C * mask


class Conv1D(torch.nn.Module):
    """GPT-2's projection: ``addmm(bias, x, weight)`` with the weight stored (in, out)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(C, 3 * C))
        self.bias = torch.nn.Parameter(torch.zeros(3 * C))

    def forward(self, x):
        return torch.addmm(self.bias, x.view(-1, C), self.weight).sum()


def test_gpt2s_addmm_is_priced_as_the_linear_it_is(ops):
    p = nbscaler.plan(Conv1D(), {"x": torch.randn(B, T, C)}, "dp", ComputeConfig(1, 1), module_dtype=torch.bfloat16)
    addmm = first(p.local_runs[0][None].ops, "addmm")
    assert R.RooflineOps(A100).time(addmm) == R.RooflineOps(A100).time(first(ops, "linear"))
    assert addmm.node.meta["flops_bwd"] == 2 * addmm.node.meta["flops_fwd"]


def test_a_product_that_moves_more_than_it_computes_is_bound_by_its_memory(ops):
    """A product reads its operands and writes its output: on a GPU with slow memory (or a narrow
    product, as a key projection with one head per GPU) that, not its arithmetic, sets its time."""
    qkv = first(ops, "linear")
    slow = dataclasses.replace(A100, memory_bytes_per_s=1e11)
    fwd, bwd = R.RooflineOps(slow).time(qkv)
    assert fwd == pytest.approx(R.memory_bytes(qkv) / (1e11 * R.MEMORY_EFFICIENCY), rel=1e-12)
    assert fwd > R.RooflineOps(A100).time(qkv)[0] and bwd == pytest.approx(2 * fwd, rel=1e-12)


def test_an_op_that_is_no_product_runs_its_flops_at_the_vector_rate(ops):
    norm = first(ops, "norm")
    assert A100.vector_flops() == 19.5e12 * 1305 / 1410                # the datasheet's fp32, at the sustained clock
    slow = dataclasses.replace(A100, peak_flops_by_precision={**A100.peak_flops_by_precision, NumberFormat.FP32: 1e9})
    fwd, bwd = R.RooflineOps(slow).time(norm)
    assert fwd == pytest.approx(norm.node.meta["local_flops_fwd"] / slow.vector_flops(), rel=1e-12)
    assert bwd == pytest.approx(norm.node.meta["local_flops_bwd"] / slow.vector_flops(), rel=1e-12)
    assert R.RooflineOps(A100).time(norm)[0] < fwd                     # on the real A100, memory binds
    no_fp32 = dataclasses.replace(A100, peak_flops_by_precision={NumberFormat.BF16: 312e12, NumberFormat.TF32: 156e12})
    assert no_fp32.vector_flops() == 156e12 * 1305 / 1410              # without one: its slowest peak


H100 = Hardware.named("H100-SXM-80GB")


def test_an_fp8_linear_is_its_casts_and_three_products_at_the_fp8_peak(ops):
    """torchao's float8 training: the forward casts the input and the weight and takes one product;
    the backward casts the output's gradient twice, the weight and the input once more, and takes two
    products; each product reads fp8 operands and writes bf16."""
    qkv = first(ops, "linear")
    (x, dt, _), (w, _, _), _ = qkv.in_shapes
    (y, _), = qkv.out_shapes
    n = lambda shape: math.prod(shape)
    flops, h, bw = 2 * B * T * C * 3 * C, dt.itemsize, H100.memory_bytes_per_s
    fp8_rate = H100.sustained_flops(torch.float8_e4m3fn) * H100.matmul_efficiency
    assert fp8_rate == pytest.approx(2 * H100.sustained_flops(torch.bfloat16) * H100.matmul_efficiency, rel=1e-4)
    kernel = lambda nbytes: max(R.memory_seconds(nbytes, bw), R.KERNEL_FLOOR_S)
    product = lambda a, b, out: max(flops / fp8_rate + R.MATMUL_RAMP_S, R.memory_seconds(n(a) + n(b) + n(out) * h, bw))
    size = lambda side: h if side == R.OWN else side
    for compiled, passes in ((False, R.EAGER_CAST), (True, R.COMPILED_CAST)):
        cast = lambda shape: sum(kernel(n(shape) * (size(r) + size(wr))) for r, wr in passes)
        copy = lambda shape: 0.0 if compiled else kernel(2 * n(shape))    # an fp8 operand into the other layout
        target = H100.running(Software(compiled=compiled))
        fwd, bwd = R.RooflineOps(target, float8=Float8Scaling.TENSORWISE).time(qkv)
        assert fwd == pytest.approx(cast(x) + cast(w) + copy(w) + product(x, w, y), rel=1e-12)
        assert bwd == pytest.approx(2 * cast(y) + cast(w) + cast(x) + copy(y) + copy(x) + product(y, w, x)
                                    + product(y, x, w), rel=1e-12)
    # Eager, a bf16 tensor's cast moves 33 bytes an element in 6 kernels (abs 4, amax 2, the upcast to
    # fp32 6, the scaling 8, the clamp 8, the cast to fp8 5); compiled, 5 in 2.
    assert [sum(size(r) + size(wr) for r, wr in p) for p in (R.EAGER_CAST, R.COMPILED_CAST)] == [33, 5] and h == 2
    assert R.cast_bytes(1, 2, False) == [4, 2, 6, 8, 8, 5]
    assert R.cast_bytes(1, 4, False) == [8, 4, 8, 8, 5]       # an fp32 tensor: no upcast, the same 33 bytes
    bf16 = R.RooflineOps(H100).time(qkv)
    assert R.RooflineOps(H100, Float8Scaling.TENSORWISE, ("attn",)).time(qkv) == bf16     # float8_skip: bf16 as before


def test_fp8_products_need_fp8_units_and_a_target():
    with pytest.raises(ValueError, match=r"float8='tensorwise'.*T4.*no fp8 tensor cores.*float8=None"):
        R.RooflineOps(Hardware.named("T4"), Float8Scaling.TENSORWISE)
    cfg = GPTConfig(vocab_size=256, seq_len=32, n_layer=1, d_model=64, n_head=4)
    plan = nbscaler.plan(GPT(cfg), {"batch": sample_batch(cfg, 2)}, "data", ComputeConfig(1, 1, use_end2end=True),
                         module_dtype=torch.bfloat16)
    fp8 = Recipe(float8="tensorwise")
    with pytest.raises(ValueError, match=r"float8='tensorwise'.*priced on a target"):
        plan.step_figures(recipe=fp8)
    faster, slower = (plan.step_figures(recipe=r, hardware=H100).step_time_s for r in (fp8, Recipe()))
    assert plan.step_model(H100, fp8) is not plan.step_model(H100) and plan.step_model(H100, fp8) is plan.step_model(H100, fp8)
    assert faster != slower
    with pytest.raises(ValueError, match="prices products as"):
        plan.step_model(H100).device_steps(1, fp8)
