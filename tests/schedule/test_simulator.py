import pytest

from nbscaler.schedule import SCHEDULERS, Block, DeadlockError, PipelineSchedule, build_schedule, simulate, simulate_totals


def fwd(stage, micro):
    return Block(stage, micro, "F")


def bwd(stage, micro):
    return Block(stage, micro, "B")


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("nstages", [2, 4, 8])
def test_uniform_bubble_matches_the_closed_form(name, nstages):
    for nmicros in range(nstages, 4 * nstages + 1):
        timeline = simulate(build_schedule(name, nstages, nmicros), forward_costs=1.0, backward_costs=2.0)
        expected = (nstages - 1) / (nmicros + nstages - 1)
        assert abs(timeline.bubble_fraction - expected) < 1e-9, (nmicros, timeline.bubble_fraction)
        assert timeline.makespan == pytest.approx(3 * (nmicros + nstages - 1))


def test_four_stages_eight_micro_batches():
    for name in ("gpipe", "1f1b"):
        timeline = simulate(build_schedule(name, 4, 8), [1.0] * 4)
        assert timeline.makespan == 33.0
        assert timeline.bubble_fraction == pytest.approx(3 / 11, abs=1e-12)


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_timed_blocks_respect_device_order_and_data_flow(name):
    schedule = build_schedule(name, 4, 6, ndevices=2 if SCHEDULERS[name].stages_per_device is None else None)
    forward = [0.5 + 0.25 * s for s in range(schedule.nstages)]
    backward = [2.5 - 0.5 * s for s in range(schedule.nstages)]
    latency = 0.1
    timeline = simulate(schedule, forward, backward, latency=latency)
    end = {t.block: t.t_end for t in timeline.blocks}
    for device in range(schedule.ndevices):
        mine = [t for t in timeline.blocks if t.rank == device]
        assert [t.block for t in mine] == list(schedule.blocks_of(device))
        assert all(a.t_end <= b.t_start for a, b in zip(mine, mine[1:]))
    for t in timeline.blocks:
        cost = {"F": forward[t.stage], "B": backward[t.stage], "W": 0.0}[t.phase]
        if schedule.splits_backward and t.phase != "F":
            cost = backward[t.stage] / 2         # B and W share the backward equally by default
        assert t.duration == pytest.approx(cost)
        for dep in schedule.dependencies(t.block):
            assert t.t_start >= end[dep] - 1e-12
            if t.rank not in schedule.devices_of(dep.stage, dep.micro):
                assert t.t_start >= end[dep] + latency - 1e-12


def test_latency_is_paid_only_between_devices():
    one_micro = simulate(build_schedule("1f1b", 2, 1), forward_costs=1.0, latency=0.5)
    times = {str(t.block): (t.t_start, t.t_end) for t in one_micro.blocks}
    assert times == {"F(s0,m0)": (0.0, 1.0), "F(s1,m0)": (1.5, 2.5), "B(s1,m0)": (2.5, 4.5), "B(s0,m0)": (5.0, 7.0)}

    shared_head = simulate(build_schedule("1f1b_plus", 2, 1), forward_costs=1.0, latency=0.5)
    starts = {(t.rank, str(t.block)): t.t_start for t in shared_head.blocks}
    assert starts[0, "F(s1,m0)"] == 1.0  # device 0 holds its part of the head: nothing to send
    assert starts[1, "F(s2,m0)"] == 2.5


def test_posting_a_transfer_lengthens_the_sender_and_idles_the_receiver():
    one_micro = simulate(build_schedule("1f1b", 2, 1), forward_costs=1.0, latency=0.5, post=0.25)
    times = {str(t.block): (t.t_start, t.t_end) for t in one_micro.blocks}
    # F(s0) and B(s1) send: 0.25 longer each; each result arrives 0.5 after its block ends. The
    # receives were posted long before the data came, so their posts hide in the waits.
    assert times == {"F(s0,m0)": (0.0, 1.25), "F(s1,m0)": (1.75, 2.75), "B(s1,m0)": (2.75, 5.0), "B(s0,m0)": (5.5, 7.5)}
    assert one_micro.busy_time == pytest.approx(6 + 2 * 0.25)

    # Back to back, device 1 waits for nothing but its own post: it idles in between.
    line = simulate(build_schedule("gpipe", 2, 2), forward_costs=[0.1, 1.0], post=0.25)
    f1 = [t for t in line.blocks if t.rank == 1 and t.phase == "F"]
    assert (f1[0].t_start, f1[0].t_end) == pytest.approx((0.35, 1.35))      # after F(s0,m0): 0.1 + 0.25
    assert f1[1].t_start == pytest.approx(1.35 + 0.25)                      # its input came at 0.7


