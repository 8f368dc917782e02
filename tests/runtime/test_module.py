"""ParallelModule's end2end steps in one process: gradient sums, dummy samples and loss scaling."""

import torch

from nbscaler import ComputeConfig, parallelize
from tests.models import batch, build


def _grads(pm):
    return {n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None}


def test_train_step_sums_skips_dummies_and_scales(tmp_path):
    pm = parallelize(build("gpt"), batch("gpt", 0), "dp", ComputeConfig(1, 1, use_end2end=True), gen_savedir=tmp_path)
    a, b = batch("gpt", 1)["batch"], batch("gpt", 2)["batch"]

    pm.train_step([a])
    only_a = _grads(pm)
    pm.train_step([b])
    only_b = _grads(pm)

    losses = pm.train_step([a, b])
    for name, g in _grads(pm).items():                        # a sum over the samples
        assert torch.allclose(g, only_a[name] + only_b[name], rtol=1e-5, atol=1e-7), name
    assert len(losses) == 2

    losses = pm.train_step([a, b], is_dummy_batch=[False, True])
    for name, g in _grads(pm).items():                        # the dummy sample adds nothing
        assert torch.allclose(g, only_a[name], rtol=1e-5, atol=1e-7), name
    assert len(losses) == 2

    pm.train_step([a], scale_fn=lambda loss: loss * 0.25)
    for name, g in _grads(pm).items():
        assert torch.allclose(g, only_a[name] * 0.25, rtol=1e-5, atol=1e-7), name


def test_infer_step_matches_eval_mode(tmp_path):
    model = build("gpt")
    pm = parallelize(model, batch("gpt", 0), "dp", ComputeConfig(1, 1, use_end2end=True), gen_savedir=tmp_path)
    model.eval()
    pm.eval()
    samples = [batch("gpt", s)["batch"] for s in range(3)]
    with torch.no_grad():
        expected = [model(s) for s in samples]
    assert all(torch.allclose(got, want) for got, want in zip(pm.infer_step(samples), expected))


def test_inputs_are_moved_to_the_rank_s_device(tmp_path):
    """A rank on a GPU takes a CPU batch, as DDP does: every tensor of the inputs goes to the rank's
    device, and nothing else changes. Here the 'device' is meta, which every tensor can be moved to."""
    pm = parallelize(build("gpt"), batch("gpt", 0), "dp", ComputeConfig(1, 1, use_end2end=True), gen_savedir=tmp_path)
    here = {k: v.to(pm.device) for k, v in batch("gpt", 1)["batch"].items()}
    assert pm._on_device(here)["idx"] is here["idx"]              # already there: passed through
    pm.device = torch.device("meta")
    (args, kwargs) = pm._on_device(((here, 3, "x"), {"n": here["targets"], "flag": True}))
    assert args[0]["idx"].is_meta and args[0]["targets"].shape == here["targets"].shape and args[1:] == (3, "x")
    assert kwargs["n"].is_meta and kwargs["flag"] is True and not here["idx"].is_meta
