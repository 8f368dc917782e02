"""A writer killed half-way through an atomic write leaves the old file whole and a hidden
temporary, which the next write of that file removes."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nbscaler.genfiles import GenDir, atomic_write_bytes, remove_stale_temporaries

pytestmark = pytest.mark.slow     # seconds: each test starts a process that imports torch

WRITE_AND_DIE = """
import os, signal, sys
from pathlib import Path
from nbscaler.genfiles import GenDir, atomic_write
path = Path(sys.argv[1])
def half_then_die(f):
    f.write(b"new" * 1000)
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[2] == "file":
    atomic_write(path, half_then_die)
else:
    GenDir(path).replace_with(lambda tmp: (tmp.joinpath("config.json").write_text("{}"), half_then_die(open(os.devnull, "wb"))))
"""


def killed_writer(path: Path, kind: str) -> None:
    done = subprocess.run([sys.executable, "-c", WRITE_AND_DIE, str(path), kind])
    assert done.returncode == -signal.SIGKILL


def test_a_killed_file_write_leaves_the_old_file_and_the_next_write_removes_its_temporary(tmp_path):
    path = tmp_path / "ckpt.pt"
    atomic_write_bytes(path, b"old")
    killed_writer(path, "file")
    assert path.read_bytes() == b"old"
    left = [p for p in os.listdir(tmp_path) if p != "ckpt.pt"]
    assert len(left) == 1 and left[0].startswith(".ckpt.pt.")
    atomic_write_bytes(path, b"newer")
    assert os.listdir(tmp_path) == ["ckpt.pt"] and path.read_bytes() == b"newer"


def test_a_killed_folder_write_leaves_the_old_folder_and_the_next_write_removes_its_temporary(tmp_path):
    path = tmp_path / "module"
    GenDir(path).replace_with(lambda tmp: tmp.joinpath("config.json").write_text('{"old": 1}'))
    killed_writer(path, "folder")
    assert GenDir(path).read_config() == {"old": 1}
    assert len(os.listdir(tmp_path)) == 2
    remove_stale_temporaries(path)
    assert os.listdir(tmp_path) == ["module"]


def test_a_live_writers_temporary_stays(tmp_path):
    path = tmp_path / "ckpt.pt"
    mine = tmp_path / f".ckpt.pt.{os.uname().nodename}-{os.getpid()}.abc"
    mine.write_bytes(b"in progress")
    remove_stale_temporaries(path)
    assert mine.exists()


WRITE_PAST_THE_LIMIT = """
import resource, signal, sys, torch
from nbscaler.runtime import checkpoint
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # a write past the limit then fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.RLIM_INFINITY))
try:
    checkpoint.save({"w": torch.ones(1 << 18)}, sys.argv[1])
except OSError as err:
    print(err)
"""


def test_a_write_that_finds_no_room_names_the_file_and_keeps_the_old_one(tmp_path):
    path = tmp_path / "ckpt.pt"
    atomic_write_bytes(path, b"old")
    done = subprocess.run([sys.executable, "-c", WRITE_PAST_THE_LIMIT, str(path)], capture_output=True, text=True)
    assert f"File too large: writing {path} failed" in done.stdout, done.stdout + done.stderr
    assert "free some space or write elsewhere" in done.stdout
    assert os.listdir(tmp_path) == ["ckpt.pt"] and path.read_bytes() == b"old"
