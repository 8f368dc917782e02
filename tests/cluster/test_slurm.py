"""``Cluster(engines='slurm')`` against a real Slurm: the one-node cluster the ``slurm`` fixture starts.

The engines are one ``sbatch`` job of ``srun`` tasks. The tests check what a user of a Slurm site
relies on: the job shows in ``squeue`` while the engines run, the ranks train as one process does,
a job that Slurm ends from outside (``scancel``) is reported with its id and state, ``restart()``
submits a new job, and ``stop()``, or the death of the notebook, cancels the job. Where no Slurm can run, the ``slurm`` fixture
gives stand-in scripts and the tests that need Slurm's own bookkeeping skip.
"""

import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from nbscaler.cluster import Cluster, ClusterError, RankDied
from nbscaler.cluster.watchdog import cluster_processes
from tests.multiprocess import Case, RankSignal, check_on_cluster, pipeline

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

TP = Case("mlp", "tp", 2, 2)
PP = Case("gpt", "pp", 2, 2, config=pipeline("1f1b", 2, 4))
# A job Slurm ends must reach the notebook as an error well within this (engines die on SIGTERM).
DEADLINE_S = 60
POLL_S = 0.2


@pytest.fixture(scope="module")
def slurm_cluster(slurm, shell):
    with Cluster(n=2, engines="slurm", timeout=20, name="slurm", start_timeout=120,
                 launcher_options={"timelimit": "0:30:00"}) as cl:
        yield cl


@pytest.fixture
def running(slurm_cluster):
    """The module's Slurm cluster, started again if an earlier test stopped it."""
    if not slurm_cluster.running:
        slurm_cluster.start()
    return slurm_cluster


def needs_real_slurm(slurm):
    if not slurm.real:
        pytest.skip("needs a real Slurm (squeue, job states); the stand-in scripts ran instead")


def rank_world_and_job():
    return dist.get_rank(), dist.get_world_size(), os.environ.get("SLURM_JOB_ID")


def sleep_once_started(started: RankSignal):
    if dist.get_rank() == 0:
        started.fire()
    time.sleep(600)


def wait_until_gone(slurm, job: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while job in slurm.queued_jobs():
        assert time.monotonic() < deadline, f"job {job} still in squeue {DEADLINE_S}s after it was cancelled"
        time.sleep(POLL_S)


def test_engines_run_as_one_slurm_job_and_form_the_group(slurm, running):
    script = open(os.path.join(running.profile_dir, "slurm_engine.sbatch")).read()
    assert "#SBATCH --ntasks=2" in script and "#SBATCH --time=0:30:00" in script
    job = running.job_id
    expected_job = job if slurm.real else None
    assert running.run(rank_world_and_job) == [(0, 2, expected_job), (1, 2, expected_job)]
    if slurm.real:
        assert job in slurm.queued_jobs() and slurm.job_state(job) == "RUNNING"


def test_tp_and_pp_train_as_one_process(running, tmp_path):
    check_on_cluster(running, TP, str(tmp_path / "tp"))
    check_on_cluster(running, PP, str(tmp_path / "pp"))


def test_a_job_cancelled_from_outside_is_reported_and_restart_submits_a_new_one(slurm, running):
    needs_real_slurm(slurm)
    old = running.job_id
    started = RankSignal()
    started.then(lambda: slurm.command("scancel", old))
    began = time.monotonic()
    try:
        with pytest.raises(RankDied, match=rf"Slurm job {old}, which Slurm ended: CANCELLED"):
            running.run(sleep_once_started, started)
    finally:
        started.close()
    assert time.monotonic() - began < DEADLINE_S
    with pytest.raises(ClusterError, match="restart"):
        running.run(rank_world_and_job)

    running.restart()
    new = running.job_id
    assert new != old and new in slurm.queued_jobs() and old not in slurm.queued_jobs()
    assert running.run(rank_world_and_job) == [(0, 2, new), (1, 2, new)]


def test_stop_cancels_the_job(slurm, running):
    needs_real_slurm(slurm)
    job, cluster_id = running.job_id, running.cluster_id
    running.stop()
    wait_until_gone(slurm, job)
    assert slurm.job_state(job) == "CANCELLED"
    assert cluster_processes(cluster_id) == []


NOTEBOOK = """
import sys
from nbscaler.cluster import Cluster
cl = Cluster(n=1, engines="slurm", timeout=20, name="doomed", start_timeout=120)
print(cl.job_id, cl.cluster_id, flush=True)
sys.stdin.read()  # a notebook kernel, busy with something else until it is killed
"""


def test_a_killed_notebook_leaves_no_job_behind(slurm):
    needs_real_slurm(slurm)
    notebook = subprocess.Popen([sys.executable, "-c", NOTEBOOK], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True)
    try:
        job, cluster_id = notebook.stdout.readline().split()  # the cluster is up once this line comes
        assert job in slurm.queued_jobs()
        notebook.kill()  # no atexit hook runs: the watchdog cancels the job
        wait_until_gone(slurm, job)
        assert slurm.job_state(job) == "CANCELLED"
        assert cluster_processes(cluster_id) == []
    finally:
        notebook.kill()
        notebook.wait()
