"""Faults of the processes: an engine killed (in a forward, in a collective, in a checkpoint save)
and an engine stopped (``SIGSTOP``: a hang that only the collective timeout can end)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Optional, Tuple

import torch
import torch.distributed as dist

from nbscaler.genfiles import atomic_write
from nbscaler.runtime import checkpoint
from tests.faults.staging import (TP, Row, Trigger, all_reduce_forever, error_of, first_line, hidden_leftovers,
                                  hold_in_forward, module_dir, names_rank, train_steps, usable, visible_files, whole_gen_dir)
from tests.multiprocess import RankSignal, parallelize_on

VICTIM = 1
CHECKPOINT_FLOATS = 4 << 20            # 16 MB a file: a save takes long enough to be killed in


def signal_during(cluster: Any, sig: int, call: Callable[[RankSignal], Any]) -> Tuple[Optional[BaseException], float, int]:
    """Run ``call(signal)``; when a rank fires ``signal``, send ``sig`` to rank ``VICTIM``'s engine.
    Returns the error, the seconds from the signal to the error, and the engine's pid."""
    pid = cluster.engines[VICTIM].pid
    trigger = Trigger(lambda: os.kill(pid, sig))
    try:
        err, ended = error_of(lambda: call(trigger.signal))
    finally:
        trigger.close()
    return err, ended - trigger.at if trigger.at is not None else float("nan"), pid


def died(err: Optional[BaseException], pid: int) -> bool:
    return f"pid {pid}" in str(err) and "died" in str(err)


def kill_in_forward(cluster: Any, folder: Path) -> Row:
    """SIGKILL rank 1 while it is inside its module's forward (a forward pre-hook holds it there)."""
    gen = folder / "gen"
    remote = parallelize_on(cluster, TP, str(gen))
    train_steps(remote, 1, optimizer_fn=torch.optim.SGD, lr=0.1)
    err, seconds, pid = signal_during(cluster, signal.SIGKILL, lambda fired: (remote.run(hold_in_forward, fired, VICTIM),
                                                                            train_steps(remote, 1)))
    works, why = usable(cluster, folder)
    return Row("SIGKILL of an engine in a forward", seconds, first_line(err), names_rank(err, VICTIM), died(err, pid),
               whole_gen_dir(module_dir(gen), TP.runtime_ngpus), works, why)


def kill_in_collective(cluster: Any, folder: Path) -> Row:
    """SIGKILL rank 1 while both ranks all-reduce 1 MB again and again."""
    err, seconds, pid = signal_during(cluster, signal.SIGKILL, lambda fired: cluster.run(all_reduce_forever, fired, VICTIM))
    works, why = usable(cluster, folder)
    return Row("SIGKILL of an engine in a collective", seconds, first_line(err), names_rank(err, VICTIM),
               died(err, pid), True, works, why or "nothing on disk is involved")


def save_versions(folder: str, signal_: RankSignal, rank: int, numel: int) -> int:
    """Every rank saves version 0 of its checkpoint; ``rank`` then saves version 1, and fires
    ``signal_`` half-way through writing it (its bytes written, not yet renamed into place)."""
    me = dist.get_rank()
    path = Path(folder) / f"ckpt.{me}.pt"
    checkpoint.save(_version(0, numel), path)
    if me != rank:
        return 0

    def write_then_wait(f: Any) -> None:
        torch.save(_version(1, numel), f)       # what checkpoint.save writes
        signal_.fire()
        time.sleep(600)

    atomic_write(path, write_then_wait)          # checkpoint.save's own write
    return 1


def _version(version: int, numel: int) -> dict:
    return {"version": version, "w": torch.full((numel,), float(version))}


def whole_version(path: Path) -> int:
    """The version ``path`` holds, complete, as ``save_versions`` wrote it; -1 if it is not whole."""
    try:
        state = checkpoint.load(path)
    except Exception:            # a damaged file is the finding
        return -1
    whole = bool((state["w"] == float(state["version"])).all()) and state["w"].numel() == CHECKPOINT_FLOATS
    return state["version"] if whole else -1


def kill_in_checkpoint_save(cluster: Any, folder: Path) -> Row:
    """SIGKILL rank 1 half-way through saving its checkpoint (16 MB), then save again there."""
    ckpt = folder / "ckpt"
    ckpt.mkdir(parents=True)
    err, seconds, pid = signal_during(cluster, signal.SIGKILL, lambda fired: cluster.run(
        save_versions, str(ckpt), fired, VICTIM, CHECKPOINT_FLOATS))
    files = visible_files(ckpt)
    intact = files == ["ckpt.0.pt", "ckpt.1.pt"] and all(whole_version(ckpt / f) == 0 for f in files)
    left = len(hidden_leftovers(ckpt))
    works, why = usable(cluster, folder)
    if works:                    # the next save of that file removes what the killed one left
        cluster.run(save_versions, str(ckpt), RankSignal(), -1, CHECKPOINT_FLOATS)
        intact = intact and not hidden_leftovers(ckpt)
    note = f"the killed save left {left} hidden temporary file, removed by the next save there"
    return Row("SIGKILL of an engine in a checkpoint save", seconds, first_line(err), names_rank(err, VICTIM),
               died(err, pid), intact, works, why or note)


def stop_in_collective(cluster: Any, folder: Path) -> Row:
    """SIGSTOP rank 1 while both ranks all-reduce: rank 0 waits until the group's timeout."""
    err, seconds, _ = signal_during(cluster, signal.SIGSTOP, lambda fired: cluster.run(all_reduce_forever, fired, VICTIM))
    works, why = usable(cluster, folder)
    return Row("SIGSTOP of an engine in a collective (a hang)", seconds, first_line(err), names_rank(err, VICTIM),
               "is stopped" in str(err), True, works, why or f"collective timeout {cluster.spec.timeout:.0f} s")
