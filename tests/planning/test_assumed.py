"""What a prediction on this machine assumes: the backend priced, uncalibrated collectives, ranks
beyond the cores; in the summary, the explanation and the views (``planning.assumed``)."""

import pytest
import torch

from nbscaler import ComputeConfig, Hardware
from nbscaler.cost import comm_model
from nbscaler.cost.comm_model import CommModel
from nbscaler.cost.timing import StepModel, profiler_for
from nbscaler.layouts import Backend
from nbscaler.widgets.report import summary_html
from nbscaler.widgets.timeline import TimelineView
from tests.conftest import gpt_plan


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cost cache: no collectives calibrated here."""
    monkeypatch.setenv("NBSCALER_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("NBSCALER_BACKEND", raising=False)
    return tmp_path


@pytest.fixture(scope="module")
def tp():
    return gpt_plan("tp", ComputeConfig(2, 2))


@pytest.mark.slow
def test_the_summary_says_which_backend_it_priced_and_that_collectives_are_uncalibrated(tp, fresh_cache):
    lines = tp.summary(torch.optim.SGD).attrs["assumed"]
    assert lines == tp.assumed()
    assert lines[0].startswith("collectives priced for gloo: the backend the 2 ranks of this plan run on this host")
    assert any("gloo's uncalibrated defaults" in line and "calibrate_ranks()" in line for line in lines)
    comm_model.store(CommModel(2e-4, 1e-9, calibrated=True), 2, "gloo")
    assert not any("uncalibrated" in line for line in tp.summary(torch.optim.SGD).attrs["assumed"])


@pytest.mark.slow       # seconds on its own: make test runs it, the edit-test loop does not
def test_explanation_report_and_timeline_show_the_lines(tp, fresh_cache):
    lines = tp.assumed()
    text = str(tp.explain())
    assert "assumed by predictions on this machine:" in text and all(line in text for line in lines)
    shown = summary_html(tp, torch.optim.SGD)
    assert "Assumed: collectives priced for gloo" in shown and "uncalibrated defaults" in shown
    assert all(line in TimelineView(tp).assumptions for line in lines)


def test_a_target_assumes_nothing_of_this_machine(tp):
    assert tp.summary(hardware=Hardware.named("A100-SXM-80GB")).attrs["assumed"] == []


def test_more_ranks_than_cores_is_said(tp, fresh_cache, monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    assert any(line.startswith("2 ranks share 1 CPU cores") for line in tp.assumed())
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert not any("CPU cores" in line for line in tp.assumed())


def test_a_gpu_short_of_the_ranks_is_priced_as_the_gloo_the_runtime_runs(tp, fresh_cache, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert comm_model.local_backend(1) is Backend.NCCL          # one rank on its GPU
    assert comm_model.local_backend(2) is Backend.GLOO          # two ranks share it: gloo on the CPU
    assert profiler_for(tp.config).device.type == "cpu"
    assert tp.collectives_on(Backend.GLOO).equals(tp.collectives)
    assert "fewer GPUs than ranks" in tp.assumed()[0] and "priced for gloo" in tp.assumed()[0]
    monkeypatch.setenv("NBSCALER_BACKEND", "nccl")               # the runtime's override, priced too
    assert comm_model.local_backend(2) is Backend.NCCL
    assert comm_model.load(comm_model.local_backend(2)).backend == "nccl"


@pytest.mark.slow
def test_the_step_model_loads_the_collectives_of_the_local_backend(tp, fresh_cache, monkeypatch):
    calls = []
    real = comm_model.load
    monkeypatch.setattr(comm_model, "load",
                        lambda backend=None, nranks=2: calls.append(backend) or real(backend, nranks))
    StepModel(tp.placed, runs=tp.local_runs)
    assert calls == [Backend.GLOO]
