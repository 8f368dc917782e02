"""Tracing on fake tensors: the same graph as a real trace, no arithmetic on parameters, a real
trace (with a warning) when forward needs a parameter's value, and eval mode only when it matters."""

import pytest
import torch
import torch.nn as nn

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.trace import trace_module, trace_modes
from tests.models import batch, build


def _same_graph(a, b):
    assert a.signature() == b.signature()
    assert [[t.shape for t in n.output_tensors] for n in a.nodes] == [[t.shape for t in n.output_tensors] for n in b.nodes]
    assert [n.source for n in a.nodes] == [n.source for n in b.nodes]


@pytest.mark.parametrize("name", ["mlp", "llama", "cnn", "branch", "gpt", "user_op"])
def test_fake_trace_records_the_real_trace(name):
    for mode in ("train", "eval"):
        _same_graph(trace_module(build(name), batch(name, 0), mode), trace_module(build(name), batch(name, 0), mode, fake=False))


class CountsMatmuls(torch.overrides.TorchFunctionMode):
    """Counts linear calls that reach real (non-fake) tensors."""

    def __init__(self):
        super().__init__()
        self.real = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor
        if func is torch.nn.functional.linear and not isinstance(args[0], FakeTensor):
            self.real += 1
        return func(*args, **(kwargs or {}))


def test_parameters_are_never_computed_on():
    counter = CountsMatmuls()
    with counter:
        graph = trace_module(build("llama"), batch("llama", 0))
    assert counter.real == 0
    assert len(graph.select(op="linear")) > 0


def test_values_from_parameters_fall_back_to_a_real_trace_and_say_why():
    class ScaleByWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            if self.fc.weight.abs().max() > 100:          # a Python decision on a parameter's value
                x = x / 100
            return self.fc(x)

    with pytest.warns(UserWarning, match=r"traced on real tensors.*parameters into Python.*test_fake.py:\d+"):
        graph = trace_module(ScaleByWeight(), {"x": torch.randn(2, 4)}, guards=True)
    assert [n.target for n in graph.nodes][-1] == "torch.nn.functional.linear"
    assert any(n.op == "guard" for n in graph.nodes)    # the parameter's value is checked at run time


def test_captured_constants_keep_their_values():
    class Shifted(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.shift = torch.tensor([1.0, 2.0, 3.0])      # a plain attribute: a captured constant

        def forward(self, x):
            return self.fc(x) + self.shift

    graph = trace_module(Shifted(), {"x": torch.randn(2, 3)})
    assert torch.equal(graph.meta["constants"]["const_0"], torch.tensor([1.0, 2.0, 3.0]))


def test_weights_file_holds_the_real_weights(tmp_path):
    model = build("llama")
    nbscaler.parallelize(model, batch("llama", 0), "tp", ComputeConfig(2, 2), gen_savedir=str(tmp_path),
                         load_module=False)
    weights = torch.load(next(tmp_path.rglob("*.pt")), weights_only=True)
    for name, p in model.named_parameters():
        assert torch.equal(weights[name], p.detach())


def test_eval_mode_is_traced_only_when_forward_reads_training(monkeypatch):
    from nbscaler.trace import modes
    calls = []
    real = modes.trace_module
    monkeypatch.setattr(modes, "trace_module", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    cfg = ComputeConfig(1, 1)
    assert list(trace_modes(build("llama"), batch("llama", 0), cfg)) == ["any"] and calls == ["train"]
    calls.clear()
    assert list(trace_modes(build("branch"), batch("branch", 0), cfg)) == ["train", "eval"]
    assert calls == ["train", "eval"]
    calls.clear()
    dropout_free = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0))     # reads training, same calls either way
    trace_modes(dropout_free, {"input": torch.randn(2, 4)}, cfg)
    assert calls == ["train", "eval"]


def test_training_flag_works_as_before_after_a_trace():
    model = nn.Dropout(0.5)
    trace_module(model, {"input": torch.randn(4)})
    model.eval()
    assert model.training is False and "training" not in type(model).__mro__[-2].__dict__
