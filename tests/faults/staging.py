"""What every fault of the campaign shares: how it is triggered, timed, and judged.

A fault is staged on a running cluster: a rank reaches the chosen point (in a forward, in a
collective, in a checkpoint save) and fires a ``RankSignal``; the notebook side injects the fault
at once (a signal to the engine, a byte flipped on disk) and notes the time. The notebook's call
then has to end in an error that names the rank and the cause, within ``DEADLINE_S`` of the fault.
Each staging returns a ``Row`` of the campaign's table; the tests assert on it and the benchmark
(``python -m benchmarks.faults``) writes it out.
"""

from __future__ import annotations

import functools
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.distributed as dist

from nbscaler.genfiles import GenDir
from tests.multiprocess import Case, RankSignal, case_batch, check_on_cluster

DEADLINE_S = 60.0
TP = Case("mlp", "tp", 2, 2)           # the training that must equal one process after each fault


@dataclass
class Row:
    """One fault of the campaign and what came of it."""

    fault: str
    seconds: Optional[float]           # from the fault to the error in the notebook; None: no error is due
    error: str                         # the error's first line, or what happened instead
    rank_named: bool
    cause_named: bool
    intact: bool                       # nothing visible half-written, nothing lost
    usable: bool                       # the cluster trains as one process does afterwards
    note: str = ""

    @property
    def detected(self) -> bool:
        """Whether the fault ended in a clear error in time (or, where none is due, in none)."""
        if self.seconds is None:
            return self.rank_named and self.cause_named
        return self.seconds < DEADLINE_S and self.rank_named and self.cause_named

    @property
    def passed(self) -> bool:
        return self.detected and self.intact and self.usable


class Trigger:
    """A ``RankSignal`` whose action is a fault, and the time the fault was injected."""

    def __init__(self, inject: Callable[[], None]):
        self.signal = RankSignal()
        self.at: Optional[float] = None
        self._inject = inject
        self.signal.then(self._fire)

    def _fire(self) -> None:
        self.at = time.monotonic()
        self._inject()

    def close(self) -> None:
        self.signal.close()


def error_of(call: Callable[[], Any]) -> Tuple[Optional[BaseException], float]:
    """Run ``call``; return the exception it raised (or None) and when it ended."""
    try:
        call()
    except Exception as err:     # every kind of error is a finding of the campaign
        return err, time.monotonic()
    return None, time.monotonic()


def first_line(err: Optional[BaseException]) -> str:
    if err is None:
        return "no error"
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:160]


def names_rank(err: Optional[BaseException], rank: int) -> bool:
    """Whether the error names ``rank`` as the one at fault (its ``.rank`` and its message)."""
    return getattr(err, "rank", None) == rank and re.search(rf"\brank {rank}\b", str(err)) is not None


def usable(cluster: Any, folder: Path) -> Tuple[bool, str]:
    """Restart the cluster if it must be, then train ``TP`` and compare with one process."""
    try:
        if not cluster._healthy() or cluster._session.broken:
            cluster.restart()
        check_on_cluster(cluster, TP, str(folder / "after"))
    except Exception as err:     # reported in the row, not raised: the campaign goes on
        return False, first_line(err)
    return True, ""


def visible_files(folder: Path) -> List[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))


def hidden_leftovers(folder: Path) -> List[str]:
    """Temporary files and folders of interrupted writes (``.name.XXXX``)."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def module_dir(gen: Path) -> Path:
    """The one module folder under ``gen`` (``_parallel_modules/<class>/<instance>``)."""
    found = [p for p in (gen / "_parallel_modules").glob("*/*") if not p.name.startswith(".")]
    return found[0] if len(found) == 1 else gen / "missing"


def whole_gen_dir(path: Path, ranks: int) -> bool:
    """Whether ``path`` holds a complete folder of generated files for ``ranks`` ranks."""
    gen = GenDir(path)
    names = set(gen.files()) if path.is_dir() else set()
    return gen.exists() and {f"gencode{r}.py" for r in range(ranks)} <= names and gen.read_config() is not None


def train_steps(remote: Any, steps: int, **kwargs: Any) -> Any:
    return remote.train(functools.partial(case_batch, TP), steps, progress=False, **kwargs)


# -- what the ranks run -----------------------------------------------------------------------------

def hold_in_forward(module: torch.nn.Module, signal: RankSignal, rank: int) -> None:
    """On ``rank``: the next forward fires ``signal`` and then waits inside the forward."""
    if dist.get_rank() == rank:
        def fire_and_wait(*_: Any) -> None:
            signal.fire()
            time.sleep(600)
        module.register_forward_pre_hook(fire_and_wait)


def all_reduce_forever(signal: RankSignal, rank: int, numel: int = 1 << 18) -> None:
    """Every rank all-reduces without end; ``rank`` fires ``signal`` once the loop runs."""
    t = torch.ones(numel)
    i = 0
    while True:
        dist.all_reduce(t)
        t.fill_(1.0)
        i += 1
        if i == 3 and dist.get_rank() == rank:
            signal.fire()


def total() -> float:
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def check(row: Row) -> None:
    """Assert that ``row`` came out as the campaign demands, with the row in each message."""
    assert row.seconds is not None and row.seconds < DEADLINE_S, row
    assert row.rank_named, row.error
    assert row.cause_named, row.error
    assert row.intact, row
    assert row.usable, row.note
