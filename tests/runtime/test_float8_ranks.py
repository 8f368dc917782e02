"""fp8 training across ranks equals the one-process fp8 recipe (torchao's ``convert_to_float8_training``
of the same model), on 1, 2 and 4 ranks, under dp, tp (with sequence and context parallelism), a data
split, pipelines (tp inside stages too) and ZeRO-3 (whose gathered weights are whole when a layer
runs, so its scales are one process's with no reduction).

Tolerances, and why:

- tensorwise: every rank casts its slice with the scale of the whole tensor (the largest magnitude
  reduced over the group that splits it), so each fp8 operand equals one process's bit for bit;
  products split along their inner dimension are summed across ranks in fp32 in another order,
  which is the fp32 oracle's situation: ``MATCH_RTOL`` (1e-5), as for every fp32 run.
- rowwise, where no product's inner dimension is split (dp units, pipeline stages): the same
  operands and the same sums, so ``MATCH_RTOL`` too.
- rowwise where a product's inner dimension is split (tp: the output's for a row-parallel layer and
  the input gradient's for a column-parallel one; a data split: the weight gradient's): torchao's
  rowwise product rounds its output to bf16 (``_scaled_mm`` has no fp32 output for rowwise
  scales), so each rank's partial sum is rounded before the cross-rank sum where one process
  rounds once: a bf16 rounding, relative ``2**-8``. Such a difference moves a later fp8 cast's
  operand across an e4m3 rounding boundary in about ``2**-8 / 2**-4 = 2**-4`` of its elements,
  each by one e4m3 step, at most ``2**-3`` relative. A gradient can then differ norm-wise by at
  most one e4m3 step, ``GRAD_RTOL = 2**-3``; a loss, a mean over elements of which ``2**-4`` move
  by at most ``2**-3``, by ``LOSS_RTOL = 2**-7``.

``test_scales_are_the_whole_tensors`` shows that the reduction matters: a slice's own scales would
differ from one process's by fp8 rounding (far over ``MATCH_RTOL``).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nbscaler.reference import MATCH_RTOL
from nbscaler.runtime.float8 import float8_linear
from tests.multiprocess import (Case, check_equivalence, context_parallel, pipeline, run_ranks, sequence_parallel,
                                train_parallel, zero)

GRAD_RTOL = 2.0 ** -3
LOSS_RTOL = 2.0 ** -7
SPLITS_INNER = {"tp", "data", "hybrid"}     # policies whose plans split some product's inner dimension


def fp8(model: str, policy: str, plan: int, runtime: int, scaling: str, config: tuple = ()) -> Case:
    return Case(model, policy, plan, runtime, config=config, float8=scaling)


def cases(nranks: int, scaling: str):
    plans = {1: [("mlp", "dp", 1, 1, ())],
             2: [("mlp", "dp", 1, 2, ()), ("mlp", "tp", 2, 2, ()), ("mlp", "data", 2, 2, ()),
                 ("gpt", "pp", 2, 2, pipeline("1f1b", 2, 2)), ("mlp", "dp", 1, 2, zero(stage=3)),
                 ("gpt", "pp", 2, 2, pipeline("zb_h1", 2, 2))],
             4: [("mlp", "tp", 4, 4, ()), ("gpt", "tp", 2, 4, ()), ("mlp", "data", 4, 4, ()),
                 ("gpt", "pp", 2, 4, pipeline("gpipe", 2, 2)), ("mlp", "tp", 2, 4, zero(stage=3)),
                 ("gpt", "hybrid", 4, 4, pipeline("1f1b", 2, 2)), ("gpt", "tp", 4, 4, context_parallel(4, "ring")),
                 ("gpt", "tp", 4, 4, sequence_parallel()), ("gpt", "tp", 4, 4, context_parallel(2, "ring"))]}[nranks]
    return [fp8(m, p, a, b, scaling, c) for m, p, a, b, c in plans]


def tolerances(case: Case):
    """(gradient rtol, loss rtol) for ``case``: see the module docstring."""
    if case.float8 == "rowwise" and case.policy in SPLITS_INNER and case.plan_ngpus > 1:
        return GRAD_RTOL, LOSS_RTOL
    return MATCH_RTOL, MATCH_RTOL


@pytest.mark.multiprocess
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_fp8_runs_equal_the_one_process_fp8_recipe(nranks, scaling, tmp_path):
    chosen = cases(nranks, scaling)
    per_rank = run_ranks(train_parallel, nranks, chosen, str(tmp_path))
    for i, case in enumerate(chosen):
        rtol, loss_rtol = tolerances(case)
        check_equivalence(case, [res[i] for res in per_rank], rtol=rtol, loss_rtol=loss_rtol)
    code = next(tmp_path.rglob("gencode0.py")).read_text()
    assert f"scaling={scaling!r}" in code


def _operands():
    torch.manual_seed(0)
    rows = torch.linspace(0.1, 3.0, 8)[:, None]          # rows of different sizes: their scales differ
    return torch.randn(8, 16) * rows, torch.randn(12, 16), torch.randn(8, 12)


# dimension -> how rank r slices (x, weight, grad_out), and how the two ranks' (y, grad_x, grad_w)
# join: concatenated along a dimension, or summed (None) where the slice was of the inner dimension
SLICES = {"m": ((0, None, 0), (0, 0, None)), "n": ((None, 0, 1), (1, None, 0)), "k": ((1, 1, None), (None, 1, 1))}


def _sliced_products(scaling: str, with_groups: bool):
    rank, group = dist.get_rank(), dist.new_group([0, 1])
    out = {}
    for dim, (cuts, _) in SLICES.items():
        x, w, go = (t if d is None else t.chunk(2, d)[rank] for t, d in zip(_operands(), cuts))
        x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
        groups = {f"{dim}_group": group} if with_groups else {}
        y = float8_linear(x, w, scaling=scaling, **groups)
        y.backward(go)
        out[dim] = (y.detach(), x.grad, w.grad)
    return out


@pytest.mark.multiprocess
def test_scales_are_the_whole_tensors():
    """Two ranks each hold half of a product's rows, inner or output dimension: with the groups
    their products equal one process's (tensorwise to fp32 rounding; rowwise exactly where the inner
    dimension is whole, within a bf16 rounding where not); without, each slice's own scales make
    them differ by fp8 rounding."""
    for scaling in ("tensorwise", "rowwise"):
        x, w, go = (t.clone() for t in _operands())
        x.requires_grad_(), w.requires_grad_()
        y = float8_linear(x, w, scaling=scaling)
        y.backward(go)
        whole = (y.detach(), x.grad, w.grad)
        for with_groups in (True, False):
            ranks = run_ranks(_sliced_products, 2, scaling, with_groups)
            for dim, (_, joins) in SLICES.items():
                errs = []
                for i, d in enumerate(joins):
                    a, b = ranks[0][dim][i], ranks[1][dim][i]
                    joined = a + b if d is None else torch.cat([a, b], d)
                    errs.append(((joined - whole[i]).norm() / whole[i].norm()).item())
                    if with_groups:           # a bf16 rounding of partial sums where rowwise splits the inner dimension
                        limit = 2.0 ** -8 if scaling == "rowwise" and d is None else MATCH_RTOL
                        assert errs[-1] <= limit, (scaling, dim, i, errs[-1])
                if not with_groups:           # a slice's own scales: some product rounds otherwise
                    assert max(errs) > 1e-3, (scaling, dim, errs)
