"""``nbscaler.Recipe``: its checks, its shorthands, the one default, and every entry point that
takes ``recipe=`` (a prediction or a run made with one equals the same made with its shorthands)."""

import dataclasses
import warnings

import pytest
import torch

import nbscaler
from nbscaler import ComputeConfig, Hardware, LossScaling, Recipe, build_optimizer, parallelize
from nbscaler.cost import timing
from nbscaler.cost.nccl import NcclModel
from nbscaler.models.gpt import GPT, GPTConfig
from nbscaler.recipe import AS_HELD, UNSET, Float8Scaling
from nbscaler.planning.planner import cast_floats
from tests.models import batch, build

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
TINY = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, d_model=32, n_head=2)


def tokens(batch: int = 2, seq: int = 16):
    idx = torch.zeros(batch, seq, dtype=torch.long)
    return {"batch": {"idx": idx, "targets": idx.clone()}}


@pytest.fixture(scope="module")
def bf16_plan():
    """A bf16 GPT over two data-parallel units: its gradients are summed across them."""
    return nbscaler.plan(GPT(TINY), tokens(), "data", ComputeConfig(1, 2, use_end2end=True), module_dtype=BF16)


# -- the object -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, field", [
    ({"master_dtype": torch.int32}, "master_dtype"),
    ({"grad_reduce_dtype": "bf16"}, "grad_reduce_dtype"),
    ({"module_dtype": torch.int64}, "module_dtype"),
    ({"clip_grad_norm": -1.0}, "clip_grad_norm"),
    ({"clip_grad_norm": 0}, "clip_grad_norm"),
    ({"loss_scaling": True, "module_dtype": BF16}, "loss_scaling"),
    ({"loss_scaling": "dynamic"}, "loss_scaling"),
    ({"optimizer": "adamw"}, "optimizer"),
    ({"optimizer_kwargs": {"lr": {"not": "hashable"}}}, "optimizer_kwargs"),
])
def test_a_recipe_refuses_a_bad_field_by_name(kwargs, field):
    with pytest.raises(ValueError, match=rf"Recipe\({field}="):
        Recipe(**kwargs)


def test_loss_scaling_checks_its_settings_and_takes_true_or_a_dict():
    with pytest.raises(ValueError, match="growth_interval"):
        LossScaling(growth_interval=0)
    assert Recipe(module_dtype=FP16, loss_scaling=True).loss_scaling == LossScaling()
    assert Recipe(loss_scaling={"init_scale": 8.0}).loss_scaling.init_scale == 8.0
    assert Recipe(loss_scaling=False).loss_scaling is None


def test_the_one_default_is_adamw_with_fp32_masters_only_where_the_module_is_narrower():
    r = Recipe()
    assert (r.optimizer, r.kwargs, r.master_dtype, r.grad_reduce_dtype) == (torch.optim.AdamW, {}, FP32, None)
    assert (r.master_of(BF16), r.master_of(FP32), r.master_of(torch.float64)) == (FP32, None, None)
    assert (r.reduce_dtype(BF16), r.reduce_dtype(FP32), r.reduce_dtype(torch.float64)) == (FP32, FP32, torch.float64)
    assert Recipe(grad_reduce_dtype=BF16).reduce_dtype(BF16) == BF16
    assert (AS_HELD.master_of(BF16), AS_HELD.reduce_dtype(BF16)) == (None, BF16)


def test_a_recipe_is_hashable_and_keeps_its_keywords_sorted():
    a = Recipe(optimizer_kwargs={"lr": 1e-3, "betas": [0.9, 0.95]})
    b = Recipe(optimizer_kwargs={"betas": (0.9, 0.95), "lr": 1e-3})
    assert a == b and hash(a) == hash(b) and len({a, b, Recipe()}) == 2
    assert a.optimizer_kwargs == (("betas", (0.9, 0.95)), ("lr", 1e-3)) and a.kwargs == {"betas": (0.9, 0.95), "lr": 1e-3}
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.master_dtype = None


def test_shorthands_build_a_recipe_and_may_not_contradict_one():
    assert Recipe.of() == Recipe()
    assert Recipe.of(master_dtype=None, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}) == \
        Recipe(torch.optim.SGD, {"lr": 0.1}, master_dtype=None)
    assert Recipe.of(optimizer=UNSET, master_dtype=UNSET, optimizer_kwargs={}) == Recipe()
    mine = Recipe(master_dtype=None)
    assert Recipe.of(mine, master_dtype=None) is mine                       # agreeing is fine
    with pytest.raises(ValueError, match=r"recipe\.master_dtype=None and master_dtype=torch\.float32"):
        Recipe.of(mine, master_dtype=FP32)
    with pytest.raises(ValueError, match=r"recipe\.optimizer_kwargs=.* and optimizer_kwargs="):
        Recipe.of(mine, optimizer_kwargs={"lr": 0.5})
    assert Recipe.of(mine, module_dtype=BF16).module_dtype == BF16          # None leaves the dtype open


