import json

import pytest

from nbscaler.schedule import Block, PipelineSchedule, build_schedule, check_samples


def two_stage(device_blocks, nmicros=1):
    return PipelineSchedule("by-hand", 2, nmicros, device_blocks, [[[0], [1]]], [0] * nmicros)


F0, B0, F1, B1 = Block(0, 0, "F"), Block(0, 0, "B"), Block(1, 0, "F"), Block(1, 0, "B")


def test_consumer_view_of_a_hand_made_schedule():
    s = two_stage([[F0, B0], [F1, B1]])
    assert s.ndevices == 2 and s.is_training
    assert s.blocks_of(1) == (F1, B1)
    assert s.stages_of(0) == (0,) and s.devices_of(1, 0) == (1,)
    assert list(s) == [(0, F0), (0, B0), (1, F1), (1, B1)]
    assert s.dependencies(F0) == () and s.dependencies(F1) == (F0,)
    assert s.dependencies(B0) == (F0, B1) and s.dependencies(B1) == (F1,)


def test_lists_are_stored_as_tuples_so_schedules_are_immutable_values():
    s = two_stage([[F0, B0], [F1, B1]])
    assert isinstance(s.device_blocks[0], tuple) and s.placements == (((0,), (1,)),)
    assert s == two_stage([(F0, B0), (F1, B1)])
    assert hash(s) == hash(two_stage([(F0, B0), (F1, B1)]))


def test_rows_feed_a_dataframe():
    rows = two_stage([[F0, B0], [F1, B1]]).to_rows()
    assert rows[1] == {"device": 0, "order": 1, "stage": 0, "micro": 0, "phase": "B"}
    assert len(rows) == 4


@pytest.mark.parametrize("name", ["1f1b", "chimera_direct", "1f1b_plus"])
def test_dict_round_trip_through_json(name):
    s = build_schedule(name, 4, 4)
    assert PipelineSchedule.from_dict(json.loads(json.dumps(s.to_dict()))) == s


def test_text_chart_has_one_line_per_device():
    lines = str(two_stage([[F0, B0], [F1, B1]])).splitlines()
    assert lines == ["by-hand: 2 stages x 1 micro-batches on 2 devices",
                     "  device 0: F(s0,m0) B(s0,m0)", "  device 1: F(s1,m0) B(s1,m0)"]


@pytest.mark.parametrize(
    "device_blocks, message",
    [
        ([[F0, B0], [F1]], r"device 1 runs B\(s1,m0\) 0 times"),
        ([[F0, B0, B0], [F1, B1]], r"device 0 runs B\(s0,m0\) 2 times"),
        ([[F0, B0, F1], [F1, B1]], r"F\(s1,m0\) is on device 0, but its pipeline places stage 1 on devices \(1,\)"),
        ([[B0, F0], [F1, B1]], r"device 0 runs B\(s0,m0\) before its forward"),
        ([[F0, B0, Block(0, 1, "F")], [F1, B1]], r"F\(s0,m1\) on device 0 is out of range"),
    ],
)
def test_structural_mistakes_are_named(device_blocks, message):
    with pytest.raises(ValueError, match=message):
        two_stage(device_blocks)


def test_a_device_without_work_is_allowed():
    assert two_stage([[F0, B0], [F1, B1], []]).stages_of(2) == ()


def test_bad_placements_are_named():
    with pytest.raises(ValueError, match=r"placements\[0\] places 1 stages; it must place all 2"):
        PipelineSchedule("x", 2, 1, [[F0], [F1]], [[[0]]], [0])
    with pytest.raises(ValueError, match=r"placements\[0\]\[1\]=\(5,\); use devices in 0..1"):
        PipelineSchedule("x", 2, 1, [[F0], [F1]], [[[0], [5]]], [0])
    with pytest.raises(ValueError, match=r"pipeline_of_micro has 2 entries; it needs one per micro-batch \(1\)"):
        PipelineSchedule("x", 2, 1, [[F0], [F1]], [[[0], [1]]], [0, 0])
    with pytest.raises(ValueError, match=r"nmicros=0; it must be a positive integer"):
        PipelineSchedule("x", 2, 0, [[], []], [[[0], [1]]], [])


def test_inference_schedule_has_no_backward():
    s = two_stage([[F0], [F1]])
    assert not s.is_training


def test_check_samples_names_both_fixes():
    s = build_schedule("1f1b", 2, 4)
    check_samples(s, 4)
    with pytest.raises(ValueError) as err:
        check_samples(s, 6)
    assert str(err.value) == (
        "got 6 samples, but the '1f1b' schedule runs pipeline_nmicros=4 micro-batches per step: "
        "pass exactly 4 samples, or build the module with pipeline_nmicros=6."
    )
    with pytest.raises(ValueError, match=r"got 0 samples.*pass exactly 4 samples\.$"):
        check_samples(s, 0)
