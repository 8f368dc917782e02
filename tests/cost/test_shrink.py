"""Large ops timed at a smaller shape and scaled (``cost.shrink``): the dimension, the factor, and
that nothing over the budget is run at its real shape."""

import functools

import pytest
import torch

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.cost import profile, shrink
from nbscaler.cost.profile import OpProfiler, op_key
from nbscaler.cost.shrink import Basis, is_large
from nbscaler.recipe import Recipe
from nbscaler.models.gpt import GPT, GPTConfig
from tests.models import Llama


@pytest.fixture
def small_budgets(monkeypatch):
    """Budgets that make a small model's ops large: 1 MFLOP, 16 KiB of activations, 8 rows at least."""
    monkeypatch.setattr(shrink, "FLOPS_BUDGET", 1e6)
    monkeypatch.setattr(shrink, "BYTES_BUDGET", 2 ** 14)
    monkeypatch.setattr(shrink, "MIN_EXTENT", 8)


def _ops(model, batch):
    plan = nbscaler.plan(model, batch, "dp", ComputeConfig(1, 1))
    return plan.local_runs[0][None].ops


@functools.lru_cache(maxsize=1)
def _llama_ops():
    """The small Llama's ops, planned once: a tuple of frozen ``OpCall``s the tests only read."""
    torch.manual_seed(0)
    idx = torch.randint(0, 256, (2, 64))                       # 2 sequences of 64 tokens
    return tuple(_ops(Llama(d_model=64, seq_len=64, vocab_size=256, n_head=4, n_kv_head=2), {"idx": idx, "targets": idx}))


def _op(ops, name):
    return next(o for o in ops if o.node.name == name)


def test_a_linear_shrinks_its_tokens_by_its_flops(small_budgets):
    op = _op(_llama_ops(), "linear_1")                          # k projection: (2, 64, 64) @ (64 -> 32)
    proxy = shrink.shrink(op)
    assert proxy.basis == Basis.FLOPS and proxy.dims == ("*1",)  # the tokens; not k (reduced), not n (weight)
    # activations 768 bytes a token (64 in, 32 out, fp32): 16 KiB holds 21 of them
    assert [s for s, _, _ in proxy.run.in_shapes] == [(2, 21, 64), (32, 64)]
    assert proxy.factor == (64 / 21, 64 / 21)


def test_a_loss_shrinks_its_rows_by_its_bytes(small_budgets):
    op = next(o for o in _llama_ops() if o.node.op == "loss")       # (128, 256) logits, 128 targets
    proxy = shrink.shrink(op)
    assert proxy.basis == Basis.BYTES and proxy.dims == ("n",)       # not c: the classes are summed over
    assert [s for s, _, _ in proxy.run.in_shapes] == [(15, 256), (15,)]  # 1,032 bytes a row, 4 for the loss
    real, small = 128 * 1032 + 4, 15 * 1032 + 4
    assert proxy.factor == (real / small, 2 * real / (2 * small))


def test_causal_attention_shrinks_queries_and_keys_together(small_budgets):
    torch.manual_seed(0)
    idx = torch.randint(0, 64, (1, 64))
    model = GPT(GPTConfig(vocab_size=64, seq_len=64, n_layer=1, d_model=32, n_head=1))
    op = next(o for o in _ops(model, {"batch": {"idx": idx, "targets": idx}}) if o.node.op == "attention")
    assert [s for s, _, _ in op.in_shapes][0] == (1, 1, 64, 32)     # one head: nothing else to shrink
    proxy = shrink.shrink(op)
    assert proxy.basis == Basis.FLOPS and proxy.dims == ("t", "s")
    (q, _, _), (k, _, _), (v, _, _) = proxy.run.in_shapes
    # q, k, v and the output hold 128 bytes a token each (32 fp32): 16 KiB holds 32 tokens
    assert q[2] == k[2] == v[2] == 32
    assert proxy.factor == ((64 * 64) / (32 * 32),) * 2          # FLOPs go as queries x keys


@pytest.mark.slow
def test_no_large_op_runs_at_its_real_shape(small_budgets, tmp_path, monkeypatch):
    ops = _llama_ops()
    large = {op_key(o) for o in ops if is_large(o)}
    assert len(large) > 10
    ran = []
    real_time_op = profile.time_op
    monkeypatch.setattr(profile, "time_op", lambda op, device: (ran.append(op), real_time_op(op, device))[1])
    profiler = OpProfiler(torch.device("cpu"), tmp_path / "ops.json")
    profiler.profile(ops, passes=1)
    assert ran and not large & {op_key(o) for o in ran}
    assert not any(p.basis == Basis.RATES for p in profiler.proxies.values())    # every proxy ran
    assert not large & set(profiler.table)         # the table holds what was measured, at the shape measured


