"""Faults of the disk: one that fills during a checkpoint save or a write of generated files (a
small tmpfs), and checkpoints damaged on it (one flipped byte, a truncated file)."""

from __future__ import annotations

import contextlib
import resource
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from nbscaler.runtime import checkpoint
from tests.faults.staging import (TP, Row, error_of, first_line, hidden_leftovers, module_dir, names_rank, usable,
                                  visible_files, whole_gen_dir)
from tests.multiprocess import parallelize_on

DISK_BYTES = 8 << 20
SMALL_FLOATS = 1 << 18                 # 1 MiB a checkpoint: two fit on the small disk
LARGE_FLOATS = 3 << 20                 # 12 MiB a checkpoint: neither fits
DAMAGED_RANK = 1


class SmallDisk:
    """A ``DISK_BYTES`` tmpfs mounted at ``path``, or, where mounting is not permitted, the same
    limit as the ranks' file size limit (``RLIMIT_FSIZE``), which ``how`` then says."""

    def __init__(self, path: Path):
        self.path = path
        self.how = f"a {DISK_BYTES >> 20} MiB tmpfs"
        self.limit: Optional[int] = None

    def __enter__(self) -> "SmallDisk":
        self.path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(self.path)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            self.how = f"RLIMIT_FSIZE of {DISK_BYTES >> 20} MiB (mount refused: {done.stderr.strip()[:80]})"
            self.limit = DISK_BYTES
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.limit is None:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


@contextlib.contextmanager
def file_size_limit(limit: Optional[int]) -> Iterator[None]:
    """On a rank: writes past ``limit`` bytes fail with EFBIG (instead of a SIGXFSZ death)."""
    if limit is None:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def save_state(folder: str, version: int, numel: int, limit: Optional[int] = None) -> None:
    """On every rank: save ``{'version', 'w'}`` as ``ckpt.<rank>.pt`` in ``folder``."""
    with file_size_limit(limit):
        checkpoint.save({"version": version, "w": torch.full((numel,), float(version))},
                        Path(folder) / f"ckpt.{dist.get_rank()}.pt")


def load_state(folder: str) -> int:
    """On every rank: load its checkpoint; returns the version."""
    return checkpoint.load(Path(folder) / f"ckpt.{dist.get_rank()}.pt")["version"]


def holds(path: Path, version: int, numel: int) -> bool:
    try:
        state = checkpoint.load(path)
    except Exception:            # a damaged file is the finding
        return False
    return state["version"] == version and state["w"].numel() == numel and bool((state["w"] == version).all())


def disk_full_in_checkpoint_save(cluster: Any, folder: Path) -> Row:
    """Both ranks save 1 MiB checkpoints on an 8 MiB disk, then 12 MiB ones over them."""
    disk = folder / "disk"
    with SmallDisk(disk) as small:
        cluster.run(save_state, str(disk), 0, SMALL_FLOATS, small.limit)
        start = time.monotonic()
        err, ended = error_of(lambda: cluster.run(save_state, str(disk), 1, LARGE_FLOATS, small.limit))
        rank = getattr(err, "rank", -1)
        intact = (visible_files(disk) == ["ckpt.0.pt", "ckpt.1.pt"] and not hidden_leftovers(disk)
                  and all(holds(disk / f"ckpt.{r}.pt", 0, SMALL_FLOATS) for r in range(2)))
    works, why = usable(cluster, folder)
    cause = any(text in str(err) for text in ("No space left", "File too large")) and "ckpt." in str(err)
    return Row("disk full in a checkpoint save", ended - start, first_line(err), names_rank(err, rank), cause,
               intact, works, why or f"on {small.how}; the previous checkpoints load")


def disk_full_in_generated_files(cluster: Any, folder: Path) -> Row:
    """Compile onto a small disk, fill it, then compile the module again over its folder."""
    gen = folder / "gen"
    with SmallDisk(gen) as small:
        if small.limit is not None:
            return Row("disk full in a write of generated files", None, "not staged", False, False, False, False,
                       small.how)
        parallelize_on(cluster, TP, str(gen))
        path = module_dir(gen)
        before = GenFiles(path)
        filler = gen / "filler"
        with open(filler, "wb") as f:
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * (1 << 16))
        start = time.monotonic()
        err, ended = error_of(lambda: parallelize_on(cluster, TP, str(gen)))
        after, left = GenFiles(path), hidden_leftovers(path.parent)
        intact = after == before and not left and whole_gen_dir(path, TP.runtime_ngpus)
        filler.unlink()
    changed = sorted(set(before) ^ set(after) | {k for k in before if before[k] != after.get(k)})
    trouble = f"changed: {changed}, left: {left}" if not intact else ""
    works, why = usable(cluster, folder)
    cause = "No space left" in str(err) and str(path) in str(err)
    return Row("disk full in a write of generated files", ended - start, first_line(err), names_rank(err, 0),
               cause, intact, works, why or trouble or f"on {small.how}; the previous folder stays whole")


class GenFiles(dict):
    """The files of a generated folder and their bytes, to compare before and after a fault."""

    def __init__(self, path: Path):
        super().__init__({p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()})


def damaged_checkpoint(cluster: Any, folder: Path, damage: str) -> Row:
    """Rank 1's checkpoint gets one flipped byte in its tensor (``'flip'``) or loses its second
    half (``'truncate'``); then every rank loads its own."""
    ckpt = folder / "ckpt"
    cluster.run(save_state, str(ckpt), 0, SMALL_FLOATS)
    path = ckpt / f"ckpt.{DAMAGED_RANK}.pt"
    data = bytearray(path.read_bytes())
    if damage == "flip":
        with open(path, "rb") as f:
            at = torch._C.PyTorchFileReader(f).get_record_offset("data/0") + 1000
        data[at] ^= 0x01
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(bytes(data[: len(data) // 2]))
    start = time.monotonic()
    err, ended = error_of(lambda: cluster.run(load_state, str(ckpt)))
    intact = holds(ckpt / "ckpt.0.pt", 0, SMALL_FLOATS)     # the rest is untouched
    works, why = usable(cluster, folder)
    what = "a checkpoint with one flipped byte" if damage == "flip" else "a truncated checkpoint"
    cause = "damaged or incomplete" in str(err) and str(path) in str(err)
    return Row(what, ended - start, first_line(err), names_rank(err, DAMAGED_RANK),
               cause, intact, works, why or "refused on load; the other ranks' files load")
