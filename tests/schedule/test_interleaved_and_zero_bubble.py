"""The schedules of today: interleaved 1F1B and zero bubble (ZB-H1), as data and as predicted by
the simulator, against the closed forms of their papers."""

from collections import Counter

import pytest

from nbscaler import ComputeConfig
from nbscaler.schedule import Block, PipelineGeometry, build_schedule, simulate

DEVICES = (2, 3, 4)


def interleaved(ndevices, chunks, nmicros):
    return build_schedule("1f1b_interleaved", ndevices * chunks, nmicros, ndevices=ndevices)


@pytest.mark.parametrize("ndevices", DEVICES)
@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_interleaved_bubble_is_exactly_the_closed_form(ndevices, chunks):
    """Narayanan et al. 2021, section 2.2.2: with ``v`` chunks per device the bubble takes
    ``(p-1)/v`` micro-batch times out of ``m + (p-1)/v``, an idle share of ``(p-1)/(v*m + p-1)``.
    Every stage costs the same (F = 1, B = 2); communication is free."""
    for nmicros in range(ndevices, 4 * ndevices + 1, ndevices):
        line = simulate(interleaved(ndevices, chunks, nmicros), forward_costs=1.0)
        expected = (ndevices - 1) / (chunks * nmicros + ndevices - 1)
        assert line.bubble_fraction == pytest.approx(expected, rel=1e-12, abs=0), (nmicros, line.bubble_fraction)


def test_interleaved_with_one_chunk_is_1f1b():
    assert interleaved(4, 1, 8).device_blocks == build_schedule("1f1b", 4, 8).device_blocks


def test_interleaved_puts_stages_r_r_plus_p_on_rank_r_and_runs_every_block_once():
    schedule = interleaved(4, 2, 8)
    assert [schedule.stages_of(r) for r in range(4)] == [(0, 4), (1, 5), (2, 6), (3, 7)]
    runs = Counter(b for _, b in schedule)
    assert runs == {Block(s, m, p): 1 for s in range(8) for m in range(8) for p in "FB"}


def test_interleaved_refuses_micro_batches_that_do_not_fill_groups():
    with pytest.raises(ValueError, match="pipeline_nmicros=6 must be a multiple of 4: set pipeline_nmicros=8"):
        interleaved(4, 2, 6)
    with pytest.raises(ValueError, match="multiple of 4"):
        ComputeConfig(4, 4, use_end2end=True, use_pipeline=True, pipeline_scheduler="1f1b_interleaved",
                      pipeline_nstages=6, pipeline_nmicros=4)
    with pytest.raises(ValueError, match="give ndevices"):
        build_schedule("1f1b_interleaved", 8, 8)


def test_config_places_interleaved_stages_on_every_plan_device():
    cfg = ComputeConfig(2, 2, use_end2end=True, use_pipeline=True, pipeline_scheduler="1f1b_interleaved",
                        pipeline_nmicros=4)
    geometry = PipelineGeometry.from_config(cfg)
    assert (geometry.schedule.nstages, geometry.schedule.ndevices, geometry.tp) == (4, 2, 1)
    assert [geometry.stage_group(s) for s in range(4)] == [(0,), (1,), (0,), (1,)]


# (T_F, T_B, T_W): equal, and unequal with T_W <= min(T_F, T_B)
ZB_COSTS = [(1.0, 1.0, 1.0), (1.0, 1.2, 0.8), (1.0, 1.5, 0.5), (2.0, 1.0, 1.0), (1.0, 2.0, 0.25)]


@pytest.mark.parametrize("ndevices", DEVICES + (5,))
@pytest.mark.parametrize("t_f, t_b, t_w", ZB_COSTS)
def test_zb_h1_bubble_is_exactly_the_papers(ndevices, t_f, t_b, t_w):
    """Qi et al. 2024, section 3.1: 1F1B idles ``(p-1)(T_F + T_B + T_W)`` per device and ZB-H1
    ``(p-1)(T_F + T_B - T_W)``. A device works ``m (T_F + T_B + T_W)``, so the idle share is
    ``(p-1)(T_F + T_B - T_W) / (m (T_F + T_B + T_W) + (p-1)(T_F + T_B - T_W))``; with
    ``T_F = T_B = T_W`` that is ``(p-1) / (3m + p-1)``, against 1F1B's ``(p-1) / (m+p-1)``.
    The closed form is the paper's for ``m >= p`` and ``T_W <= min(T_F, T_B)``, its setting."""
    for nmicros in range(ndevices, 3 * ndevices + 2):
        line = simulate(build_schedule("zb_h1", ndevices, nmicros), t_f, backward_costs=t_b + t_w, weight_costs=t_w)
        idle = (ndevices - 1) * (t_f + t_b - t_w)
        expected = idle / (nmicros * (t_f + t_b + t_w) + idle)
        assert line.bubble_fraction == pytest.approx(expected, rel=1e-12, abs=0), (nmicros, line.bubble_fraction)
        if (t_f, t_b, t_w) == (1.0, 1.0, 1.0):
            assert line.bubble_fraction == pytest.approx((ndevices - 1) / (3 * nmicros + ndevices - 1), rel=1e-12)


