"""After a user's mistake the same cluster compiles and trains again, and matches one process.

Each test trains a module first (so that the ranks hold process groups made for it), then breaks
a call the way a notebook user does, then compiles and trains a ``tp`` and a ``pp`` module on the
same engines and checks both against a single process.
"""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from nbscaler.cluster import RankError
from tests.multiprocess import Case, RankSignal, case_batch, check_on_cluster, parallelize_on, pipeline

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

TP = Case("mlp", "tp", 2, 2)
PP = Case("gpt", "pp", 2, 2, config=pipeline("1f1b", 2, 4))


def trained_module(cluster, gen_dir):
    """A tp module that has trained a step: its ranks now hold subgroups of the current group."""
    remote = parallelize_on(cluster, TP, gen_dir)
    remote.train(lambda step, unit: case_batch(TP, step, unit), 1, torch.optim.SGD, lr=0.1,
                 progress=False)
    return remote


def check_tp_and_pp(cluster, tmp_path):
    check_on_cluster(cluster, TP, str(tmp_path / "tp"))
    check_on_cluster(cluster, PP, str(tmp_path / "pp"))


def function_with_a_typo():
    return dist.get_rnak()


def test_training_works_again_after_a_rank_raised(cluster, tmp_path):
    old = trained_module(cluster, str(tmp_path / "before"))
    with pytest.raises(RankError, match="get_rnak"):
        cluster.run(function_with_a_typo)
    with pytest.raises(RankError, match="(?i)parallelize it again"):  # the old module says what to do
        old.train(lambda step, unit: case_batch(TP, step, unit), 1, progress=False)
    check_tp_and_pp(cluster, tmp_path)


def test_training_works_again_after_a_collective_timed_out(cluster, tmp_path):
    remote = trained_module(cluster, str(tmp_path / "before"))

    def rank_1_stalls_at_step_2(step, unit):
        if step == 2 and dist.get_rank() == 1:
            while True:  # rank 0 waits for it in the forward's collective until the group times out
                time.sleep(0.05)
        return case_batch(TP, step, unit)

    with pytest.raises(RankError, match="(?i)timed out|timeout"):
        remote.train(rank_1_stalls_at_step_2, 3, progress=False)
    check_tp_and_pp(cluster, tmp_path)


def test_training_works_again_after_the_user_interrupted_it(cluster, tmp_path):
    """The notebook's stop button raises KeyboardInterrupt in the kernel while ``train`` waits."""
    remote = trained_module(cluster, str(tmp_path / "before"))
    started = RankSignal()
    started.then(lambda: os.kill(os.getpid(), signal.SIGINT))

    def slow_batches(step, unit):
        if step == 2 and dist.get_rank() == 0:
            started.fire()  # mid-training: the notebook interrupts now
        time.sleep(0.2)
        return case_batch(TP, step, unit)

    try:
        with pytest.raises(KeyboardInterrupt):
            remote.train(slow_batches, 1000, progress=False)
    finally:
        started.close()
    check_tp_and_pp(cluster, tmp_path)
