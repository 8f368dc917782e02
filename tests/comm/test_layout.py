import pytest

from nbscaler.comm.layout import Layout, Step, conversion

R, P = Layout.replicated(), Layout.partial()
S0, S2 = Layout.split(0), Layout.split(2)


@pytest.mark.parametrize("have, want, steps", [
    (R, R, []),
    (S2, S2, []),
    (R, S2, [Step("chunk", dim=2)]),
    (S2, R, [Step("all_gather", dim=2)]),
    (P, R, [Step("all_reduce")]),
    (P, S0, [Step("reduce_scatter", dim=0)]),
    (S2, S0, [Step("all_to_all", dim=0, dim2=2)]),
    (R, Layout("R*"), [Step("sum_grad")]),
    (S2, Layout("R*"), [Step("all_gather_sum_grad", dim=2)]),       # its backward: a reduce-scatter
    (P, Layout("V"), [Step("all_reduce"), Step("first_only")]),
    (R, Layout("V"), [Step("first_only")]),
])
def test_conversions(have, want, steps):
    assert conversion(have, want) == steps


QKV, QKV0 = Layout.split(2, blocks=3), Layout.split(0, blocks=3)


@pytest.mark.parametrize("have, want, steps", [
    (QKV, QKV, []),
    (R, QKV, [Step("chunk", dim=2, blocks=3)]),
    (QKV, R, [Step("all_gather", dim=2, blocks=3)]),
    (S2, QKV, [Step("all_gather", dim=2), Step("chunk", dim=2, blocks=3)]),
    (P, QKV0, [Step("all_reduce"), Step("chunk", dim=0, blocks=3)]),
    (QKV, Layout("R*"), [Step("all_gather_sum_grad", dim=2, blocks=3)]),
])
def test_strided_conversions_go_through_the_whole_tensor(have, want, steps):
    """A strided split (each device its share of every block) never meets a contiguous one in an
    all_to_all or reduce_scatter: the whole tensor is rebuilt in between."""
    assert conversion(have, want) == steps


def _data_plan(**config):
    import nbscaler
    from nbscaler import ComputeConfig
    from tests.models import batch, build
    return nbscaler.plan(build("mlp"), batch("mlp", 0), "data", ComputeConfig(2, 2, **config))


def test_parameters_of_batch_split_ops_leave_their_gradient_sum_to_the_reducer():
    plan = _data_plan()
    params = [name for name, t in plan.graph.weights.items() if t.kind == "param"]
    assert params and all(plan.storage[name] == Layout("R*") for name in params)
    assert not any(plan.collectives.tensor.isin(params))            # no all-reduce per use in the backward
    source = plan.sources[0]
    assert source.count("partial_grads=True") == len(params)
    assert "comm.sum_grad(self." not in source


def test_under_zero_stage_2_each_use_sums_its_gradient_in_the_backward():
    plan = _data_plan(use_zero=True, zero_stage=2)
    params = [name for name, t in plan.graph.weights.items() if t.kind == "param"]
    assert all(plan.storage[name] == Layout.replicated() for name in params)
    assert "partial_grads=True" not in plan.sources[0]
    assert set(plan.collectives[plan.collectives.tensor.isin(params)].collective) == {"sum_grad", "all_reduce"}


def test_every_collective_of_the_table_is_a_function_of_the_runtime():
    """The table names functions generated code calls as ``comm.<name>`` (or the runtime function that
    runs one inside its own call: context parallelism's ring), and their backward partners."""
    import importlib
    from nbscaler.layouts import COLLECTIVES
    from nbscaler.runtime import collectives
    for name, spec in COLLECTIVES.items():
        if spec.inside is not None:
            module, function = spec.inside.rsplit(".", 1)
            assert callable(getattr(importlib.import_module(module), function)), spec.inside
            continue
        assert callable(getattr(collectives, name)), name
        assert spec.backward is None or spec.backward in COLLECTIVES
