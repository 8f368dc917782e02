"""``nbscaler.init_distributed``: the environment of each launcher read without one, and the same
training script under a real ``mpirun`` and a real one-node Slurm's ``srun``, equal to one process."""

import doctest
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nbscaler.runtime import distributed, hostlist
from nbscaler.runtime.distributed import Launcher, derived_port, read_launch_env
from nbscaler.runtime.hostlist import expand_hostlist, expand_tasks_per_node
from tests.multiprocess import RTOL
from tests.runtime.launcher_script import reference_losses

REPO = Path(__file__).resolve().parents[2]
SCRIPT = [sys.executable, "-m", "tests.runtime.launcher_script"]


@pytest.mark.parametrize("module", [distributed, hostlist])
def test_the_docstring_examples_hold(module):
    assert doctest.testmod(module).failed == 0


@pytest.mark.parametrize("nodes, hosts", [
    ("vm", ["vm"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("a[8-10],b,c[1,3]", ["a8", "a9", "a10", "b", "c1", "c3"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
])
def test_slurm_host_lists_expand_in_order_with_their_padding(nodes, hosts):
    assert expand_hostlist(nodes) == hosts


@pytest.mark.parametrize("bad", ["node[1-2", "node1-2]", "node[a-b]"])
def test_a_malformed_host_list_is_refused(bad):
    with pytest.raises(ValueError, match="host list"):
        expand_hostlist(bad)


def test_slurm_tasks_per_node_expand():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]


def test_no_launcher_is_one_process():
    launch = read_launch_env({"PATH": "/bin"})
    assert (launch.launcher, launch.rank, launch.world_size, launch.local_rank) == (Launcher.NONE, 0, 1, 0)


def test_torchrun():
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "n0",
           "MASTER_PORT": "29400", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}
    assert tuple(vars(read_launch_env(env)).values()) == (Launcher.TORCHRUN, 5, 8, 1, 4, "n0", 29400)


OMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_MCA_ess_base_jobid": "1967652865"}


def test_open_mpi_on_one_host_meets_on_localhost_at_a_port_of_the_job():
    launch = read_launch_env(OMPI)
    assert tuple(vars(launch).values()) == (Launcher.OPEN_MPI, 3, 4, 3, 4, "localhost", derived_port("1967652865"))
    assert read_launch_env({**OMPI, "OMPI_COMM_WORLD_RANK": "0"}).master_port == launch.master_port


def test_open_mpi_takes_master_addr_and_port_when_set():
    launch = read_launch_env({**OMPI, "MASTER_ADDR": "n7", "MASTER_PORT": "1234"})
    assert (launch.master_addr, launch.master_port) == ("n7", 1234)


def test_open_mpi_over_several_hosts_needs_master_addr():
    with pytest.raises(ValueError, match="-x MASTER_ADDR="):
        read_launch_env({**OMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"})


SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "7", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
         "SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_JOB_NODELIST": "gpu[07-10]", "SLURM_JOB_ID": "42",
         "SLURM_STEP_ID": "0"}


def test_slurm_meets_at_the_first_host_of_the_job():
    launch = read_launch_env(SLURM)
    assert tuple(vars(launch).values()) == (Launcher.SLURM, 5, 7, 1, 2, "gpu07", derived_port("42.0"))
    assert read_launch_env({**SLURM, "SLURM_STEP_ID": "1"}).master_port != launch.master_port


def test_a_slurm_batch_script_outside_a_step_is_one_process():
    batch = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_ID"}
    assert read_launch_env(batch).launcher is Launcher.NONE


def test_a_bad_rank_variable_is_named():
    with pytest.raises(ValueError, match=r"OMPI_COMM_WORLD_SIZE='four' is not an integer"):
        read_launch_env({**OMPI, "OMPI_COMM_WORLD_SIZE": "four"})


def _run(command, tmp_path: Path, env=None) -> list:
    """Run the script under ``command`` (a launcher's words before it); returns each rank's facts."""
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, **(env or {}),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([*command, *SCRIPT, str(out), str(tmp_path / "gen")], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return [json.loads(path.read_text()) for path in sorted(out.glob("rank*.json"))]


def _check(ranks: list, launcher: Launcher, world_size: int) -> None:
    assert [(r["launcher"], r["rank"], r["local_rank"], r["world_size"]) for r in ranks] == \
        [(launcher.value, i, i, world_size) for i in range(world_size)]
    assert all(r["distributed"] == (world_size > 1) and r["same_again"] and r["device"] == "cpu" for r in ranks)
    assert {r["backend"] for r in ranks} == ({"gloo"} if world_size > 1 else {None})
    for r in ranks:
        assert r["losses"] == pytest.approx(reference_losses(), rel=RTOL)


@pytest.mark.slow                      # starts a Python interpreter that imports torch
def test_without_a_launcher_the_script_is_one_process(tmp_path):
    _check(_run([], tmp_path), Launcher.NONE, 1)


@pytest.mark.multiprocess
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs mpirun (apt-get install openmpi-bin)")
def test_under_mpirun_two_ranks_train_as_one_process(tmp_path):
    command = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2", "-x", "PYTHONPATH",
               "-x", "NBSCALER_CACHE_DIR"]
    _check(_run(command, tmp_path), Launcher.OPEN_MPI, 2)


@pytest.mark.multiprocess
def test_under_srun_two_ranks_train_as_one_process(slurm, tmp_path):
    if not slurm.real:
        pytest.skip("needs a real Slurm to run srun; the stand-in scripts ran instead")
    _check(_run(["srun", "-n", "2", "--cpus-per-task=1", f"--partition={slurm.partition}"], tmp_path),
           Launcher.SLURM, 2)
