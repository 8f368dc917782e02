"""Rank placement, endpoints and launcher options: plain functions, no engines needed."""

import pytest

from nbscaler.cluster import network
from nbscaler.cluster.session import place_ranks
from nbscaler.cluster.launchers import launcher_options
from nbscaler.config import threads_per_rank


def facts(host, pid):
    return {"host": host, "address": host, "interface": "eth0", "pid": pid, "cores": 8, "gpus": 0}


def test_each_host_gets_consecutive_ranks_whatever_order_the_engines_registered_in():
    slots = place_ranks([3, 4, 7, 9], [facts("a", 1), facts("b", 2), facts("a", 3), facts("b", 4)])
    assert [(s.rank, s.engine_id, s.host, s.local_rank, s.local_world_size) for s in slots] == \
        [(0, 3, "a", 0, 2), (1, 7, "a", 1, 2), (2, 4, "b", 0, 2), (3, 9, "b", 1, 2)]


def test_on_one_host_rank_r_is_the_r_th_engine_id():
    slots = place_ranks([5, 2, 8], [facts("a", 1), facts("a", 2), facts("a", 3)])
    assert [(s.rank, s.engine_id, s.local_rank) for s in slots] == [(0, 2, 0), (1, 5, 1), (2, 8, 2)]


def test_threads_share_the_cores_and_never_drop_to_zero():
    assert threads_per_rank(8, 4) == 2
    assert threads_per_rank(2, 4) == 1


def test_user_launcher_options_win_and_environment_is_merged():
    options = launcher_options("mpi", 2, "/p", {"mpi_args": ["--bind-to", "none"],
                                                "environment": {"OMPI_MCA_rmaps_base_oversubscribe": "0"}})
    assert options["mpi_args"] == ["--bind-to", "none"]
    assert options["environment"]["OMPI_MCA_rmaps_base_oversubscribe"] == "0"
    assert "OMP_NUM_THREADS" in options["environment"]


def test_slurm_batch_script_goes_to_the_profile_dir():
    assert launcher_options("slurm", 4, "/p", {})["batch_file_name"] == "/p/slurm_engine.sbatch"


def test_an_endpoint_on_a_network_that_is_not_here_names_what_the_host_has():
    with pytest.raises(ValueError, match=r"network='198\.51\.100\.0/24'.*lo 127\.0\.0\.1"):
        network.choose("198.51.100.0/24")
    assert network.choose("lo") == network.Endpoint("127.0.0.1", "lo")
    assert network.choose("127.0.0.0/8") == network.Endpoint("127.0.0.1", "lo")
    assert network.choose(None, toward="127.0.0.1") == network.Endpoint("127.0.0.1", "lo")