def test_describe_says_the_whole_recipe_in_one_line():
    r = Recipe(torch.optim.SGD, {"lr": 0.1}, module_dtype=FP16, loss_scaling=True, clip_grad_norm=1.0)
    assert r.describe() == ("SGD(lr=0.1), module fp16, masters fp32, gradients reduced in fp32, "
                            "loss scaling from 65536, clipping at 1")
    assert Recipe(master_dtype=None).describe(FP32).startswith("AdamW(), module fp32, no masters, gradients reduced in fp32")


def test_the_number_format_has_its_own_name_and_precision_warns():
    assert nbscaler.NumberFormat.of(BF16) is nbscaler.NumberFormat.BF16
    with pytest.warns(DeprecationWarning, match="NumberFormat"):
        assert nbscaler.Precision is nbscaler.NumberFormat
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "Recipe" in nbscaler.__all__ and "NumberFormat" in nbscaler.__all__ and "Precision" not in nbscaler.__all__


# -- predictions -----------------------------------------------------------------------------------
@pytest.mark.slow
def test_plan_predictions_take_a_recipe_or_its_shorthands(bf16_plan):
    sgd = Recipe(torch.optim.SGD, {"momentum": 0.9}, master_dtype=None)
    assert bf16_plan.memory(recipe=sgd).equals(bf16_plan.memory(torch.optim.SGD, master_dtype=None, momentum=0.9))
    assert bf16_plan.memory().equals(bf16_plan.memory(recipe=Recipe()))
    assert bf16_plan.memory().optimizer_bytes.iloc[0] > bf16_plan.memory(recipe=sgd).optimizer_bytes.iloc[0]
    with pytest.raises(ValueError, match=r"recipe\.optimizer=.* and optimizer="):
        bf16_plan.summary(torch.optim.Adam, recipe=sgd)
    with pytest.raises(ValueError, match="module_dtype"):
        bf16_plan.memory(recipe=Recipe(module_dtype=FP32))
    bf16_plan.timeline(recipe=Recipe(module_dtype=BF16))
    with pytest.raises(ValueError, match="module_dtype"):
        bf16_plan.timeline(recipe=Recipe(module_dtype=FP16))


def test_gradients_summed_in_bf16_are_predicted_at_half_the_bytes_and_time_of_fp32(bf16_plan):
    p = bf16_plan
    h100 = dataclasses.replace(Hardware.named("H100-SXM-80GB"), gpus_per_node=2)
    no_latency = dataclasses.replace(h100, intra_node_latency_s=0.0, inter_node_latency_s=0.0)
    params = timing.device_params(p.placed, 0)
    fp32, bf16 = Recipe(), Recipe(grad_reduce_dtype=BF16)
    assert timing._reduced_bytes(params, fp32) == 2 * timing._reduced_bytes(params, bf16)
    args = (p.placed, 0, NcclModel(no_latency))
    assert timing.sync_time(*args, fp32) == pytest.approx(2 * timing.sync_time(*args, bf16))
    slow, fast = (p.summary(hardware=h100, recipe=r).step_time_s for r in (fp32, bf16))
    assert (fast < slow).all()
    assert p.summary(hardware=h100, grad_reduce_dtype=BF16).equals(p.summary(hardware=h100, recipe=bf16))


def test_the_sweep_and_the_space_price_the_recipe_they_are_given():
    ranges = dict(tp=(1,), pp=(1,), micro_batch=(1,), zero_stage=(0,), recompute=(False,), sequence_parallel=(False,))
    h100 = dataclasses.replace(Hardware.named("H100-SXM-80GB"), gpus_per_node=2)
    space = nbscaler.PlanSpace(GPT(TINY), tokens(1), h100, global_batch=4, settle=False, **ranges)
    assert space.recipe == Recipe(module_dtype=BF16) and space.master_dtype == FP32
    fp32_sync = float(space.frame.dp_comm_share.iloc[0] * space.frame.step_time_s.iloc[0])
    space.set(grad_reduce_dtype=BF16)
    assert space.recipe == Recipe(module_dtype=BF16, grad_reduce_dtype=BF16)
    bf16_sync = float(space.frame.dp_comm_share.iloc[0] * space.frame.step_time_s.iloc[0])
    assert bf16_sync < fp32_sync
    swept = nbscaler.sweep(GPT(TINY), tokens(1), h100, global_batch=4, progress=False,
                           recipe=Recipe(grad_reduce_dtype=BF16), **ranges)
    assert swept.step_time_s.tolist() == space.frame.step_time_s.tolist()
    with pytest.raises(ValueError, match="disagree"):
        nbscaler.sweep(GPT(TINY), tokens(1), h100, global_batch=4, progress=False, recipe=Recipe(),
                       master_dtype=None, **ranges)
    before = space.recipe
    with pytest.raises(ValueError, match="master_dtype"):
        space.set(master_dtype=torch.int8)
    assert space.recipe == before


