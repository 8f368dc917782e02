import os

import pytest
import torch
import torch.nn as nn

from nbscaler.trace import TraceError, trace_module
from tests.models import Llama, TrainingBranch


class NestedInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, data, scale: float = 1.0, flags=None):
        x = data["x"] + data["pair"][0] * data["pair"][1]
        return self.proj(x) * scale


def test_nested_inputs_and_non_tensor_args():
    g = trace_module(NestedInputs(), {"data": {"x": torch.randn(2, 4), "pair": [torch.ones(2, 4), torch.ones(2, 4)]},
                                      "scale": 2.0})
    assert [t.name for t in g.inputs] == ["data_x", "data_pair_0", "data_pair_1"]
    assert [n.target for n in g.nodes] == ["Tensor.mul", "Tensor.add", "torch.nn.functional.linear", "Tensor.mul"]
    assert g.nodes[-1].args[1] == 2.0          # the non-tensor argument is baked in


def test_nodes_carry_module_path_and_user_source_line():
    g = trace_module(Llama(n_layer=1), {"idx": torch.zeros(2, 8, dtype=torch.long),
                                        "targets": torch.zeros(2, 8, dtype=torch.long)})
    q = [n for n in g.nodes if n.module_path == "blocks.0.attn.q"]
    assert len(q) == 1 and q[0].target == "torch.nn.functional.linear"
    path, line = q[0].source
    assert os.path.basename(path) == "llama.py"
    with open(path) as f:
        assert "self.q(x)" in f.readlines()[line - 1]
    assert {t.name for t in q[0].inputs} >= {"blocks.0.attn.q.weight"}


def test_training_branches_traced_per_mode():
    m = TrainingBranch()
    args = {"x": torch.randn(4, 16), "y": torch.zeros(4, dtype=torch.long)}
    train, evaluate = trace_module(m, args, "train"), trace_module(m, args, "eval")
    assert len(train.nodes) == len(evaluate.nodes) + 2      # h * 0.5 + 1.0 only in training
    assert m.training                                        # mode restored


def test_batch_norm_state_is_untouched_by_tracing():
    bn = nn.BatchNorm1d(3)
    g = trace_module(bn, {"input": torch.randn(5, 3) + 10}, "train")
    assert torch.equal(bn.running_mean, torch.zeros(3)) and int(bn.num_batches_tracked) == 0
    assert any(n.target == "torch.nn.functional.batch_norm" for n in g.nodes)


def test_positional_only_forward_is_refused():
    class PosOnly(nn.Module):
        def forward(self, x, /):
            return x

    with pytest.raises(TraceError, match="positional-only argument 'x'"):
        trace_module(PosOnly(), {"x": torch.ones(1)})


def test_unknown_and_missing_arguments_are_named():
    with pytest.raises(TraceError, match="'z'.*does not take"):
        trace_module(nn.Linear(2, 2), {"input": torch.ones(1, 2), "z": 1})
    with pytest.raises(TraceError, match="lacks 'input'"):
        trace_module(nn.Linear(2, 2), {})


def test_data_dependent_control_flow_is_refused():
    class Branchy(nn.Module):
        def forward(self, x):
            if x.sum() > 0:
                return x
            return -x

    with pytest.raises(TraceError, match=r"__bool__\(\) on 'gt_0' at test_tracer.py:\d+ turns .*Keep it a tensor"):
        trace_module(Branchy(), {"x": torch.ones(3)}, guards=False)


def test_unknown_op_becomes_opaque_with_a_warning():
    class UsesCummax(nn.Module):
        def forward(self, x):
            return torch.cummax(x, dim=0).values

    with pytest.warns(UserWarning, match="torch.cummax.*replicated"):
        g = trace_module(UsesCummax(), {"x": torch.randn(4)})
    assert g.nodes[0].op == "opaque" and g.nodes[0].annotation is None


def test_failures_inside_forward_say_where():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(3, 3)

        def forward(self, x):
            return self.inner(x)

    with pytest.raises(TraceError, match="in inner"):
        trace_module(Broken(), {"x": torch.ones(2, 4)})
