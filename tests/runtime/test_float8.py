"""``float8_linear`` in one process: torchao's float8 training bit for bit, within fp8's precision
of the high-precision product, and what generated code calls for it.

Tolerance of an fp8 product against the same product in fp32 (``test_product_within_fp8_precision``).
A cast ``q(a) = round_fp8(a * s) / s`` keeps ``p`` significant bits (e4m3: 4, e5m2: 3) while
``a * s`` is a normal fp8 number, a relative error of at most ``u = 2**-p`` (round to nearest);
below the smallest normal (e4m3: ``2**-6``, e5m2: ``2**-14``) the spacing is fixed, an absolute
error of at most half the smallest subnormal's spacing, ``2**-10 / s`` (e4m3) or ``2**-17 / s``
(e5m2). So ``|q(a) - a| <= u * |a| + tiny / s``, and a product of two cast operands, summed over
the inner dimension in fp32, is off by at most ``sum_k (2u + u**2) |x_k w_k| + (tiny terms)``:
the bound the test checks elementwise, for the forward (e4m3 operands) and for the gradients
(tensorwise: e5m2 gradients against e4m3 operands).
"""

from __future__ import annotations

import copy
import sys

import pytest
import torch
import torch.nn.functional as F

from nbscaler import ComputeConfig, Recipe, plan
from nbscaler.codegen.render import CodegenError
from nbscaler.runtime.float8 import check_product_shape, float8_linear, require_torchao
from tests.models import batch, build

E4M3 = (2.0 ** -4, 2.0 ** -10)        # (unit roundoff, half the smallest subnormal spacing)
E5M2 = (2.0 ** -3, 2.0 ** -17)


def torchao_linear(lin: torch.nn.Linear, scaling: str) -> torch.nn.Module:
    """``lin`` converted by torchao's own float8 training: the one-process recipe."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    return convert_to_float8_training(torch.nn.Sequential(copy.deepcopy(lin)),
                                      config=Float8LinearConfig.from_recipe_name(scaling))[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_float8_linear_is_torchao_float8_training_bit_for_bit(scaling, dtype):
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 8).to(dtype)
    ref = torchao_linear(lin, scaling)
    x = torch.randn(2, 4, 16, dtype=dtype, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    ours = float8_linear(x, lin.weight, lin.bias, scaling=scaling)
    theirs = ref(x_ref)
    ours.pow(2).sum().backward()
    theirs.pow(2).sum().backward()
    assert ours.dtype == dtype
    assert torch.equal(ours, theirs)
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(lin.weight.grad, ref.weight.grad)
    assert torch.equal(lin.bias.grad, ref.bias.grad)


def _bound(a: torch.Tensor, b: torch.Tensor, fmt_a, fmt_b) -> torch.Tensor:
    """Elementwise bound on ``|q(a) @ q(b) - a @ b|`` for tensorwise casts (see the module docstring)."""
    (ua, ta), (ub, tb) = fmt_a, fmt_b
    sa, sb = 448.0 / a.abs().max() if fmt_a is E4M3 else 57344.0 / a.abs().max(), \
        448.0 / b.abs().max() if fmt_b is E4M3 else 57344.0 / b.abs().max()
    rel = (ua + ub + ua * ub) * (a.abs() @ b.abs())
    tiny = (ta / sa) * (torch.ones_like(a) @ b.abs()) * (1 + ub) + (tb / sb) * (a.abs() @ torch.ones_like(b)) * (1 + ua) \
        + (ta / sa) * (tb / sb) * a.shape[-1]
    return rel + tiny + 1e-6 * (a.abs() @ b.abs())         # and fp32's own rounding of the sums


def test_product_within_fp8_precision():
    """tensorwise: the output within the e4m3 x e4m3 bound of the fp32 product, the input's gradient
    within the e5m2 x e4m3 bound, the weight's within e5m2 x e4m3 (module docstring)."""
    torch.manual_seed(1)
    x = torch.randn(32, 64, requires_grad=True)
    w = torch.randn(24, 64, requires_grad=True)
    grad = torch.randn(32, 24)
    y = float8_linear(x, w, scaling="tensorwise")
    y.backward(grad)
    exact = x.detach() @ w.detach().t()
    assert ((y.detach() - exact).abs() <= _bound(x.detach(), w.detach().t(), E4M3, E4M3)).all()
    assert ((x.grad - grad @ w.detach()).abs() <= _bound(grad, w.detach(), E5M2, E4M3)).all()
    assert ((w.grad - grad.t() @ x.detach()).abs() <= _bound(grad.t(), x.detach(), E5M2, E4M3)).all()
    assert not torch.equal(y.detach(), exact)           # it did round: the product is fp8's, not fp32's


