"""Activation recomputation trains exactly like one process: under dp, tp and pipelines, on 2 and 4 ranks.

A recomputed block runs its forward again in the backward, collectives included (tp's all-reduce
after the row-parallel linears), and a dropout inside it must draw the same mask the second time.
"""

import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from nbscaler import ComputeConfig, parallelize
from tests.multiprocess import (Case, assert_close, check_equivalence, granular, pipeline, recompute, run_ranks,
                                 train_parallel)

ONE = [                     # recompute='selective' (the attention cores) and 'full' (each layer of the stack)
    Case("gpt", "dp", 1, 1, config=granular("selective")),
    Case("hf_qwen2", "dp", 1, 1, config=granular("full")),
]

TWO = [
    Case("gpt", "dp", 1, 2, config=recompute("gpt.blocks")),
    Case("gpt", "tp", 2, 2, optimizer="adamw", config=recompute("Block")),
    Case("gpt", "pp", 2, 2, config=pipeline("1f1b", 2, 4) + recompute("gpt.blocks")),
    Case("llama", "tp", 2, 2, config=recompute("blocks.0", "blocks.1.mlp", "RMSNorm")),
    Case("gpt", "pp", 2, 2, config=pipeline("gpipe", 2, 2) + recompute("gpt")),     # a whole stage each
    Case("gpt", "dp", 1, 2, config=granular("full")),
    Case("gpt", "tp", 2, 2, config=granular("selective", sequence_parallel=True)),
    Case("gpt", "data", 2, 2, config=granular("selective")),
    Case("llama", "tp", 2, 2, config=granular("selective")),        # q @ k.T, mask, softmax, @ v: found in the graph
    Case("hf_qwen2", "tp", 2, 2, config=granular("selective")),
    Case("hf_qwen2", "data", 2, 2, config=granular("full")),
]

FOUR = [
    Case("gpt", "hybrid", 4, 4, config=pipeline("1f1b", 2, 4) + recompute("gpt.blocks")),
    Case("gpt", "tp", 2, 4, optimizer="adamw", config=recompute("gpt.blocks.*.mlp", "gpt.blocks.0")),
    Case("gpt", "hybrid", 4, 4, config=pipeline("1f1b", 2, 4) + granular("selective")),
    Case("gpt", "hybrid", 4, 4, config=pipeline("gpipe", 2, 2) + granular("full")),
    Case("gpt", "tp", 4, 4, config=granular("full")),
    Case("gpt", "data", 2, 4, config=granular("full")),
    Case("hf_qwen2", "hybrid", 4, 4, config=pipeline("1f1b", 2, 4) + granular("selective")),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("nranks, cases", [(1, ONE), (2, TWO), (4, FOUR)], ids=["1rank", "2ranks", "4ranks"])
def test_recompute_trains_like_one_process(nranks, cases, tmp_path):
    per_rank = run_ranks(train_parallel, nranks, cases, str(tmp_path))
    for i, case in enumerate(cases):
        check_equivalence(case, [res[i] for res in per_rank])


class DropoutLayer(nn.Module):
    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)

    def forward(self, x):
        return F.dropout(torch.relu(self.fc(x)), p=0.5, training=self.training)


class DropoutMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([DropoutLayer(16, 64), DropoutLayer(64, 64)])
        self.out = nn.Linear(64, 4)

    def forward(self, x, y):
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.out(x), y)


def _dropout_step(gen_dir: str):
    """One backward of the recomputed module and of the plain one, from the same weights and the
    same random state; returns both sets of gradients and the generated code."""
    torch.manual_seed(0)
    plain = DropoutMLP()
    torch.manual_seed(0)
    model = DropoutMLP()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    cfg = ComputeConfig(1, 1, pas_config={"recompute_modules": ["layers"]})
    pm = parallelize(model, {"x": x, "y": y}, "dp", cfg, gen_savedir=gen_dir)
    torch.manual_seed(1)
    pm(x, y).backward()
    torch.manual_seed(1)
    plain(x, y).backward()
    return ({n: p.grad.clone() for n, p in pm.named_parameters()},
            {n.replace(".", "_"): p.grad.clone() for n, p in plain.named_parameters()},
            inspect.getsource(type(pm)))


@pytest.mark.multiprocess
def test_dropout_draws_the_same_mask_when_recomputed(tmp_path):
    grads, expected, code = run_ranks(_dropout_step, 1, str(tmp_path))[0]
    train = code.split("def _forward_train")[1].split("def _forward_eval")[0]
    regions = train.split("def recompute_layers_")[1:]
    assert len(regions) == 2 and all("= F.dropout(" in r.split("use_reentrant")[0] for r in regions), train
    assert "checkpoint(" not in code.split("def _forward_eval")[1]       # nothing to keep without a backward
    assert set(grads) == set(expected)
    for name, g in expected.items():
        assert_close(grads[name], g, f"grad {name}")
