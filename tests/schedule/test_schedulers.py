from collections import Counter

import pytest

from nbscaler.config import INFER_SCHEDULERS, TRAIN_SCHEDULERS
from nbscaler.schedule import SCHEDULERS, Block, build_schedule, simulate

LINEAR_TRAINING = ("1f1b", "1f1b_plus", "gpipe")


def cases(names, stage_counts, step=1):
    return [(name, p, m) for name in names for p in stage_counts for m in range(p, 4 * p + 1, step)]


TRAINING_CASES = cases(LINEAR_TRAINING, (2, 4, 8)) + cases(("chimera_direct",), (4,), step=2)


def runs_per_block(schedule):
    """How many devices ran each (stage, micro, phase) in the simulated step, and whether they ran it together."""
    timeline = simulate(schedule, forward_costs=1.0)  # raises on deadlock
    runs = Counter(t.block for t in timeline.blocks)
    times = {t.block: set() for t in timeline.blocks}
    for t in timeline.blocks:
        times[t.block].add((t.t_start, t.t_end))
    assert all(len(spans) == 1 for spans in times.values()), "a shared block must run at once on all its devices"
    return runs


def test_the_registry_is_the_set_of_names_the_config_accepts():
    assert set(SCHEDULERS) == set(TRAIN_SCHEDULERS + INFER_SCHEDULERS)


@pytest.mark.parametrize("name, nstages, nmicros", TRAINING_CASES)
def test_training_schedule_runs_every_forward_and_backward_once_per_stage(name, nstages, nmicros):
    schedule = build_schedule(name, nstages, nmicros)
    runs = runs_per_block(schedule)
    expected = {
        Block(s, m, phase): len(schedule.devices_of(s, m))
        for s in range(schedule.nstages) for m in range(nmicros) for phase in "FB"
    }
    assert runs == expected


@pytest.mark.parametrize("name, nstages, nmicros", cases(("infer_pipe",), (2, 4, 8)))
def test_inference_schedule_forwards_each_micro_batch_once_per_stage(name, nstages, nmicros):
    schedule = build_schedule(name, nstages, nmicros)
    assert not schedule.is_training
    assert runs_per_block(schedule) == {Block(s, m, "F"): 1 for s in range(nstages) for m in range(nmicros)}


@pytest.mark.parametrize("name", ["1f1b", "gpipe", "infer_pipe"])
def test_linear_schedules_put_stage_s_on_device_s(name):
    schedule = build_schedule(name, 4, 6)
    assert schedule.ndevices == schedule.nstages == 4
    assert [schedule.stages_of(d) for d in range(4)] == [(0,), (1,), (2,), (3,)]


def test_1f1b_limits_the_forwards_in_flight_to_the_stages_left():
    schedule = build_schedule("1f1b", 4, 12)
    for device in range(4):
        blocks = schedule.blocks_of(device)
        first_backward = next(i for i, b in enumerate(blocks) if b.phase == "B")
        assert first_backward == 4 - device
        in_flight = peak = 0
        for b in blocks:
            in_flight += 1 if b.phase == "F" else -1
            peak = max(peak, in_flight)
        assert peak == 4 - device


def test_gpipe_runs_all_forwards_before_any_backward():
    for blocks in build_schedule("gpipe", 3, 5).device_blocks:
        assert [b.phase for b in blocks] == ["F"] * 5 + ["B"] * 5


def test_1f1b_plus_shares_a_head_stage_over_all_devices():
    schedule = build_schedule("1f1b_plus", 4, 8)
    assert schedule.nstages == 5 and schedule.ndevices == 4
    assert [schedule.stages_of(d) for d in range(4)] == [(0, 1), (0, 2), (0, 3), (0, 4)]
    assert schedule.devices_of(0, 3) == (0, 1, 2, 3)
    head_order = [b for b in schedule.blocks_of(0) if b.stage == 0]
    assert all([b for b in schedule.blocks_of(d) if b.stage == 0] == head_order for d in range(4))
    # The head's forward comes right before stage 1 takes the micro-batch, its backward right after.
    device0 = schedule.blocks_of(0)
    for m in range(8):
        assert device0[device0.index(Block(0, m, "F")) + 1] == Block(1, m, "F")
        assert device0[device0.index(Block(0, m, "B")) - 1] == Block(1, m, "B")


def test_chimera_runs_two_opposite_pipelines_over_four_devices():
    schedule = build_schedule("chimera_direct", 4, 8)
    assert [schedule.stages_of(d) for d in range(4)] == [(0, 3), (1, 2), (1, 2), (0, 3)]
    assert [schedule.devices_of(s, 0) for s in range(4)] == [(0,), (1,), (2,), (3,)]
    assert [schedule.devices_of(s, 1) for s in range(4)] == [(3,), (2,), (1,), (0,)]
    assert Counter(schedule.pipeline_of_micro) == {0: 4, 1: 4}


def test_chimera_idles_less_than_1f1b():
    chimera = simulate(build_schedule("chimera_direct", 4, 4), 1.0)
    one_f_one_b = simulate(build_schedule("1f1b", 4, 4), 1.0)
    assert chimera.bubble_fraction == pytest.approx(0.25)
    assert chimera.makespan < one_f_one_b.makespan


@pytest.mark.parametrize(
    "args, message",
    [
        (("zigzag", 4, 8), "unknown pipeline scheduler 'zigzag': use one of 1f1b, 1f1b_plus, gpipe, chimera_direct, infer_pipe"),
        (("chimera_direct", 8, 8), "chimera_direct runs exactly 4 stages, not pipeline_nstages=8: set pipeline_nstages=4, or use 1f1b or gpipe"),
        (("chimera_direct", 4, 5), "chimera_direct needs an even number of micro-batches, half per direction, not pipeline_nmicros=5: set pipeline_nmicros=6"),
        (("1f1b", 4, 0), "1f1b: nmicros=0 is invalid; it must be an integer >= 1"),
        (("gpipe", 0, 4), "gpipe: nstages=0 is invalid; it must be an integer >= 1"),
        (("infer_pipe", "4", 4), "infer_pipe: nstages='4' is invalid; it must be an integer >= 1"),
    ],
)
def test_bad_configurations_fail_with_the_value_and_the_fix(args, message):
    with pytest.raises(ValueError) as err:
        build_schedule(*args)
    assert str(err.value).startswith(message)
