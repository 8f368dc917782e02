"""One two-engine cluster for the whole cluster suite: starting engines takes seconds.

Tests that break the cluster on purpose must leave it working again (``restart()``), so that the
tests after them do not depend on the order they run in.
"""

import os
from pathlib import Path

import pytest
from IPython.core.interactiveshell import InteractiveShell

from nbscaler.cluster import Cluster

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
