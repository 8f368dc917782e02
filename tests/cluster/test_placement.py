"""Rank placement and launcher options: plain functions, no engines needed."""

from nbscaler.cluster.session import place_ranks
from nbscaler.cluster.launchers import launcher_options, threads_per_engine


def facts(host, pid):
    return {"host": host, "address": host, "pid": pid, "cores": 8, "gpus": 0}


def test_local_ranks_count_the_engines_of_each_host():
    slots = place_ranks([3, 4, 7, 9], [facts("a", 1), facts("b", 2), facts("a", 3), facts("b", 4)])
    assert [(s.rank, s.engine_id, s.local_rank, s.local_world_size) for s in slots] == \
        [(0, 3, 0, 2), (1, 4, 0, 2), (2, 7, 1, 2), (3, 9, 1, 2)]


def test_threads_share_the_cores_and_never_drop_to_zero():
    assert threads_per_engine(8, 4) == 2
    assert threads_per_engine(2, 4) == 1


def test_user_launcher_options_win_and_environment_is_merged():
    options = launcher_options("mpi", 2, "/p", {"mpi_args": ["--bind-to", "none"],
                                                "environment": {"OMPI_MCA_rmaps_base_oversubscribe": "0"}})
    assert options["mpi_args"] == ["--bind-to", "none"]
    assert options["environment"]["OMPI_MCA_rmaps_base_oversubscribe"] == "0"
    assert "OMP_NUM_THREADS" in options["environment"]


def test_slurm_batch_script_goes_to_the_profile_dir():
    assert launcher_options("slurm", 4, "/p", {})["batch_file_name"] == "/p/slurm_engine.sbatch"
