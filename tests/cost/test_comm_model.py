"""The alpha-beta model of collectives: its fit, and its calibration on real process groups."""

import pytest

from nbscaler.cost import comm_model
from nbscaler.cost.comm_model import CommModel, fit, group_sizes
from tests.multiprocess import run_ranks


def test_fit_recovers_alpha_and_beta_from_exact_times():
    truth = CommModel(alpha_s=80e-6, beta_s_per_byte=1 / 3e9)
    sizes = [2**10, 2**13, 2**16, 2**19, 2**22]
    for n in (2, 4):
        model = fit(sizes, [truth.forward("all_reduce", s, n) for s in sizes], n)
        assert model.calibrated
        assert model.alpha_s == pytest.approx(truth.alpha_s, rel=1e-9)
        assert model.beta_s_per_byte == pytest.approx(truth.beta_s_per_byte, rel=1e-9)


def test_an_odd_middle_size_does_not_bend_the_latency_of_small_messages():
    # times seen on a shared 2-core machine: the 512 KiB median came out slow
    sizes = [2**10, 2**13, 2**16, 2**19, 2**22]
    model = fit(sizes, [0.52e-3, 0.48e-3, 0.49e-3, 3.3e-3, 3.9e-3], 2)
    assert model.forward("all_reduce", 2**10, 2) == pytest.approx(0.52e-3, rel=0.01)
    assert model.forward("all_reduce", 2**22, 2) == pytest.approx(3.9e-3, rel=0.01)


def test_the_median_of_calibrations_is_stored_for_later_plans(tmp_path, monkeypatch):
    monkeypatch.setenv("NBSCALER_CACHE_DIR", str(tmp_path))
    runs = [CommModel(1e-3, 1e-9, True, 2e-4, 3e-4), CommModel(2e-3, 3e-9, True, 4e-3, 9e-3),
            CommModel(8e-3, 2e-9, True, 3e-4, 2e-4)]
    comm_model.store(comm_model.median_model(runs), 2, "gloo")
    assert comm_model.load("gloo", 2) == CommModel(2e-3, 2e-9, True, 3e-4, 3e-4)    # the slow regime's outliers left out
    assert not list(tmp_path.glob("*.tmp"))                    # written whole, then renamed


def test_group_sizes_are_powers_of_two_and_the_world():
    assert group_sizes(1) == []
    assert group_sizes(2) == [2]
    assert group_sizes(4) == [2, 4]
    assert group_sizes(6) == [2, 4, 6]


def _calibrate_twice():
    first = comm_model.ensure_calibrated()
    second = comm_model.ensure_calibrated()
    return sorted(first), sorted(second), {k: m.calibrated for k, m in first.items()}


@pytest.mark.multiprocess
def test_ensure_calibrated_times_each_group_size_once(tmp_path, monkeypatch):
    monkeypatch.setenv("NBSCALER_CACHE_DIR", str(tmp_path))
    results = run_ranks(_calibrate_twice, 4)
    # Every rank times every size, in its own block of ranks: 0 and 1, 2 and 3 at once, then all four.
    assert all(r == ([2, 4], [], {2: True, 4: True}) for r in results)
    for n in (2, 4):
        saved = comm_model.load("gloo", n)
        assert saved.calibrated and saved.alpha_s > 0 and saved.beta_s_per_byte > 0
        assert 0 < saved.p2p_post_s < 0.1                        # starting a send is timed too
    assert not comm_model.load("gloo", 8).calibrated           # never timed: the defaults


def test_a_pipeline_send_pays_the_latency_of_an_awake_peer():
    model = CommModel(alpha_s=2e-3, beta_s_per_byte=1e-9, calibrated=True, p2p_alpha_s=3e-4)
    assert model.p2p(1000) == pytest.approx(3e-4 + 1e-6)
    assert model.forward("all_reduce", 1000, 2) == pytest.approx(2 * 2e-3 + 1e-6)     # collectives: the step's
    assert CommModel(2e-3, 1e-9).p2p(0) == 2e-3                                       # older calibrations


def test_starting_a_send_or_receive_costs_its_rank_per_tensor():
    assert CommModel(2e-3, 1e-9, True, 3e-4, 2e-4).p2p_post(3) == pytest.approx(6e-4)
    assert CommModel(2e-3, 1e-9).p2p_post(3) == 0.0                                   # not calibrated: nothing