@pytest.mark.parametrize("ndevices", DEVICES)
def test_zb_h1_is_1f1b_with_weight_blocks_and_holds_no_more_micro_batches(ndevices):
    nmicros = 3 * ndevices
    zb, one_f_one_b = build_schedule("zb_h1", ndevices, nmicros), build_schedule("1f1b", ndevices, nmicros)
    assert zb.splits_backward and not one_f_one_b.splits_backward
    for device in range(ndevices):
        blocks = zb.blocks_of(device)
        assert [b for b in blocks if b.phase != "W"] == list(one_f_one_b.blocks_of(device))
        assert sorted(b.micro for b in blocks if b.phase == "W") == list(range(nmicros))
        live = peak = 0             # activations live from F to W
        for block in blocks:
            live += {"F": 1, "B": 0, "W": -1}[block.phase]
            peak = max(peak, live)
        assert peak <= ndevices     # 1F1B's peak, on its first device


def test_a_weight_block_before_its_backward_is_refused():
    from nbscaler.schedule import PipelineSchedule
    with pytest.raises(ValueError, match=r"runs W\(s0,m0\) before its backward"):
        PipelineSchedule("by-hand", 1, 1, [[Block(0, 0, "F"), Block(0, 0, "W"), Block(0, 0, "B")]], [[[0]]], [0])


def test_simulator_splits_the_backward_and_checks_the_weight_share():
    line = simulate(build_schedule("zb_h1", 2, 2), forward_costs=1.0, backward_costs=3.0, weight_costs=1.0)
    durations = {(t.phase, t.stage): t.duration for t in line.blocks}
    assert durations[("B", 0)] == 2.0 and durations[("W", 0)] == 1.0 and durations[("F", 1)] == 1.0
    with pytest.raises(ValueError, match="weight_costs"):
        simulate(build_schedule("zb_h1", 2, 2), forward_costs=1.0, backward_costs=1.0, weight_costs=2.0)


@pytest.mark.parametrize("ndevices", DEVICES)
def test_zbv_puts_two_stages_per_device_in_a_v_and_beats_zb_h1(ndevices):
    """ZB-V's order here is played out with unit costs (see ``zero_bubble``), not the paper's
    handcrafted one, so no closed form is claimed: it must run every block once, hold no more
    activations than 1F1B's first device (``2p`` half-size stages), and idle less than ZB-H1 on
    the same devices and micro-batches."""
    for nmicros in (ndevices, 2 * ndevices, 4 * ndevices):
        schedule = build_schedule("zbv", 2 * ndevices, nmicros)
        assert [schedule.stages_of(r) for r in range(ndevices)] == [(r, 2 * ndevices - 1 - r) for r in range(ndevices)]
        runs = Counter(b for _, b in schedule)
        assert runs == {Block(s, m, p): 1 for s in range(2 * ndevices) for m in range(nmicros) for p in "FBW"}
        for device in range(ndevices):
            live = peak = 0
            for block in schedule.blocks_of(device):
                live += {"F": 1, "B": 0, "W": -1}[block.phase]
                peak = max(peak, live)
            assert peak <= 2 * ndevices
        v = simulate(schedule, forward_costs=1.0).bubble_fraction          # a stage is half a device's share
        h1 = simulate(build_schedule("zb_h1", ndevices, nmicros), forward_costs=2.0).bubble_fraction
        assert v < h1, (nmicros, v, h1)


def test_zbv_needs_an_even_number_of_stages():
    with pytest.raises(ValueError, match="zbv puts 2 stages on each device"):
        ComputeConfig(4, 4, use_end2end=True, use_pipeline=True, pipeline_scheduler="zbv", pipeline_nstages=5,
                      pipeline_nmicros=4)
    cfg = ComputeConfig(4, 4, use_end2end=True, use_pipeline=True, pipeline_scheduler="zbv", pipeline_nmicros=4)
    assert PipelineGeometry.from_config(cfg).schedule.ndevices == 4     # 8 stages by default
