"""Which ops are matrix products (``cost.products``) and what an einsum computes (``cost.einsum``),
read from what the op computes, not from a list of kinds."""

import warnings

import pytest
import torch
import torch.nn as nn

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.cost.einsum import einsum_axes, einsum_contracts, einsum_flops
from nbscaler.cost.products import contracted_inputs
from tests.models import batch, build


class Products(nn.Module):
    """One of each spelling of a product, and ops that sum without being one."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 32))
        self.heads = nn.Parameter(torch.randn(4, 32, 8))
        self.conv = nn.Conv1d(8, 8, 3, groups=8)

    def forward(self, x):                                              # x: (2, 8, 16)
        h = torch.einsum("btk,kn->btn", x, self.w)                     # (2, 8, 32)
        g = torch.einsum("...k,hkn->...hn", h, self.heads)             # (2, 8, 4, 8)
        s = torch.baddbmm(h.new_zeros(2, 8, 32), h, h.transpose(1, 2) @ h)
        a = torch.addmm(self.w[0], x[0], self.w)                       # GPT-2's Conv1D
        d = self.conv(x.transpose(1, 2)[:, :8])                        # depthwise
        return s.sum() + g.sum() + a.sum() + d.sum() + torch.einsum("i,i->", h[0, 0], h[0, 1])


@pytest.fixture(scope="module")
def nodes():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                                  # einsum and new_zeros run whole
        p = nbscaler.plan(Products(), {"x": torch.randn(2, 8, 16)}, "dp", ComputeConfig(1, 1))
    return p.graph.nodes


def test_every_spelling_of_a_product_is_one_and_sums_are_not(nodes):
    product = {n.name: n.meta["product"] for n in nodes}
    kinds = {(n.op, n.target): n.meta["product"] for n in nodes}
    assert kinds[("baddbmm", "torch.baddbmm")] and kinds[("addmm", "torch.addmm")]
    assert kinds[("matmul", "Tensor.matmul")] and kinds[("conv", "torch.nn.functional.conv1d")]
    einsums = [n for n in nodes if n.target == "torch.einsum"]
    assert [product[n.name] for n in einsums] == [True, True, False]  # the last is a dot product
    assert not any(product[n.name] for n in nodes if n.op in ("sum", "elementwise", "getitem", "transpose"))


def test_a_bias_gets_a_sum_not_a_product_in_the_backward(nodes):
    """``addmm`` and ``baddbmm``: two products back (the operands'), the bias's gradient a sum."""
    for op in ("addmm", "baddbmm"):
        node = next(n for n in nodes if n.op == op)
        assert node.meta["flops_bwd"] == 2 * node.meta["flops_fwd"]


def test_an_einsum_counts_its_contractions(nodes):
    first, heads, dot = (n for n in nodes if n.target == "torch.einsum")
    assert first.meta["flops_fwd"] == 2 * 2 * 8 * 16 * 32 and first.meta["flops_bwd"] == 2 * first.meta["flops_fwd"]
    assert heads.meta["flops_fwd"] == 2 * 2 * 8 * 32 * 4 * 8
    assert dot.meta["flops_fwd"] == 2 * 32


def test_einsum_equations():
    assert einsum_axes("ij,jk", [(3, 4), (4, 5)])[1] == "ik"                 # implicit output
    assert einsum_axes("...k,hkn->...hn", [(2, 8, 32), (4, 32, 8)])[0] == ["abk", "hkn"]          # "..." spelt out
    assert einsum_flops("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)]) == 2 * 2 * 3 * 4 + 2 * 2 * 4 * 5   # left to right
    assert einsum_flops("bhqd->bhdq", [(2, 3, 4, 5)]) == 120                # one operand: one FLOP an element
    assert einsum_contracts("bik,bkj->bij", [(2, 3, 4), (2, 4, 5)])
    assert not einsum_contracts("ij,ij->i", [(3, 4), (3, 4)])              # rows' dot products


def test_a_user_op_whose_annotation_contracts_is_a_product():
    p = nbscaler.plan(build("user_op"), batch("user_op", 0), "dp", ComputeConfig(1, 1))
    project = [n for n in p.graph.nodes if n.target == "tests.models.project"]
    assert project and all(n.meta["product"] for n in project)


@pytest.mark.parametrize("inputs, reduce, outputs, expected", [
    ([{"m", "k"}, {"k", "n"}], {"k"}, {"m", "n"}, (0, 1)),                    # a matrix product
    ([{"n", "c"}, {"n"}], {"n"}, set(), ()),                                  # a loss summed over samples
    ([{"d"}, {"d"}], {"d"}, set(), ()),                                       # a dot product
    ([{"n"}, {"m", "k"}, {"k", "n"}], {"k"}, {"m", "n"}, (1, 2)),              # addmm: not the bias
])
def test_a_contraction_is_two_inputs_sharing_a_summed_axis_each_with_one_of_its_own(inputs, reduce, outputs,
                                                                                     expected):
    assert contracted_inputs(inputs, frozenset(reduce), outputs) == expected
