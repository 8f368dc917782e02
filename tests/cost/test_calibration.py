"""Calibrating the time model on real ranks: collectives and speed, cached for later plans."""

import pytest

from nbscaler.cost import comm_model, speed
from nbscaler.cost.calibration import calibrate_ranks
from nbscaler.runtime.launch import spawn


@pytest.mark.multiprocess
def test_calibrating_the_ranks_caches_their_collectives_and_speed(tmp_path, monkeypatch):
    monkeypatch.setenv("NBSCALER_CACHE_DIR", str(tmp_path))
    first, second = spawn(calibrate_ranks, 2, True, threads=1, timeout=120)
    assert first.reference_s == second.reference_s > 0 and first.nranks == 2
    assert first.device_key.endswith("-1t")
    assert speed.load(first.device_key, 2) == first.reference_s
    assert comm_model.load("gloo", 2) == first.comm[2] and first.comm[2].calibrated
