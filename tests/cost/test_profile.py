"""The op profiler: times cached per device, and timed again once the machine is quieter."""

import torch

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.cost import profile
from nbscaler.cost.profile import OpProfiler, op_key
from tests.models import batch, build


def _ops():
    plan = nbscaler.plan(build("mlp"), batch("mlp", 0), "dp", ComputeConfig(1, 1))
    return plan.local_runs[0][None].ops


def test_an_op_timed_on_a_busy_machine_is_timed_again_when_it_is_quieter(tmp_path, monkeypatch):
    op = next(o for o in _ops() if "linear" in o.node.target)
    monkeypatch.setattr(profile, "machine_load", lambda: 0.0)
    busy = OpProfiler(torch.device("cpu"), tmp_path / "ops.json")
    busy.table[op_key(op)] = busy.new[op_key(op)] = [1.0, 2.0, 6.0]     # timed once, slowly, at a load of 6
    busy.save()
    profiler = OpProfiler(torch.device("cpu"), tmp_path / "ops.json")   # opened on a quiet machine
    fwd, bwd = profiler.time(op)
    assert fwd < 1.0 and bwd < 2.0
    assert profiler.table[op_key(op)][2] == 0.0
    assert profiler.time(op) == (fwd, bwd)                    # timed again once: the same from now on
    profiler.table[op_key(op)] = [1e-9, 2e-9, 0.0]            # timed quiet: kept, never timed again
    assert profiler.time(op) == (1e-9, 2e-9)


def test_profiles_are_saved_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setattr(profile, "machine_load", lambda: 0.0)
    ops = _ops()
    first = OpProfiler(torch.device("cpu"), tmp_path / "ops.json")
    times = [first.time(op) for op in ops]
    first.save()
    again = OpProfiler(torch.device("cpu"), tmp_path / "ops.json")
    assert [again.time(op) for op in ops] == times


def test_ops_are_timed_at_the_thread_count_each_rank_will_have(tmp_path, monkeypatch):
    from nbscaler.cost.timing import profiler_for
    monkeypatch.setenv("NBSCALER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(profile.os, "cpu_count", lambda: 8)
    assert profiler_for(ComputeConfig(2, 4)).key.endswith("-2t")       # 8 cores shared by 4 ranks
    assert profiler_for(ComputeConfig(1, 1)).key.endswith("-8t")

    seen = []
    monkeypatch.setattr(profile, "time_op", lambda op, device: seen.append(torch.get_num_threads()) or (1e-3, 2e-3))
    before = torch.get_num_threads()
    profiler = OpProfiler(torch.device("cpu"), tmp_path / "ops.json", threads=before + 1)
    profiler.time(_ops()[0])
    assert seen == [before + 1]                     # timed at the ranks' count...
    assert torch.get_num_threads() == before        # ...and the caller's count given back
