"""The backend rule, as a function of the host's GPUs, its ranks and what the user asked for: no GPU
needed to check it."""

import doctest

import pytest

from nbscaler.runtime import backend
from nbscaler.runtime.backend import BACKEND_ENV, Backend, choose_backend


def test_the_docstring_examples_hold():
    assert doctest.testmod(backend).failed == 0


@pytest.mark.parametrize("gpus, ranks", [(1, 1), (4, 4), (8, 2)])
def test_nccl_with_a_gpu_for_every_rank(gpus, ranks):
    choice = choose_backend(gpus, ranks)
    assert (choice.backend, choice.on_gpu, choice.note) == (Backend.NCCL, True, "")
    assert str(choice.device(ranks - 1)) == f"cuda:{ranks - 1}"


def test_gloo_on_the_cpu_without_a_gpu_says_nothing():
    choice = choose_backend(0, 4)
    assert (choice.backend, choice.on_gpu, choice.note) == (Backend.GLOO, False, "")
    assert str(choice.device(3)) == "cpu"


@pytest.mark.parametrize("gpus, ranks", [(1, 2), (1, 4), (2, 4)])
def test_more_ranks_than_gpus_run_gloo_on_the_cpu_and_say_so_in_one_line(gpus, ranks):
    choice = choose_backend(gpus, ranks)
    assert (choice.backend, choice.on_gpu) == (Backend.GLOO, False)
    assert "\n" not in choice.note
    assert f"{ranks} ranks" in choice.note and f"share {gpus} GPU" in choice.note
    assert f"at most {gpus} ranks per host" in choice.note
    assert f"{BACKEND_ENV}=nccl" in choice.note and f"{BACKEND_ENV}=gloo" in choice.note


@pytest.mark.parametrize("gpus, ranks", [(0, 1), (1, 4), (4, 4)])
def test_gloo_asked_for_runs_on_the_cpu_without_a_note(gpus, ranks):
    assert choose_backend(gpus, ranks, "GLOO") == choose_backend(0, ranks)


def test_nccl_asked_for_shares_out_the_gpus_each_rank_sees():
    # A launcher that binds a GPU to each rank shows each of them one GPU: cuda:0, its own.
    choice = choose_backend(1, 4, "nccl")
    assert (choice.backend, choice.note, str(choice.device(3))) == (Backend.NCCL, "", "cuda:0")
    assert str(choose_backend(2, 4, "nccl").device(3)) == "cuda:1"


def test_nccl_asked_for_without_a_gpu_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=rf"nccl needs GPUs, and this host shows none.*{BACKEND_ENV}=gloo"):
        choose_backend(0, 2, "nccl")


def test_an_unknown_backend_names_the_known_ones():
    with pytest.raises(ValueError, match=r"'mpi'.*'nccl', 'gloo'"):
        choose_backend(1, 1, "mpi")


def test_the_launcher_asks_the_rule_and_says_its_note_once(monkeypatch, tmp_path):
    """One GPU (pretended) for two ranks of this host: the group is gloo and the note is a warning."""
    import torch
    import torch.distributed as dist

    from nbscaler.runtime.launch import init_process_group

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    with pytest.warns(UserWarning, match="2 ranks on this host share 1 GPU"):
        choice = init_process_group(0, 1, f"file://{tmp_path}/rendezvous", 30, local_world_size=2)
    try:
        assert (choice.backend, dist.get_backend()) == (Backend.GLOO, "gloo")
    finally:
        dist.destroy_process_group()