def test_autodist_on_a_target_reads_its_recipe_from_pas_config():
    from nbscaler.space.autodist import TargetSearch
    cfg = lambda **pas: ComputeConfig(2, 2, pas_config={"hardware": "H100-SXM-80GB", "global_batch": 4, **pas})
    assert TargetSearch.from_config(cfg()).priced == Recipe()
    sgd = Recipe(torch.optim.SGD, master_dtype=None)
    assert TargetSearch.from_config(cfg(recipe=sgd)).priced == sgd
    assert TargetSearch.from_config(cfg(memory_optimizer="adam", master_dtype=None)).priced == \
        Recipe(torch.optim.Adam, master_dtype=None)
    with pytest.raises(ValueError, match=r"pas_config\['recipe'\]"):
        TargetSearch.from_config(cfg(recipe=sgd, memory_optimizer="adamw"))
    with pytest.raises(ValueError, match="hardware"):
        ComputeConfig(2, 2, pas_config={"recipe": sgd}) and nbscaler.policy.autodist.options.AutodistOptions.from_config(
            ComputeConfig(2, 2, pas_config={"recipe": sgd}))


# -- runs ------------------------------------------------------------------------------------------
def test_parallelize_states_the_recipe_in_each_rank_file_and_takes_its_module_dtype(tmp_path):
    recipe = Recipe(optimizer_kwargs={"lr": 3e-4}, module_dtype=BF16, clip_grad_norm=1.0)
    x = batch("mlp", 0)
    parallelize(build("mlp"), x, "tp", ComputeConfig(2, 2), gen_savedir=tmp_path, load_module=False, recipe=recipe)
    files = sorted(tmp_path.rglob("gencode*.py"))
    assert len(files) == 2
    line = ("    # recipe: AdamW(lr=0.0003), module bf16, masters fp32, gradients reduced in fp32, no loss scaling, "
            "clipping at 1")
    assert all(line in f.read_text().splitlines() for f in files)
    assert "bfloat16" in files[0].read_text()                     # the module was compiled in the recipe's dtype
    plain = nbscaler.plan(build("mlp"), x, "tp", ComputeConfig(2, 2))
    assert "# recipe:" not in plain.sources[0]
    with pytest.raises(ValueError, match=r"recipe\.module_dtype=torch\.bfloat16 and module_dtype=torch\.float16 disagree"):
        parallelize(build("mlp"), x, "tp", ComputeConfig(2, 2), gen_savedir=tmp_path, load_module=False,
                    module_dtype=FP16, recipe=recipe, reuse="override")


def test_build_optimizer_runs_the_recipe_and_reduces_in_its_dtype(tmp_path):
    args = cast_floats(batch("mlp", 0), BF16)
    pm = parallelize(build("mlp"), args, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path, module_dtype=BF16)
    opt = build_optimizer(pm, recipe=Recipe(torch.optim.SGD, {"lr": 0.1}, grad_reduce_dtype=BF16, clip_grad_norm=1e-3))
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["lr"] == 0.1
    assert all(p.dtype == FP32 for g in opt.param_groups for p in g["params"])     # the default's fp32 masters
    seen = []
    opt.register_reducer_pre_hook(lambda reducer, flat: seen.append(flat.dtype))
    pm(**args).float().backward()
    norm = opt.clip_gnorm()                                        # the recipe's norm
    assert seen and set(seen) == {BF16}
    clipped = sum(float(p.grad.float().pow(2).sum()) for g in opt.param_groups for p in g["params"]) ** 0.5
    assert float(norm) > 1e-3 and clipped == pytest.approx(1e-3, rel=1e-2)
    with pytest.raises(ValueError, match=r"recipe\.master_dtype=torch\.float32 and master_dtype=None"):
        build_optimizer(pm, recipe=Recipe(), master_dtype=None)
    default = build_optimizer(pm)
    assert isinstance(default, torch.optim.AdamW)
    assert build_optimizer(pm, torch.optim.SGD, master_dtype=None, lr=0.1).param_groups[0]["params"][0].dtype == BF16


def test_float8_is_a_checked_vocabulary():
    recipe = Recipe(float8="rowwise", module_dtype=torch.bfloat16)
    assert recipe.float8 is Float8Scaling.ROWWISE and recipe == Recipe(float8=Float8Scaling.ROWWISE, module_dtype=torch.bfloat16)
    assert "fp8 products (rowwise)" in recipe.describe()
    assert "fp8" not in Recipe().describe()
    with pytest.raises(ValueError, match=r"float8='blockwise'.*tensorwise, rowwise"):
        Recipe(float8="blockwise")


def test_float8_skip_names_modules_and_needs_float8():
    recipe = Recipe(float8="tensorwise", float8_skip="lm_head")
    assert recipe.float8_skip == ("lm_head",) and "fp8 products (tensorwise, but lm_head)" in recipe.describe()
    with pytest.raises(ValueError, match=r"float8_skip.*float8 is None"):
        Recipe(float8_skip=("lm_head",))
    with pytest.raises(ValueError, match=r"float8_skip=.*module names"):
        Recipe(float8="tensorwise", float8_skip=("",))
