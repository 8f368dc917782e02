import dataclasses

import pandas as pd
import pytest

from nbscaler.schedule import Block, TimedBlock, Timeline, build_schedule, simulate


def test_the_row_format_is_the_telemetry_event():
    assert [f.name for f in dataclasses.fields(TimedBlock)] == ["rank", "stage", "micro", "phase", "t_start", "t_end"]
    t = TimedBlock(rank=1, stage=2, micro=3, phase="B", t_start=1.5, t_end=4.0)
    assert t.block == Block(2, 3, "B") and t.duration == 2.5


def test_measured_rows_with_wall_clock_stamps():
    rows = pd.DataFrame({
        "rank": [0, 1, 0], "stage": [0, 1, 0], "micro": [0, 0, 0], "phase": ["F", "F", "B"],
        "t_start": [100.0, 101.0, 103.0], "t_end": [101.0, 102.0, 104.0], "host": ["a", "b", "a"],
    }).to_dict("records")
    line = Timeline.from_rows(rows)
    assert line.nranks == 2 and line.makespan == 4.0 and line.busy_time == 3.0
    assert line.bubble_fraction == pytest.approx(1 - 3.0 / 8.0)
    # A rank that recorded nothing still counts as idle.
    assert Timeline.from_rows(rows, nranks=4).bubble_fraction == pytest.approx(1 - 3.0 / 16.0)


def test_predicted_rows_round_trip_and_feed_a_dataframe():
    predicted = simulate(build_schedule("1f1b", 3, 4), forward_costs=1.0)
    frame = pd.DataFrame(predicted.to_rows())
    assert list(frame.columns) == ["rank", "stage", "micro", "phase", "t_start", "t_end"]
    assert len(frame) == 3 * 4 * 2
    assert Timeline.from_rows(frame.to_dict("records"), nranks=3) == predicted


def test_an_empty_timeline_has_no_bubble():
    empty = Timeline((), nranks=2)
    assert empty.makespan == 0.0 and empty.bubble_fraction == 0.0


def test_collectives_beside_the_blocks_change_no_block_figure():
    from nbscaler.schedule import CollectiveBlock, TimedBlock, Timeline
    blocks = (TimedBlock(0, 0, 0, "F", 0.0, 1.0), TimedBlock(0, 0, 0, "B", 1.0, 3.0))
    gather = CollectiveBlock(0, 0, 0, "F", "all_gather", "layers.0", 0.0, 0.25, 0.25)
    line = Timeline(blocks, 1, (gather,))
    assert line.makespan == Timeline(blocks, 1).makespan == 3.0 and line.bubble_fraction == 0.0
    assert line.collective_rows() == [{"rank": 0, "stage": 0, "micro": 0, "phase": "F", "kind": "all_gather",
                                       "unit": "layers.0", "t_start": 0.0, "t_end": 0.25, "waited_s": 0.25,
                                       "sync": False, "context": False}]
    assert gather.duration == 0.25 and Timeline(blocks, 1).collective_rows() == []
