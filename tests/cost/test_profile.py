"""The op profiler: times cached per device, read at the speed the ranks last measured."""

import pytest
import torch

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.cost import profile, speed
from nbscaler.cost.cache import read_table
from nbscaler.cost.profile import OpProfiler, op_key
from nbscaler.runtime.launch import spawn
from tests.models import batch, build


def _ops():
    plan = nbscaler.plan(build("mlp"), batch("mlp", 0), "dp", ComputeConfig(1, 1))
    return plan.local_runs[0][None].ops


def test_op_times_are_read_at_the_speed_the_ranks_measured(tmp_path, monkeypatch):
    monkeypatch.setenv("NBSCALER_CACHE_DIR", str(tmp_path))
    op = next(o for o in _ops() if "linear" in o.node.target)
    monkeypatch.setattr(speed, "reference_s", lambda device, threads=None: 0.5)      # a slow minute...
    monkeypatch.setattr(profile, "time_op", lambda op, device: (2e-3, 4e-3))          # ...and the op in it
    profiler = OpProfiler(torch.device("cpu"), tmp_path / "ops.json", ranks=2)
    fwd, bwd = profiler.time(op)
    assert fwd == pytest.approx(2e-3)                         # no ranks calibrated: read as profiled
    assert profiler.table[op_key(op)][0] == pytest.approx(4e-3)       # stored as multiples of the reference
    assert not profiler.calibrated

    speed.store(0.25, profiler.key, 2)                        # two ranks side by side ran twice as fast
    profiler.refresh_speed()
    assert profiler.calibrated
    assert profiler.time(op)[0] == pytest.approx(1e-3)
    assert profiler.time(op)[1] == pytest.approx(bwd / 2)
    speed.store(1.0, profiler.key, 4)                         # another number of ranks: not this one's
    profiler.refresh_speed()
    assert profiler.time(op)[0] == pytest.approx(1e-3)


def test_the_speed_read_is_the_median_of_the_recent_calibrations(tmp_path, monkeypatch):
    monkeypatch.setenv("NBSCALER_CACHE_DIR", str(tmp_path))
    for seconds in (4e-3, 4.1e-3, 5.9e-3):                    # the last one caught a slow second
        speed.store(seconds, "cpu-test-1t", 2)
    assert speed.load("cpu-test-1t", 2) == 4.1e-3
    for seconds in (3e-3, 3e-3, 3e-3):                        # the machine got faster, and stayed so
        speed.store(seconds, "cpu-test-1t", 2)
    assert speed.load("cpu-test-1t", 2) == 3e-3
    assert len(read_table(tmp_path / "speed-cpu-test-1t-2ranks.json")["recent"]) == speed.RECENT_CALIBRATIONS


def test_a_slow_moment_falls_on_one_round_of_every_op_not_on_one_op(tmp_path, monkeypatch):
    ops = [o for o in _ops() if o.node.op == "call_function"][:3]
    slowness = iter([1.0, 3.0, 1.0])                 # the machine runs 3x slower in the second round
    factor = {}

    def reference(device, threads=None, budget_s=None):
        factor["now"] = next(slowness)
        return 1e-3 * factor["now"]

    monkeypatch.setattr(speed, "reference_s", reference)
    monkeypatch.setattr(profile, "time_op", lambda op, device: (2e-3 * factor["now"], 4e-3 * factor["now"]))
    profiler = OpProfiler(torch.device("cpu"), tmp_path / "ops.json")
    profiler.table["__engine__"] = [0.0]
    profiler.profile(ops, passes=3)
    for op in ops:
        assert profiler.table[op_key(op)] == [pytest.approx(2.0), pytest.approx(4.0)]     # reference units


@pytest.mark.multiprocess
def test_speed_calibration_runs_on_every_rank_and_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("NBSCALER_CACHE_DIR", str(tmp_path))
    means = spawn(speed.calibrate, 2, threads=1, timeout=120)
    assert means[0] == means[1] > 0
    assert speed.load(speed.device_key(torch.device("cpu"), 1), 2) == means[0]


def test_profiles_are_saved_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setattr(speed, "reference_s", lambda device, threads=None: 1e-3)     # a machine of one speed
    ops = _ops()
    first = OpProfiler(torch.device("cpu"), tmp_path / "ops.json")
    times = [first.time(op) for op in ops]
    first.save()
    again = OpProfiler(torch.device("cpu"), tmp_path / "ops.json")
    assert [again.time(op) for op in ops] == times


def test_ops_are_timed_at_the_thread_count_each_rank_will_have(tmp_path, monkeypatch):
    from nbscaler.cost import timing
    from nbscaler.cost.timing import profiler_for
    monkeypatch.setenv("NBSCALER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(timing.os, "cpu_count", lambda: 8)
    assert profiler_for(ComputeConfig(2, 4)).key.endswith("-2t")       # 8 cores shared by 4 ranks
    assert profiler_for(ComputeConfig(1, 1)).key.endswith("-8t")

    seen = []
    monkeypatch.setattr(profile, "time_op", lambda op, device: seen.append(torch.get_num_threads()) or (1e-3, 2e-3))
    before = torch.get_num_threads()
    profiler = OpProfiler(torch.device("cpu"), tmp_path / "ops.json", threads=before + 1)
    profiler.time(_ops()[0])
    assert seen == [before + 1]                     # timed at the ranks' count...
    assert torch.get_num_threads() == before        # ...and the caller's count given back
