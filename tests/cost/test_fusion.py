"""The fusion pass: which tensors a compiled element-wise chain keeps out of memory, and what a
compiled target's ops then move."""


import pytest
import torch

import nbscaler
from nbscaler import ComputeConfig, Hardware
from nbscaler.cost import roofline as R
from nbscaler.cost.fusion import kept_in_registers
from nbscaler.cost.software import Software
from nbscaler.models.gpt import GPT, GPTConfig, sample_batch
from tests.models import hf

H100 = Hardware.named("H100-SXM-80GB")
COMPILED = H100.running(Software(compiled=True))


def _ops(model, args, dtype=None):
    plan = nbscaler.plan(model, args, "data", ComputeConfig(1, 1, use_end2end=True), module_dtype=dtype)
    return {op.node.name: op for op in plan.local_runs[0][None].ops}


@pytest.fixture(scope="module")
def gpt():
    cfg = GPTConfig(vocab_size=256, seq_len=64, n_layer=1, d_model=64, n_head=4)
    return _ops(GPT(cfg), {"batch": sample_batch(cfg, 2)}, torch.bfloat16)


@pytest.fixture(scope="module")
def llama():
    return _ops(hf.build("hf_llama"), hf.batch("hf_llama", torch.Generator().manual_seed(0)))


def test_a_norm_reads_the_residual_add_before_it_in_registers_but_the_next_add_waits_for_the_mlp(gpt):
    # x = x + attn(ln1(x)); x = x + mlp(ln2(x)); ln_f(x)
    add_1, norm_1, add_2, norm_2 = (gpt[n].node.meta for n in ("add_1", "norm_1", "add_2", "norm_2"))
    assert norm_1["fused_reads"][0] == "blocks.0"          # ln2 runs in the kernel of the add before it
    assert add_1["fused_readers"] is None                  # which still writes its sum: the second add reads it after the MLP
    assert add_2["fused_reads"] == (None, None)            # that add begins a kernel: it waited for the MLP's product
    assert add_2["fused_readers"] == ("ln_f",) and norm_2["fused_reads"][0] == "blocks.0"   # read by ln_f alone: never written
    assert all(gpt[n].node.meta["fused_readers"] is None for n in ("linear_2", "attention_0", "embedding_0"))


def test_rmsnorm_swiglu_and_rope_are_one_kernel_each(llama):
    layer = "model.model.layers.0"
    norm = [op.node for op in llama.values() if op.node.module_path == f"{layer}.input_layernorm"]
    assert [n.op for n in norm] == ["elementwise", "elementwise", "reduce", "elementwise", "elementwise",
                                    "elementwise", "elementwise", "elementwise"]       # to, pow, mean, +eps, rsqrt, *, to, *weight
    assert all(n.meta["fused_readers"] is not None for n in norm[1:-1])   # only the first's input and the last's output move
    assert norm[-1].meta["fused_readers"] is None                          # the projections read the normalised input
    swiglu = next(op.node for op in llama.values() if op.node.module_path == f"{layer}.mlp" and op.node.op == "elementwise")
    assert swiglu.meta["fused_reads"] == (f"{layer}.mlp.act_fn", None)    # SiLU in registers, the up-projection read
    rope_q = next(op.node for op in llama.values() if op.node.module_path == f"{layer}.self_attn" and op.node.target == "Tensor.add")
    assert rope_q.meta["fused_reads"] == (f"{layer}.self_attn",) * 2       # q cos + rotate_half(q) sin, one kernel


def test_a_compiler_of_some_modules_cuts_the_chains_at_their_edges(llama):
    first_of_final_norm = next(op.node for op in llama.values() if op.node.module_path == "model.model.norm")
    assert first_of_final_norm.meta["fused_reads"] == ("model.model.layers.1",)
    assert kept_in_registers(first_of_final_norm)[0] == (True,)
    assert kept_in_registers(first_of_final_norm, ("layers",)) == ((False,), False)     # the norm is eager there
    inside = next(op.node for op in llama.values() if op.node.module_path == "model.model.layers.1.input_layernorm"
                  and op.node.meta["fused_readers"] is not None)
    assert kept_in_registers(inside, ("layers",))[1]


def test_a_compiled_target_prices_each_fused_op_by_what_crosses_its_kernel(gpt):
    norm_1 = gpt["norm_1"]                                          # reads the add in registers, writes its output
    (x, dt, _), weight, bias = norm_1.in_shapes
    item = dt.itemsize
    out = x[0] * x[1] * x[2] * item
    assert R.memory_bytes(norm_1) == 2 * out + 2 * weight[0][0] * item
    assert R.memory_bytes(norm_1, ()) == out + 2 * weight[0][0] * item                    # the add's sum not read
    eager, compiled = R.RooflineOps(H100).time(norm_1), R.RooflineOps(COMPILED).time(norm_1)
    assert compiled[0] == pytest.approx(max(R.memory_seconds(out + 2 * weight[0][0] * item, H100.memory_bytes_per_s),
                                            R.KERNEL_FLOOR_S), rel=1e-12)
    assert compiled[0] < eager[0] or eager[0] == R.KERNEL_FLOOR_S
    add_2 = gpt["add_2"]                                                 # read by ln_f alone: no write, no launch
    t = R.RooflineOps(COMPILED).time(add_2)[0]
    assert t == pytest.approx(R.memory_seconds(R.memory_bytes(add_2, ()), H100.memory_bytes_per_s), rel=1e-12)
    assert R.memory_bytes(add_2, ()) == 2 * out and R.memory_bytes(add_2) == 3 * out     # both summands read, no sum written


def test_compiling_shortens_a_step_by_its_element_wise_traffic_alone(gpt):
    cfg = GPTConfig(vocab_size=256, seq_len=64, n_layer=2, d_model=64, n_head=4)
    plan = nbscaler.plan(GPT(cfg), {"batch": sample_batch(cfg, 2)}, "data", ComputeConfig(1, 1, use_end2end=True),
                         module_dtype=torch.bfloat16)
    eager, compiled = (plan.step_figures(hardware=h).step_time_s for h in (H100, COMPILED))
    assert compiled < eager
    ops = plan.local_runs[0][None].ops
    products = [op for op in ops if op.node.meta["product"] or op.node.op == "attention"]
    assert [R.RooflineOps(H100).time(op) for op in products] == [R.RooflineOps(COMPILED).time(op) for op in products]


def test_compiled_modules_need_compiled_and_read_in_the_description():
    assert "compiled in layers" in Software(compiled=True, compiled_modules="layers").describe()
    with pytest.raises(ValueError, match=r"compiled_modules=.*compiled=True"):
        Software(compiled_modules=("layers",))
    with pytest.raises(ValueError, match=r"Software\(compiled='yes'\)"):
        Software(compiled="yes")
