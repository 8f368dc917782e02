"""The shipped GPT's residual dropout: absent at p = 0, traced once per block branch above it, and
trained by a one-process module exactly as the model trains itself."""

import copy

import pytest
import torch

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.models.gpt import GPT, GPTConfig, sample_batch
from tests.conftest import gpt_plan

CFG = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=64)
DROPOUT = "torch.nn.functional.dropout"


def plan(cfg: GPTConfig) -> "nbscaler.Plan":
    return gpt_plan("data", ComputeConfig(1, 1, use_end2end=True), model=cfg)


def test_without_dropout_the_model_holds_none_and_traces_once_to_the_same_ops():
    plain, dropped = plan(CFG), plan(GPTConfig(**{**vars(CFG), "dropout": 0.1}))
    assert not any(isinstance(m, torch.nn.Dropout) for m in GPT(CFG).modules())
    assert list(plain.graphs) == ["any"] and not plain.graph.meta["reads_training"]   # no eval trace apart
    assert sorted(dropped.graphs) == ["eval", "train"]
    train = dropped.graphs["train"]
    assert [n.module_path for n in train.nodes if n.target == DROPOUT] == [
        f"blocks.{i}.{m}.drop" for i in range(CFG.n_layer) for m in ("attn", "mlp")]
    assert all(n.kwargs == {"p": 0.1, "training": True, "inplace": False} for n in train.nodes if n.target == DROPOUT)
    assert [n.target for n in train.nodes if n.target != DROPOUT] == [n.target for n in plain.graph.nodes]


@pytest.mark.parametrize("p", [1.0, -0.1])
def test_a_dropout_that_is_not_a_probability_is_refused(p):
    with pytest.raises(ValueError, match=r"dropout=.* must be a probability in \[0, 1\)"):
        GPTConfig(dropout=p)


def test_a_module_with_dropout_trains_on_one_process_as_the_model_does(tmp_path):
    cfg = GPTConfig(**{**vars(CFG), "dropout": 0.1})
    torch.manual_seed(0)
    model = GPT(cfg)
    ref = copy.deepcopy(model)
    pm = nbscaler.parallelize(model, {"batch": sample_batch(cfg, 2)}, "dp", ComputeConfig(1, 1, use_end2end=True),
                              gen_savedir=tmp_path)
    batches = [sample_batch(cfg, 2, seed=s) for s in range(2)]
    torch.manual_seed(1)                    # the same draws in the same order: the same masks
    losses = pm.train_step(batches)
    torch.manual_seed(1)
    expected = [ref(b) for b in batches]
    sum(expected).backward()
    assert [float(x.detach()) for x in losses] == pytest.approx([float(x.detach()) for x in expected], rel=1e-6)
    grads = dict(pm.named_parameters())
    for name, p in ref.named_parameters():
        local = grads[name.replace(".", "_")].grad
        assert torch.allclose(local, p.grad, rtol=1e-5, atol=1e-7), name
    pm.eval()
    ref.eval()
    with torch.no_grad():                   # no dropout in eval mode
        assert [float(x) for x in pm.infer_step(batches)] == pytest.approx([float(ref(b)) for b in batches], rel=1e-6)
