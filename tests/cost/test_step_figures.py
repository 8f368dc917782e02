"""StepFigures: one priced step, read by the summary and the sweep alike; the overlap rule in one place."""

import math

import pytest
import torch

from nbscaler.cost.software import Software
from nbscaler.cost.step_figures import DeviceStep, PipelineParts, StepFigures, overlap_window, step_tokens
from tests.planning.test_step import H100, PLAN  # noqa: F401  (conftest's plan fixture plans it)


def test_the_reduction_hides_in_the_backward_only_where_the_target_overlaps_it():
    assert overlap_window([0.2, 0.5], H100) == 0.5
    assert overlap_window([0.2, 0.5], H100.running(Software(overlap_grad_reduce=False))) is None
    assert overlap_window([0.2, 0.5], None) is None                   # this machine: the same cores


def test_the_job_figures_follow_from_the_devices():
    devices = {0: DeviceStep(1.0, 0.25, 0.5, flops=4e12, hardware_flops=5e12, peak_bytes=7e9, tp_s=0.1),
               1: DeviceStep(1.0, 0.5, 0.5, flops=2e12, hardware_flops=2e12, peak_bytes=9e9, tp_s=0.3)}
    step = StepFigures(devices, units=2, runtime_ngpus=4, hardware=H100, peak_flops=1e15, tokens=step_tokens(1024, 4, 2),
                       pipeline=PipelineParts(makespan_s=1.0, instant_s=0.9, busy_s={0: 0.6, 1: 0.8}))
    assert step.slowest == (2.0, 1) and step.step_time_s == 2.0 and step.peak_bytes == 9e9 and step.fits
    assert step.tokens_per_s == 1024 * 4 * 2 / 2.0
    assert step.mfu == 2 * 6e12 / (2.0 * 4e15) and step.hfu == 2 * 7e12 / (2.0 * 4e15)
    assert step.device_mfu(0) == 4e12 / (1.75 * 1e15)
    assert step.bubble == pytest.approx((0.9 - 0.8) / 2.0) and step.pp_send_share == pytest.approx(0.1 / 2.0)
    assert step.tp_comm_share == 0.3 / 2.0 and step.dp_comm_share == 0.5 / 2.0
    assert math.isnan(StepFigures(devices, 1, 2, tokens=None).tokens_per_s)


@pytest.mark.slow       # seconds on its own: make test runs it, the edit-test loop does not
def test_the_summary_reads_its_step_from_step_figures(plan):
    figures = plan.step_figures(torch.optim.AdamW, hardware=H100)
    s = plan.summary(torch.optim.AdamW, hardware=H100)
    devices = [figures.devices[plan.config.device_of(r)] for r in s["rank"]]
    assert list(s.step_time_s) == [d.step_time_s for d in devices]
    assert list(s.mfu) == [figures.device_mfu(plan.config.device_of(r)) for r in s["rank"]]
    assert (s.tokens_per_s == figures.tokens_per_s).all() and figures.step_time_s == s.step_time_s.max()
    assert figures.flops == sum(s.flops)             # every rank's FLOPs: units x unit 0's devices
    local = plan.step_figures(torch.optim.AdamW)
    assert local.hardware is None and local.peak_flops is None and set(local.devices) == set(figures.devices)


def test_each_device_peak_is_the_most_its_ranks_hold_in_the_memory_table(plan):
    figures = plan.step_figures(torch.optim.AdamW, hardware=H100)
    memory = plan.memory(torch.optim.AdamW)
    for device, d in figures.devices.items():
        ranks = [r for r in memory["rank"] if plan.config.device_of(r) == device]
        assert d.peak_bytes == max(memory.peak_bytes[memory["rank"].isin(ranks)])
    assert figures.peak_bytes == memory.peak_bytes.max() and figures.fits

