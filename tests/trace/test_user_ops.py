"""``register_op`` functions take part in torch's ``__torch_function__`` protocol: any function mode
(the tracer is one) sees a call as one call, and the IR needs nothing from the tracer."""

import ast
import inspect

import torch
from torch.overrides import TorchFunctionMode

import nbscaler.ir.registry as registry
from nbscaler.ir.registry import target_of
from nbscaler.trace import trace_module
from tests.models import UserOp, project


class Calls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(target_of(func))
        return func(*args, **(kwargs or {}))


def test_a_function_mode_sees_one_call():
    x, w = torch.randn(3, 4), torch.randn(4, 2)
    with Calls() as calls:
        out = project(x, w)
    assert calls.seen == ["tests.models.project"]          # not the einsum inside
    assert torch.allclose(out, x @ w)


def test_without_a_mode_it_is_the_plain_function():
    x, w = torch.randn(3, 4), torch.randn(4, 2)
    assert torch.allclose(project(x, w), x @ w)


def test_the_tracer_records_one_node_per_call():
    graph = trace_module(UserOp(), {"x": torch.randn(4, 16), "y": torch.zeros(4, dtype=torch.long)})
    ops = [n for n in graph.nodes if n.target == "tests.models.project"]
    assert len(ops) == 2 and all(n.annotation is not None for n in ops)
    assert not any(n.target == "torch.einsum" for n in graph.nodes)


def test_the_registry_does_not_import_the_tracer():
    tree = ast.parse(inspect.getsource(registry))
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not any(m and m.startswith("nbscaler.trace") for m in imported)
