"""The fp8-against-bf16 loss benchmark runs on a small case, and its table follows from its losses."""

import json

import pytest

from benchmarks.float8_loss import RUNS, distance, main, running_mean


def test_distance_is_the_largest_gap_of_running_means_after_the_first_window():
    assert running_mean([1.0, 2.0, 3.0, 4.0], 2) == [1.5, 2.5, 3.5]
    reference = [4.0] * 6
    curve = [9.0, 9.0, 4.0, 4.0, 5.0, 4.0]            # the first window's gap is left out
    assert distance(curve, reference, 2) == pytest.approx((4.5 - 4.0) / 4.0)


@pytest.mark.multiprocess
def test_the_script_writes_every_run_and_its_distances(tmp_path):
    out = main(["--steps", "9", "--window", "3", "--out", str(tmp_path / "float8_loss.md"),
                "--gen-dir", str(tmp_path / "gen")])
    text = out.read_text()
    data = json.loads(out.with_suffix(".json").read_text())
    runs = data["runs"]
    assert set(runs) == set(RUNS) and all(len(r["losses"]) == 9 for r in runs.values())
    bf16 = runs["bf16"]["losses"]
    yardstick = distance(runs["bf16, other data"]["losses"], bf16, 3)
    assert f"{yardstick:.4f}." in text
    for name in ("fp8 tensorwise", "fp8 rowwise"):
        gap = distance(runs[name]["losses"], bf16, 3)
        verdict = "yes" if gap <= yardstick else "no"
        assert f"| {name} | {runs[name]['losses'][0]:.4f} |" in text and f"| {gap:.4f} | {verdict} |" in text
        assert runs[name]["losses"] != bf16                 # the products were fp8: the curve moved
