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
