"""Values made from shapes and constants are static; values read from the input data become guards
that generated code checks on every call."""

import pytest
import torch
import torch.nn as nn

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.runtime.guards import GuardError, expect_traced
from nbscaler.trace import TraceError, trace_module
from nbscaler.trace.values import Provenance


class MaskedHead(nn.Module):
    """Branches on a shape-made value (free) and on the input mask (a guard)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, mask):
        ids = torch.arange(x.shape[1]).unsqueeze(0)
        if (ids[:, -1] == 0).all():                   # static: depends on the shape only
            x = x * 0
        h = self.fc(x)
        if not mask.all():                            # data: this trace assumes an all-ones mask
            h = h * mask[..., None]
        return h.sum()


def _args(mask_value=1):
    return {"x": torch.randn(2, 4, 8), "mask": torch.full((2, 4), mask_value)}


def test_shape_values_are_static_and_data_values_become_one_guard():
    graph = trace_module(MaskedHead(), _args())
    guards = [n for n in graph.nodes if n.op == "guard"]
    assert len(guards) == 1
    (guard,) = guards
    assert guard.target == "Tensor.__bool__" and guard.outputs is True
    assert guard.inputs[0].producer.target == "Tensor.all"
    assert guard.source[1] == MaskedHead.forward.__code__.co_firstlineno + 5
    assert Provenance.STATIC.rank < Provenance.DATA.rank < Provenance.WEIGHTS.rank


def test_generated_code_checks_the_guard_readably():
    plan = nbscaler.plan(MaskedHead(), _args(), "tp", ComputeConfig(2, 2))
    for src in plan.sources.values():
        assert "from nbscaler.runtime.guards import expect_traced" in src
        line = next(l.strip() for l in src.splitlines() if l.strip().startswith("expect_traced("))
        assert line.startswith("expect_traced(bool(reduce_1), True, 'bool(reduce_1)', 'test_guards.py:")
        assert "`if not mask.all():`" in line


def test_a_guard_that_fails_names_the_line_and_the_assumption():
    expect_traced(True, True, "bool(all_0)", "model.py:3")
    with pytest.raises(GuardError, match=r"model.py:3: .*traced with bool\(all_0\) == True.*this input gives False"):
        expect_traced(False, True, "bool(all_0)", "model.py:3")


def test_refusal_stays_available():
    with pytest.raises(TraceError, match=r"__bool__\(\) on 'reduce_1' at test_guards.py:\d+ turns"):
        trace_module(MaskedHead(), _args(), guards=False)
    with pytest.raises(TraceError, match="guard_data_dependent"):
        nbscaler.plan(MaskedHead(), _args(), "dp", ComputeConfig(1, 1, guard_data_dependent=False))


def test_refusal_inside_a_submodule_names_it():
    class Inner(nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()

        def forward(self, x):
            return self.inner(x)

    with pytest.raises(TraceError, match=r"at test_guards.py:\d+ \(in inner\)"):
        trace_module(Outer(), {"x": torch.ones(3)}, guards=False)


def test_item_and_tolist_guard_their_values():
    class Lengths(nn.Module):
        def forward(self, x, n):
            return x[: int(n.max())].sum() + len(n.tolist())

    graph = trace_module(Lengths(), {"x": torch.randn(5), "n": torch.tensor([2, 3])})
    assert [(n.target, n.outputs) for n in graph.nodes if n.op == "guard"] == [("Tensor.__int__", 3),
                                                                              ("Tensor.tolist", [2, 3])]
