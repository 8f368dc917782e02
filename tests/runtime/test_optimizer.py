"""The patched optimizer beyond a plain step: closures, scale_grads and reducer hooks.

One spawn of 4 ranks runs every variant; each is compared with the same training in one process
through the final parameters (merged from the ranks' state dicts).
"""

import pytest
import torch
import torch.distributed as dist

from nbscaler import build_optimizer, merge_state_dicts
from tests.models import batch, build
from tests.multiprocess import Case, assert_close, data_seed, parallel_model, run_ranks, zero

DP, DP_ZERO, TRUNK = Case("mlp", "dp", 1, 4), Case("mlp", "dp", 1, 4, config=zero()), Case("with_trunk", "tp", 2, 4)
STEPS = 3


def lbfgs(params):
    return torch.optim.LBFGS(params, lr=0.5, max_iter=4, history_size=4)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def closure_step(model, opt, case, step, units):
    """``opt.step(closure)``; on a rank ``units`` is its own unit, in one process all of them."""
    def closure():
        opt.zero_grad()
        loss = sum(model(**batch(case.model, data_seed(step, u))) for u in units)
        loss.backward()
        return loss
    opt.step(closure)


def scaled_step(model, opt, case, step, units):
    """Sum of the units' losses, gradients scaled to their mean with ``scale_grads``."""
    sum(model(**batch(case.model, data_seed(step, u))) for u in units).backward()
    if hasattr(opt, "scale_grads"):
        opt.sync_shard_grad()
        opt.scale_grads(1 / case.units)
    else:
        for p in model.parameters():
            p.grad /= case.units
    opt.step()
    opt.zero_grad()


def plain_step(model, opt, case, step, units):
    sum(model(**batch(case.model, data_seed(step, u))) for u in units).backward()
    opt.step()
    opt.zero_grad()


VARIANTS = {   # name: (case, optimizer, step, with reducer hooks)
    "sgd closure": (DP, sgd, closure_step, False),
    "sgd closure, zero": (DP_ZERO, sgd, closure_step, False),
    "lbfgs closure": (DP, lbfgs, closure_step, False),
    "scale_grads": (DP, sgd, scaled_step, False),
    "scale_grads, zero": (DP_ZERO, sgd, scaled_step, False),
    "reducer hooks, plain and parallel parts": (TRUNK, sgd, plain_step, True),
}


def run_variants(gen_dir):
    rank = dist.get_rank()
    out = {}
    for name, (case, make, step_fn, hooks) in VARIANTS.items():
        model = parallel_model(case, gen_dir)
        opt = build_optimizer(model, make)
        seen = []
        if hooks:   # scale down before the sum and back up after it: the result must not change
            opt.register_reducer_pre_hook(lambda reducer, flat: (seen.append(id(reducer)), flat.div_(4)))
            opt.register_reducer_post_hook(lambda reducer, flat: flat.mul_(4))
        for step in range(STEPS):
            step_fn(model, opt, case, step, [rank // case.plan_ngpus])
        reducers = {"plain": id(opt._non_parallel_module_reducer), "parallel": id(opt._parallel_modules[0].reducer)}
        out[name] = {"state": model.state_dict(), "hooked": {k: seen.count(v) for k, v in reducers.items()}}
    return out


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    return run_ranks(run_variants, 4, str(tmp_path_factory.mktemp("gen")))


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_trains_like_single_process(per_rank, name):
    case, make, step_fn, hooks = VARIANTS[name]
    model = build(case.model)
    opt = make(model.parameters())
    for step in range(STEPS):
        step_fn(model, opt, case, step, range(case.units))
    merged, _ = merge_state_dicts([res[name]["state"] for res in per_rank])
    for param_name, expected in model.named_parameters():
        assert_close(merged[param_name], expected.detach(), f"{name}: {param_name}")
    if hooks:
        for res in per_rank:
            assert res[name]["hooked"]["plain"] == STEPS and res[name]["hooked"]["parallel"] == STEPS
