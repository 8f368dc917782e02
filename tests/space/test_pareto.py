"""``pareto_front`` against the definition, checked row by row on random frames."""

import numpy as np
import pandas as pd

from nbscaler.space.pareto import pareto_front


def _dominated(frame: pd.DataFrame, i) -> bool:
    t, m = frame.step_time_s, frame.peak_bytes
    return any(t[j] <= t[i] and m[j] <= m[i] and (t[j] < t[i] or m[j] < m[i]) for j in frame.index)


def test_front_is_the_undominated_rows():
    rng = np.random.default_rng(0)
    for _ in range(100):
        frame = pd.DataFrame({"step_time_s": rng.integers(0, 5, 12).astype(float),
                              "peak_bytes": rng.integers(0, 5, 12)}, index=rng.permutation(12))
        front = pareto_front(frame)
        assert [bool(front[i]) for i in frame.index] == [not _dominated(frame, i) for i in frame.index]


def test_other_columns():
    frame = pd.DataFrame({"mfu_loss": [0.5, 0.4], "bytes": [1, 2]})
    assert pareto_front(frame, time="mfu_loss", memory="bytes").tolist() == [True, True]
