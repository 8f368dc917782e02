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
    (S2, Layout("R*"), [Step("all_gather", dim=2), Step("sum_grad")]),
    (P, Layout("V"), [Step("all_reduce"), Step("first_only")]),
    (R, Layout("V"), [Step("first_only")]),
])
def test_conversions(have, want, steps):
    assert conversion(have, want) == steps
