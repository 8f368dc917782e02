"""One two-engine cluster for the whole cluster suite: starting engines takes seconds.

Tests that break the cluster on purpose must leave it working again (``restart()``), so that the
tests after them do not depend on the order they run in.
"""

import os
from pathlib import Path

import pytest
from IPython.core.interactiveshell import InteractiveShell

from nbscaler.cluster import Cluster
from tests.cluster import slurm_host
from tests.cluster.slurm_standin import StandInSlurm

REPO = str(Path(__file__).resolve().parents[2])
# Engines are separate processes: they must import this checkout of nbscaler, installed or not.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)

TIMEOUT_S = 20


@pytest.fixture(scope="session")
def shell():
    """An IPython shell, as in a notebook: clusters started after it activate ``%px``."""
    return InteractiveShell.instance()


@pytest.fixture(scope="session")
def cluster(shell):
    with Cluster(n=2, timeout=TIMEOUT_S, name="tests") as cl:
        yield cl


@pytest.fixture(scope="session")
def cluster4(shell):
    with Cluster(n=4, timeout=TIMEOUT_S, name="tests4") as cl:
        yield cl


@pytest.fixture(scope="session")
def slurm(request, tmp_path_factory):
    """A Slurm to submit engines to: a real one-node Slurm on this host (``slurm_host``).

    Only where Slurm cannot run at all (not installed, or not root) do stand-in scripts take its
    place; an installed Slurm that fails to start fails the tests instead. Which one ran is
    printed in the test output.
    """
    reason = slurm_host.missing_reason()
    with pytest.MonkeyPatch.context() as patch:
        if reason is None:
            host = slurm_host.start()
            for key, value in host.environment().items():
                patch.setenv(key, value)
            what = f"{host.version}, one node ({slurm_host.NODE_CPUS} CPUs), configuration in {host.conf}"
        else:
            host = StandInSlurm(tmp_path_factory.mktemp("slurm-standin"))
            patch.setenv("PATH", f"{host.folder}{os.pathsep}{os.environ['PATH']}")
            what = f"{host.version}: {reason}"
        say(request, f"slurm: {what}")
        try:
            yield host
        finally:
            if host.real:
                jobs = host.command("squeue", "-h", "--states=all", "-o", "%i:%T", check=False).split()
                say(request, f"slurm: jobs seen: {', '.join(sorted(jobs, key=lambda j: int(j.split(':')[0])))}")
                slurm_host.stop(host)


def say(request, line: str) -> None:
    """Write a line to the test output even while output is captured (which fixtures run under)."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"\n{line}")