def _source(model: str, policy: str, n: int, recipe=None, rank: int = 0) -> str:
    cfg = ComputeConfig(plan_ngpus=n, runtime_ngpus=n)
    return plan(build(model), batch(model, 0), policy, cfg, recipe=recipe).sources[rank]


def test_generated_code_calls_float8_linear_with_the_group_that_splits_each_product():
    """MLP under tp: fc1 split by output features (n), fc2 and head by input features (k); without
    the recipe the same plan calls F.linear."""
    code = _source("mlp", "tp", 2, Recipe(float8="tensorwise"))
    assert "from nbscaler.runtime.float8 import float8_linear" in code
    assert "float8_linear(x_sum_grad, self.fc1_weight, self.fc1_bias, scaling='tensorwise', n_group=g0_1)" in code
    assert code.count("scaling='tensorwise', k_group=g0_1)") == 2
    assert "F.linear(" not in code
    assert "fp8 products (tensorwise)" in code
    plain = _source("mlp", "tp", 2)
    assert "float8_linear" not in plain and plain.count("F.linear(") == 3


def test_float8_skip_leaves_the_named_layers_in_the_modules_dtype():
    """As torchtitan leaves its output layer in bf16: ``head`` stays F.linear, fc1 and fc2 take fp8;
    the cost model prices exactly those two in fp8."""
    recipe = Recipe(float8="tensorwise", float8_skip=("head",))
    code = _source("mlp", "tp", 2, recipe)
    assert code.count("float8_linear(") == 2 and code.count("F.linear(") == 1 and "self.head_weight" in code
    assert "fp8 products (tensorwise, but head)" in code
    from nbscaler.cost.roofline import fp8_product
    placed = plan(build("mlp"), batch("mlp", 0), "tp", ComputeConfig(2, 2), recipe=recipe)
    linears = [n for n in placed.graph.nodes if n.op == "linear"]
    assert {n.module_path for n in linears if fp8_product(n, recipe.float8, recipe.float8_skip)} == {"fc1", "fc2"}
    with pytest.raises(CodegenError, match="no nn.Linear layer outside fc1, fc2, head"):
        _source("mlp", "tp", 2, Recipe(float8="tensorwise", float8_skip=("fc1", "fc2", "head")))


def test_data_split_names_the_rows_group():
    code = _source("mlp", "data", 2, Recipe(float8="rowwise"))
    assert code.count("scaling='rowwise', m_group=g0_1)") == 3


class NoLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 4))

    def forward(self, x, y):
        return F.cross_entropy(x @ self.w, y)


def test_float8_recipe_on_a_module_without_linear_layers_names_the_fix():
    cfg = ComputeConfig(plan_ngpus=1, runtime_ngpus=1)
    p = plan(NoLinear(), batch("mlp", 0), "dp", cfg, recipe=Recipe(float8="tensorwise"))
    with pytest.raises(CodegenError, match="no nn.Linear layer.*float8=None"):
        p.sources[0]


def test_missing_torchao_is_refused_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)     # as if torchao were not installed
    with pytest.raises(ImportError, match=r"pip install torch==\S+ torchao==0.18.0"):
        require_torchao()


def test_a_shape_cuda_fp8_kernels_cannot_take_names_the_fix():
    """CUDA's torch._scaled_mm takes products whose dimensions are multiples of 16; the CPU's any."""
    check_product_shape(3, 10, 6, "cpu")
    check_product_shape(64, 32, 48, "cuda")
    with pytest.raises(ValueError, match=r"multiples of 16.*this rank has 24 input features, 8 output features.*"
                                         r"float8=None"):
        check_product_shape(32, 24, 8, "cuda")


def test_a_gpu_without_fp8_tensor_cores_is_refused_by_name(monkeypatch):
    """No such GPU here: torch.cuda is told it has a T4 (capability 7.5) and an H100 (9.0)."""
    from nbscaler.runtime.float8 import check_fp8_device
    found = {0: ((7, 5), "Tesla T4"), 1: ((9, 0), "NVIDIA H100 80GB HBM3")}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: found[d.index][0])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: found[d.index][1])
    check_fp8_device.cache_clear()
    try:
        with pytest.raises(ValueError, match=r"fp8 tensor cores .*8\.9 or newer.*cuda:0 is a Tesla T4 \(7\.5\).*float8=None"):
            check_fp8_device(torch.device("cuda", 0))
        check_fp8_device(torch.device("cuda", 1))
        check_fp8_device(torch.device("cpu"))
    finally:
        check_fp8_device.cache_clear()
