"""Mixed precision in one process: the precision settings, the loss scaler, and fp16 training with
dynamic loss scaling (kept tiny: fp16 matmuls are slow on a CPU)."""

import pytest
import torch

from nbscaler import ComputeConfig, build_optimizer, parallelize
from nbscaler.recipe import AS_HELD, Recipe
from nbscaler.planning.planner import cast_floats
from nbscaler.runtime.scaler import LossScaler
from tests.models import batch, build
from tests.multiprocess import OPTIMIZERS, Case, reference_loss_scaled, samples

FP16, FP32 = torch.float16, torch.float32


@pytest.mark.parametrize("kwargs, words", [({"master_dtype": torch.int32}, "master_dtype"),
                                           ({"grad_reduce_dtype": "bf16"}, "grad_reduce_dtype")])
def test_precision_refuses_what_is_not_a_float_dtype(kwargs, words):
    with pytest.raises(ValueError, match=words):
        Recipe(**kwargs)


def test_precision_reduces_in_the_master_dtype_unless_told():
    assert AS_HELD.reduce_dtype(torch.bfloat16) == torch.bfloat16
    assert Recipe(master_dtype=FP32).reduce_dtype(torch.bfloat16) == FP32
    assert Recipe(master_dtype=FP32, grad_reduce_dtype=torch.bfloat16).reduce_dtype(torch.bfloat16) == torch.bfloat16
    assert Recipe(master_dtype=FP32).master_of(FP32) is None           # an fp32 module needs no copy


def test_loss_scaler_backs_off_on_overflow_and_grows_after_good_steps():
    scaler = LossScaler(init_scale=8.0, growth_factor=2.0, backoff_factor=0.25, growth_interval=2)
    grads = [torch.tensor([8.0, 16.0])]
    assert not scaler.unscale(grads, torch.device("cpu")) and grads[0].tolist() == [1.0, 2.0]
    assert scaler.unscale([torch.tensor([1.0, float("inf")])], torch.device("cpu"))
    scaler.update(True)
    assert (scaler.value, scaler.skipped) == (2.0, 1)
    scaler.update(False)
    assert scaler.value == 2.0
    scaler.update(False)
    assert scaler.value == 4.0 and scaler.good_steps == 0
    restored = LossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.state_dict() == scaler.state_dict()


def test_loss_scaler_settings_are_checked():
    with pytest.raises(ValueError, match="backoff_factor"):
        LossScaler(backoff_factor=2.0)


FP16_CASE = Case("mlp", "dp", 1, 1, steps=4, optimizer="adamw", module_dtype=FP16, master_dtype=FP32)


def test_fp16_with_loss_scaling_skips_the_overflowing_step(tmp_path):
    """The first scale overflows fp16 (the scaled loss is inf): that step changes nothing and the
    scale backs off; the next steps train as the plain recipe does, and the scale grows."""
    case = FP16_CASE
    scale, backoff, interval = 2.0 ** 20, 2.0 ** -8, 2
    pm = parallelize(build("mlp"), samples(case, 0, 0)[0], "dp", ComputeConfig(1, 1), gen_savedir=tmp_path,
                     module_dtype=FP16)
    scaler = LossScaler(init_scale=scale, backoff_factor=backoff, growth_interval=interval)
    opt = build_optimizer(pm, torch.optim.AdamW, master_dtype=FP32, scaler=scaler, **OPTIMIZERS["adamw"][1])
    assert isinstance(opt, torch.optim.AdamW) and opt.scaler is scaler
    before = [p.detach().clone() for p in pm.parameters()]
    losses = []
    for step in range(case.steps):
        loss = pm(**samples(case, step, 0)[0])
        scaler.scale(loss).backward()
        opt.step()
        opt.zero_grad()
        losses.append([loss.item()])
        if step == 0:
            assert all(torch.equal(a, b) for a, b in zip(before, pm.parameters())), "the skipped step moved weights"
            assert not opt.state and scaler.value == scale * backoff
    ref = reference_loss_scaled(case, scale, backoff, interval)
    assert losses == ref["losses"]
    assert (scaler.value, scaler.skipped) == (ref["scale"], sum(ref["skipped"])) == (scale * backoff * 2, 1)
    assert all(torch.equal(a, b) for a, b in zip(pm.parameters(), ref["params"]))
    assert {p.dtype for p in pm.parameters()} == {FP16}
    with pytest.raises(ValueError, match="closure"):
        opt.step(lambda: pm(**samples(case, 0, 0)[0]))


def test_plain_layers_around_a_parallel_trunk_get_master_copies_too(tmp_path):
    """The plain layers' masters are updated and copied back like the trunk's: losses and the plain
    layers' bf16 parameters equal the recipe written out in one process."""
    bf16 = torch.bfloat16
    model, ref = build("with_trunk").to(bf16), build("with_trunk").to(bf16)
    model.trunk = parallelize(model.trunk, {"x": torch.randn(8, 16, dtype=bf16)}, "tp", ComputeConfig(1, 1),
                              gen_savedir=tmp_path, module_dtype=bf16)
    opt = build_optimizer(model, torch.optim.AdamW, master_dtype=FP32, lr=0.01)
    masters = [p.detach().float().requires_grad_() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=0.01)
    for step in range(3):
        args = cast_floats(batch("mlp", step), bf16)
        loss, ref_loss = model(**args), ref(**args)
        assert torch.equal(loss, ref_loss), f"step {step}"
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss.backward()
        for m, p in zip(masters, ref.parameters()):
            m.grad, p.grad = p.grad.float(), None
        ref_opt.step()
        with torch.no_grad():
            for p, m in zip(ref.parameters(), masters):
                p.copy_(m)
    saved = opt.state_dict()["state"]
    assert len(saved) == len(masters) and all(s["master"].dtype == FP32 for s in saved.values())
    trained = dict(model.named_parameters())
    for name in ("pre.weight", "pre.bias", "head.weight", "head.bias"):
        assert trained[name].dtype == bf16 and torch.equal(trained[name], ref.get_parameter(name)), name
    assert not torch.equal(trained["pre.weight"], build("with_trunk").to(bf16).pre.weight), "pre never moved"


def test_master_weights_of_another_model_are_refused_before_anything_is_copied():
    from nbscaler.runtime.checkpoint import load_master_weights
    from nbscaler.runtime.statecheck import CheckpointError
    model = build("mlp")
    before = [p.detach().clone() for p in model.parameters()]
    shapes = [p.shape for p in model.parameters()]
    state = {"state": {i: {"master": torch.ones(shape)} for i, shape in enumerate(shapes)}, "param_groups": []}
    state["state"][3]["master"] = torch.ones(7)
    with pytest.raises(CheckpointError, match="master of parameter 3"):
        load_master_weights(model, state)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    state["state"][3]["master"] = torch.ones(shapes[3])
    assert load_master_weights(model, state) == len(shapes)
    assert all(bool((p == 1).all()) for p in model.parameters())
