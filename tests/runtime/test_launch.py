"""A rank that raises, dies or hangs ends the run with an error that says which, in bounded time."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from nbscaler.runtime.launch import RankFailed
from tests.multiprocess import run_ranks


def _raise_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("bad batch on rank 1")
    dist.barrier()


def _die_on_rank_1():
    if dist.get_rank() == 1:
        os._exit(3)
    dist.barrier()


def _hang_in_a_collective():
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1))      # rank 1 never joins


@pytest.mark.multiprocess
def test_an_exception_names_the_rank_and_its_traceback():
    with pytest.raises(RankFailed, match=r"(?s)rank 1 raised.*ValueError: bad batch on rank 1"):
        run_ranks(_raise_on_rank_1, 2, timeout=60)


@pytest.mark.multiprocess
def test_a_dead_rank_is_reported():
    with pytest.raises(RankFailed, match="rank 1 died with exit code 3"):
        run_ranks(_die_on_rank_1, 2, timeout=60)


@pytest.mark.multiprocess
def test_a_hung_collective_ends_within_the_timeout():
    start = time.monotonic()
    with pytest.raises((TimeoutError, RankFailed)) as err:
        run_ranks(_hang_in_a_collective, 2, timeout=20)
    assert time.monotonic() - start < 60
    assert "rank" in str(err.value)


def _environment_and_pid():
    return os.environ.get("NBSCALER_LAUNCH_PROBE"), os.environ.get("RANK"), os.getpid()


@pytest.mark.multiprocess
def test_each_rank_gets_the_callers_environment_as_it_is_when_the_ranks_start(monkeypatch):
    """Ranks are forked from a server started once (``launch.rank_context``); what the caller sets
    afterwards must still reach them, as it reaches a spawned process."""
    monkeypatch.setenv("NBSCALER_LAUNCH_PROBE", "first")
    first = run_ranks(_environment_and_pid, 2, timeout=60)
    monkeypatch.setenv("NBSCALER_LAUNCH_PROBE", "second")
    second = run_ranks(_environment_and_pid, 2, timeout=60)
    assert [(probe, rank) for probe, rank, _ in first] == [("first", "0"), ("first", "1")]
    assert [(probe, rank) for probe, rank, _ in second] == [("second", "0"), ("second", "1")]
    pids = {pid for *_, pid in first + second}
    assert len(pids) == 4 and os.getpid() not in pids          # a fresh process per rank, every run
