"""The Pareto front of a sweep: the configurations no other one beats on both time and memory.

A configuration is *dominated* when another one is at least as fast and needs at most as much
memory per GPU, and is strictly better on one of the two. The front is what is left: every point
on it trades memory for speed, so the choice among them is the user's (how much headroom they
want), while a point off it is never worth running.

>>> import pandas as pd
>>> frame = pd.DataFrame({"step_time_s": [1.0, 2.0, 1.5, 3.0], "peak_bytes": [9, 3, 9, 3]})
>>> pareto_front(frame).tolist()
[True, True, False, False]
"""

from __future__ import annotations

import pandas as pd

from nbscaler.columns import SweepColumn as S


def pareto_front(frame: pd.DataFrame, time: str = S.STEP_TIME_S, memory: str = S.PEAK_BYTES) -> pd.Series:
    """A boolean series over ``frame``'s rows: True where no other row is at least as good on both
    ``time`` and ``memory`` and better on one. Ties (equal on both) are all on the front."""
    order = frame.sort_values([str(time), str(memory)], kind="stable").index
    on_front = pd.Series(False, index=frame.index)
    best_memory, best_time = float("inf"), None
    for index in order:
        t, m = frame.at[index, str(time)], frame.at[index, str(memory)]
        # rows come fastest first: a row is on the front when it needs less memory than every
        # faster row, or exactly ties the last front row
        if m < best_memory or (m == best_memory and t == best_time):
            on_front[index] = True
            best_memory, best_time = m, t
    return on_front
