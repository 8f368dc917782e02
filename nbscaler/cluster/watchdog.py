"""A cluster's watchdog: ends the cluster's processes when the notebook that owns them is gone.

``Cluster.stop()`` and the kernel's exit hook end the controller and the engines in the ordinary
case. They cannot when the notebook process is killed (``kill -9``, an out-of-memory kill, a kernel
restart that does not wait for the exit hooks). The watchdog covers those cases:

- the notebook starts it with a pipe on its stdin and keeps the other end open;
- it runs in a session of its own, so a signal to the notebook's process group does not reach it;
- when the pipe reaches end-of-file without the word ``stop`` having come through it, the notebook
  has died: the watchdog cancels the engines' batch job if they run as one (the notebook sends the
  scheduler's cancel command, ``scancel 12`` say, through the pipe once the job is submitted), ends
  every process whose environment carries the cluster's ``IPP_CLUSTER_ID`` (controller, engines,
  their nannies) and removes the temporary profile folder.

It is run as a script by its path, not as a module of the package, so that it starts in a tenth of
a second without importing torch; it needs only psutil.

    python watchdog.py CLUSTER_ID [PROFILE_DIR_TO_REMOVE]
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from typing import List, Optional

import psutil

STOP = "stop"
CANCEL = "cancel "
CANCEL_TIMEOUT_S = 30


def cluster_processes(cluster_id: str) -> List[psutil.Process]:
    """The processes of a cluster on this host: controller, engines and their helpers.

    ipyparallel hands every process it launches ``IPP_CLUSTER_ID`` in its environment, and the
    processes nbscaler starts for a cluster get it too.
    """
    found = []
    for process in psutil.process_iter(["environ"]):
        if process.pid != os.getpid() and (process.info["environ"] or {}).get("IPP_CLUSTER_ID") == cluster_id:
            found.append(process)
    return found


def reap(processes: List[psutil.Process], wait_s: float = 5.0) -> None:
    """Terminate ``processes``, wait for them, and kill those still there after ``wait_s``."""
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=wait_s)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=wait_s)


def start(cluster_id: str, profile_dir: Optional[str]) -> subprocess.Popen:
    """Start the watchdog of ``cluster_id`` (the caller keeps ``.stdin`` open while the cluster runs)."""
    env = {k: v for k, v in os.environ.items() if k != "IPP_CLUSTER_ID"}
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), cluster_id, profile_dir or ""],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env,
                            start_new_session=True, text=True)


def watch_job(watchdog: subprocess.Popen, cancel_command: List[str]) -> None:
    """Tell the watchdog how to cancel the engines' batch job should the notebook die."""
    with contextlib.suppress(BrokenPipeError, OSError, ValueError):
        watchdog.stdin.write(CANCEL + json.dumps(cancel_command) + "\n")
        watchdog.stdin.flush()


def dismiss(watchdog: subprocess.Popen) -> None:
    """Tell the watchdog that the cluster was stopped on purpose, and let it exit."""
    with contextlib.suppress(BrokenPipeError, OSError, ValueError):
        watchdog.stdin.write(STOP + "\n")
        watchdog.stdin.close()
    try:
        watchdog.wait(timeout=5)
    except subprocess.TimeoutExpired:
        watchdog.kill()
        watchdog.wait()


def main(cluster_id: str, profile_dir: str) -> None:
    """Wait for the notebook's word or its death; on its death, end the cluster."""
    told = sys.stdin.read().splitlines()  # returns at end-of-file: the notebook closed the pipe, or died
    if STOP in told:
        return
    for line in told:
        if line.startswith(CANCEL):
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                subprocess.run(json.loads(line[len(CANCEL):]), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, timeout=CANCEL_TIMEOUT_S)
    reap(cluster_processes(cluster_id))
    if profile_dir:
        shutil.rmtree(profile_dir, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
