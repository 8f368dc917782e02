"""Soak: compile-and-train cycles leak no process, descriptor or thread; notebooks side by side
share nothing and each trains as one process does. The 200-cycle soak is ``benchmarks.faults``."""

import pytest

from tests.faults import soak

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

GROSS_LEAK_MB = 1.0      # a few cycles are too few to measure the 0.1 MB goal; they catch a gross leak


def test_cycles_leak_no_process_descriptor_or_thread(cluster, tmp_path):
    result = soak.soak(cluster, tmp_path, 8)
    assert result.leaked_processes == 0, result.processes
    assert result.leaked_descriptors <= 0, result.fds
    assert result.threads[-1] == result.threads[1], result.threads
    assert result.growth_mb_per_cycle < GROSS_LEAK_MB, result.rss


def test_four_notebooks_side_by_side_share_nothing_and_each_trains(tmp_path):
    side = soak.side_by_side(4, tmp_path, rounds=1)
    assert side["errors"] == []
    assert side["clashes"] == {k: 0 for k in side["clashes"]}, side["seen"]
    assert side["trained"] == 4
