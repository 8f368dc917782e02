"""How much memory this process holds: what the real-size benchmark and the loading test measure.

Linux splits a process's resident set into anonymous pages (its own tensors: what it costs) and
file-backed ones (pages of files it maps, such as a safetensors checkpoint read by slices: shared
with every process that maps the same file, and given back when the mapping closes). The kernel
keeps a peak only of their sum (``ru_maxrss``); ``PeakResident`` samples both while a block runs.
"""

from __future__ import annotations

import resource
import threading
from typing import Dict

MB = 2**20


def peak_mb() -> float:
    """This process's peak resident set so far (Linux reports ``ru_maxrss`` in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def resident_mb() -> Dict[str, float]:
    """This process's resident memory now: ``RssAnon`` (its own pages) and ``RssFile`` (mapped files)."""
    with open("/proc/self/status") as status:
        fields = dict(line.split(":", 1) for line in status)
    return {key: int(fields[key].split()[0]) / 1024 for key in ("RssAnon", "RssFile")}


class PeakResident:
    """The largest ``resident_mb`` values seen while the ``with`` block runs, sampled every
    ``every_s`` seconds by a thread and once more at its end."""

    def __init__(self, every_s: float = 0.002):
        self.every_s, self.peak = every_s, {"RssAnon": 0.0, "RssFile": 0.0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        for key, value in resident_mb().items():
            self.peak[key] = max(self.peak[key], value)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.every_s)

    def __enter__(self) -> "PeakResident":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
