"""Local engines forked from one process that imported torch and nbscaler once.

A plain ipyparallel engine is a fresh interpreter, and every one of them would import torch and
nbscaler on its first call: seconds of CPU each, all at once, on a machine whose cores the engines
share. Local engines are started another way:

1. as soon as a cluster starts, before its controller, one *fork server* process starts and
   imports what every engine needs (``ipyparallel``'s engine, torch, nbscaler); this runs while
   the controller starts;
2. ipyparallel's engine launcher, ``ForkedEngineSetLauncher`` here, hands that process the engine
   command line and environment through its stdin, instead of starting ``n`` interpreters;
3. the fork server forks ``n`` children, each of which becomes one ordinary ipyparallel engine
   with everything already imported, then waits for them, passing on the signals it gets. The
   engines run without ipyparallel's nanny (a helper process per engine that relays signals);
   the cluster signals them by pid, as they run on its host.

The children die with the fork server (``PR_SET_PDEATHSIG`` on Linux), so stopping it, as
ipyparallel's launcher does, stops them all. Fork is used only on Linux; elsewhere local engines
are plain ipyparallel engines.

The engine side is ``main``, run in the fork server's own process (``SERVER_COMMAND``).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
from typing import Any, Dict, List

from ipyparallel.cluster.launcher import LocalEngineLauncher

CAN_FORK = sys.platform.startswith("linux")
# Run by import rather than ``-m``: the package imports this module itself, before ``-m`` would run it.
SERVER_COMMAND = [sys.executable, "-c", "from nbscaler.cluster.forkserver import main; main()"]

# cluster id -> its fork server, started before the controller and picked up by the launcher.
_warm: Dict[str, subprocess.Popen] = {}


def start(cluster_id: str, environment: Dict[str, str], output_file: str) -> subprocess.Popen:
    """Start the fork server of ``cluster_id``; the launcher of that cluster will use it."""
    env = {**os.environ, **environment, "IPP_CLUSTER_ID": cluster_id}
    os.makedirs(os.path.dirname(output_file), exist_ok=True)
    with open(output_file, "ab") as out:
        server = subprocess.Popen(SERVER_COMMAND, stdin=subprocess.PIPE, stdout=out,
                                  stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server.output_file = output_file
    _warm[cluster_id] = server
    return server


def discard(cluster_id: str) -> None:
    """End the fork server of ``cluster_id`` if no launcher took it (the start failed early)."""
    server = _warm.pop(cluster_id, None)
    if server is not None:
        server.kill()
        server.wait()


class ForkedEngineSetLauncher(LocalEngineLauncher):
    """ipyparallel engine launcher for ``n`` local engines forked from the cluster's fork server."""

    def start(self, n: int) -> Any:
        self.n = n
        server = _warm.pop(self.cluster_id, None)
        if server is None:  # a second engine set of the same cluster: a fork server of its own
            server = start(self.cluster_id, dict(self.environment), self.output_file)
            _warm.pop(self.cluster_id)
        # No nanny: it would be one more fresh interpreter per engine, and the cluster signals local
        # engines by their pid.
        argv = self.cluster_args + self.engine_args + ["--IPEngine.enable_nanny=False"]
        command = {"n": n, "argv": argv, "env": self.get_env()}
        server.stdin.write(json.dumps(command).encode() + b"\n")
        server.stdin.close()
        self.output_file = server.output_file
        self._popen_process = server
        self.pid = server.pid
        import psutil

        self.process = psutil.Process(server.pid)
        self.notify_start(server.pid)
        self._start_waiting()
        return [server.pid]

    def find_args(self) -> List[str]:
        return SERVER_COMMAND


def _die_with_parent() -> None:
    """Ask Linux to kill this process when its parent (the fork server) exits."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _engine(argv: List[str]) -> None:
    """In a forked child: become one ipyparallel engine."""
    from ipyparallel.engine.app import IPEngine

    _die_with_parent()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    sys.argv = ["ipengine", *argv]
    code = 0
    try:
        IPEngine.launch_instance(argv)
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def main() -> None:
    """The fork server: import, wait for the engine command, fork the engines, wait for them."""
    import ipyparallel.engine.app  # noqa: F401  (what every engine runs)

    import nbscaler.cluster.engine  # noqa: F401  (torch, and the engine side of the cluster)
    import nbscaler.cluster.training  # noqa: F401  (the rest of nbscaler that ranks run)

    line = sys.stdin.buffer.readline()
    if not line:  # the notebook went away before the engines were wanted
        return
    command = json.loads(line)
    os.environ.update(command["env"])
    sys.stdout.flush()
    sys.stderr.flush()
    children = []
    for _ in range(command["n"]):
        pid = os.fork()
        if pid == 0:
            _engine(command["argv"])
        children.append(pid)

    def pass_on(signum: int, _frame: Any) -> None:
        for child in children:
            try:
                os.kill(child, signum)
            except ProcessLookupError:
                pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, pass_on)
    codes = []
    for child in children:
        while True:
            try:
                _, status = os.waitpid(child, 0)
                break
            except InterruptedError:
                continue
        codes.append(os.waitstatus_to_exitcode(status))
    sys.exit(next((c for c in codes if c), 0))

