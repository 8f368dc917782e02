"""An engine killed or stopped at the worst moments: a clear error naming the rank and the cause
within 60 s, nothing half-written, and a cluster that trains as one process does afterwards."""

import pytest

from tests.faults import processes
from tests.faults.staging import check

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(240)]


def test_an_engine_killed_in_a_forward(cluster, tmp_path):
    check(processes.kill_in_forward(cluster, tmp_path))


def test_an_engine_killed_in_a_collective(cluster, tmp_path):
    check(processes.kill_in_collective(cluster, tmp_path))


def test_an_engine_killed_in_a_checkpoint_save_leaves_the_previous_checkpoint(cluster, tmp_path):
    check(processes.kill_in_checkpoint_save(cluster, tmp_path))


def test_a_stopped_engine_is_named_as_stopped_after_the_collective_timeout(cluster, tmp_path):
    row = processes.stop_in_collective(cluster, tmp_path)
    check(row)
    assert row.seconds >= cluster.spec.timeout - 1      # nothing but the timeout tells a hang apart