def test_backward_defaults_to_twice_the_forward():
    timeline = simulate(build_schedule("gpipe", 2, 2), forward_costs=[1.0, 3.0])
    assert {t.block.stage: t.duration for t in timeline.blocks if t.phase == "B"} == {0: 2.0, 1: 6.0}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"forward_costs": [1.0, 1.0]}, "forward_costs has 2 entries, but the schedule has 3 stages"),
        ({"forward_costs": 1.0, "backward_costs": [1.0]}, "backward_costs has 1 entries, but the schedule has 3 stages"),
        ({"forward_costs": [1.0, -1.0, 1.0]}, "forward_costs=[1.0, -1.0, 1.0] has a negative cost"),
        ({"forward_costs": 1.0, "latency": -0.1}, "latency=-0.1 is negative"),
        ({"forward_costs": 1.0, "post": -0.1}, "post=-0.1 is negative"),
    ],
)
def test_costs_that_do_not_fit_are_refused(kwargs, message):
    with pytest.raises(ValueError) as err:
        simulate(build_schedule("1f1b", 3, 3), **kwargs)
    assert str(err.value).startswith(message)


def test_a_circular_wait_is_reported_with_the_blocked_blocks():
    crossed = PipelineSchedule(
        "crossed", 2, 2,
        [[fwd(0, 0), bwd(0, 0), fwd(0, 1), bwd(0, 1)],   # device 0 waits for the backward of micro 0 ...
         [fwd(1, 1), bwd(1, 1), fwd(1, 0), bwd(1, 0)]],  # ... which device 1 runs only after micro 1
        [[[0], [1]]], [0, 0],
    )
    with pytest.raises(DeadlockError) as err:
        simulate(crossed, 1.0)
    assert isinstance(err.value, ValueError)
    assert str(err.value).startswith(
        "pipeline schedule 'crossed' deadlocks, no device can proceed: "
        "device 0 at B(s0,m0) waits for B(s1,m0); device 1 at F(s1,m1) waits for F(s0,m1)."
    )


def test_devices_that_disagree_on_a_shared_block_deadlock():
    head_then_tail = [[[0, 1], [0]]]
    disagreeing = PipelineSchedule(
        "disagreeing", 2, 2,
        [[fwd(0, 0), fwd(0, 1), fwd(1, 0), fwd(1, 1)], [fwd(0, 1), fwd(0, 0)]],
        head_then_tail, [0, 0],
    )
    with pytest.raises(DeadlockError, match=r"device 0 at F\(s0,m0\) waits for devices \[1\] to reach it; "
                                            r"device 1 at F\(s0,m1\) waits for devices \[0\] to reach it"):
        simulate(disagreeing, 1.0)


def test_extra_seconds_lengthen_only_their_blocks():
    schedule = build_schedule("1f1b", nstages=2, nmicros=2)
    plain = simulate(schedule, forward_costs=1.0)
    slower = simulate(schedule, forward_costs=1.0, extra={Block(0, 0, "F"): 0.5})
    first = {(b.stage, b.micro, b.phase): b for b in slower.blocks}
    assert first[(0, 0, "F")].duration == 1.5 and first[(0, 1, "F")].duration == 1.0
    assert slower.makespan == plain.makespan + 0.5
    assert simulate_totals(schedule, 1.0, extra={Block(0, 0, "F"): 0.5}).makespan == slower.makespan
    with pytest.raises(ValueError, match="negative cost"):
        simulate(schedule, 1.0, extra={Block(0, 0, "F"): -1.0})