def test_a_large_op_reads_its_proxys_time_times_the_factor(small_budgets, tmp_path, monkeypatch):
    monkeypatch.setattr(profile.speed, "reference_s", lambda device, threads=None, budget_s=None: 1.0)
    monkeypatch.setattr(profile, "time_op", lambda op, device: (2e-3, 5e-3))
    monkeypatch.setattr(profile, "engine_overhead_s", lambda device: 0.0)
    op = _op(_llama_ops(), "linear_1")
    profiler = OpProfiler(torch.device("cpu"), tmp_path / "ops.json")
    fwd, bwd = profiler.time(op)
    assert (fwd, bwd) == pytest.approx((2e-3 * 64 / 21, 5e-3 * 64 / 21))
    small = profiler.proxy(op).run                      # the proxy's shape, met for real, reads its own time
    assert profiler.proxy(small).basis == Basis.AS_IS
    assert profiler.time(small) == pytest.approx((2e-3, 5e-3))


def test_a_large_view_costs_nothing_and_is_not_run(small_budgets, tmp_path, monkeypatch):
    monkeypatch.setattr(profile.speed, "reference_s", lambda device, threads=None, budget_s=None: 1.0)
    monkeypatch.setattr(profile, "time_op", lambda op, device: pytest.fail(f"ran {op.node.name}"))
    view = next(o for o in _llama_ops() if o.node.op == "reshape" and is_large(o))
    profiler = OpProfiler(torch.device("cpu"), tmp_path / "ops.json")
    assert profiler.time(view) == (0.0, 0.0)


def test_a_large_tensor_stays_over_the_allocation_floor(small_budgets, monkeypatch):
    op = _op(_llama_ops(), "div_0")                             # scores (2, 4, 64, 64): 128 KiB
    assert [s for s, _, _ in shrink.shrink(op).run.in_shapes] == [(2, 4, 8, 64)]    # 16 KiB: the budget
    monkeypatch.setattr(shrink, "MIN_TENSOR_BYTES", 2 ** 15)
    proxy = shrink.shrink(op)
    assert [s for s, _, _ in proxy.run.in_shapes] == [(2, 4, 16, 64)]               # 32 KiB: the floor
    assert proxy.basis == Basis.BYTES and proxy.factor == (4.0, 4.0)


def test_a_large_optimizer_step_is_timed_over_fewer_elements(tmp_path, monkeypatch):
    monkeypatch.setattr(shrink, "UPDATE_BUDGET", 1000)
    monkeypatch.setattr(profile.speed, "reference_s", lambda device, threads=None, budget_s=None: 1.0)
    timed = []
    monkeypatch.setattr(profile, "time_update", lambda numels, *a, **k: (timed.append(numels), 1e-3)[1])
    assert shrink.shrink_update([3000, 1000]) == ([750, 250], 4.0)     # every tensor a quarter: 4x the time
    assert shrink.shrink_update([600, 400]) == ([600, 400], 1.0)       # within the budget: as it is
    profiler = OpProfiler(torch.device("cpu"), tmp_path / "ops.json")
    assert profiler.update([3000, 1000], torch.float32, Recipe(torch.optim.Adam)) == pytest.approx(4e-3)
    assert timed and all(n == [750, 250] for n in timed)               # never the real 4,000 elements


def test_a_proxy_that_fails_is_priced_from_measured_rates(small_budgets, tmp_path, monkeypatch):
    monkeypatch.setattr(profile.speed, "reference_s", lambda device, threads=None, budget_s=None: 1.0)
    monkeypatch.setattr(profile, "measure_rates", lambda device: (1e-9, 1e-10))      # s per byte, per FLOP

    def time_op(op, device):
        raise RuntimeError("a constant argument spells the shrunk size")
    monkeypatch.setattr(profile, "time_op", time_op)
    op = _op(_llama_ops(), "linear_1")
    profiler = OpProfiler(torch.device("cpu"), tmp_path / "ops.json")
    assert profiler.time(op) == pytest.approx(shrink.rate_seconds(op, 1e-9, 1e-10))
    assert profiler.proxy(op).basis == Basis.RATES
    small = next(o for o in _llama_ops() if not is_large(o))
    with pytest.raises(RuntimeError, match="constant argument"):     # a small op's failure is its own: raised
        profiler.time(small)
