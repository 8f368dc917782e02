"""What every test session shares: a cost-model cache of its own, a one-node Slurm (``slurm``)
for the tests that start work under it (engines of a cluster, a training script under ``srun``),
the notebook clusters of ``tests/cluster`` and ``tests/faults`` (``cluster``, ``cluster4``),
one intra-op thread, a cycle collector that walks each object once, and the plans of the test
models (``gpt_plan``, ``model_plan``, and the ``plan`` fixture of a module that names one).

Plans time their ops from a profile, and clusters calibrate their collectives, into the cost
model's cache (``nbscaler.cost.cache``). The suite keeps those in a folder of its own, made for the
session and removed after it, so that it neither reads what an earlier run or a user's notebook
left in ``~/.cache/nbscaler`` nor writes there. Set ``NBSCALER_CACHE_DIR`` yourself to keep one
across runs (a faster edit-test loop); it is then left as it is.

The tests' own tensors are small, and on a machine of few cores whose other cores are busy, two
intra-op threads wait for each other at every op: a one-rank Llama's training step took up to
1.7 s at two threads and a millisecond at one. The session runs at one thread, as the demo does.
What the cost model times is not affected: the profiler sets the thread count of the ranks it
prices around each of its measurements (``cost.speed.intra_op_threads``).

The session's process ends up holding over a million objects (imports, and what each module's
plans keep), and every full run of the cycle collector walks all of them: 37 of them cost 18 s of
the fast subset. So what is alive after collection, and after each test module, is collected once
and frozen (``gc.freeze``): later runs walk only what was made since. The collector's thresholds are
(10,000, 20, 10) rather than (700, 10, 10): a plan's trace and pricing make many objects that live
for a test, which each collection of the older generations on the way walks again (7.6 s of
collecting in the fast subset, 5.9 s so).
"""

import gc
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import pytest
import torch

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.models.gpt import GPT, GPTConfig, sample_batch
from tests.cluster import netns_hosts, slurm_host
from tests.cluster.slurm_standin import StandInSlurm
from tests.models import batch as model_batch, build

if "NBSCALER_CACHE_DIR" not in os.environ:
    # Set at import, before any test starts a rank, an engine or a kernel: they inherit it.
    _SESSION_CACHE = tempfile.mkdtemp(prefix="nbscaler-test-cache-")
    os.environ["NBSCALER_CACHE_DIR"] = _SESSION_CACHE
else:
    _SESSION_CACHE = None


torch.set_num_threads(1)


gc.set_threshold(10_000, 20, 10)


# ``make test`` runs two workers (``pytest -n 2 --dist loadgroup``). What starts clusters or shares a
# machine-wide resource runs on one of them, one test at a time: every notebook and cluster test, the
# one-node Slurm, the host tests' network namespaces. Two clusters starting at once on two cores miss
# their engines' registration timeout; the one-process tests on the other worker do not disturb them.
# A module whose tests share a module-scoped fixture (a trained set of checkpoints, a plan) runs on one
# worker too, or each worker would build the fixture again.
ONE_WORKER_PATHS = ("tests/cluster/", "tests/faults/", "tests/runtime/test_init_distributed.py")
ONE_WORKER_MARKS = ("cluster", "notebook")


def _shares_a_module_fixture(item) -> bool:
    return any(defs and defs[-1].scope == "module" for defs in item._fixtureinfo.name2fixturedefs.values())


@pytest.hookimpl(tryfirst=True)      # before xdist's own hook, which reads the group into each test's id
def pytest_collection_modifyitems(config, items):
    root = Path(__file__).resolve().parents[1]
    for item in items:
        path = str(Path(item.path).relative_to(root))
        if path.startswith(ONE_WORKER_PATHS) or any(item.get_closest_marker(m) for m in ONE_WORKER_MARKS):
            item.add_marker(pytest.mark.xdist_group("machine"))
        elif _shares_a_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(path))


def pytest_collection_finish(session):
    gc.collect()
    gc.freeze()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    yield
    if nextitem is None or nextitem.path != item.path:       # its module's fixtures are gone
        gc.collect()
        gc.freeze()


#: The shipped GPT at the smallest sizes the tests plan it at; ``gpt_plan`` changes what it is given.
SMALL_GPT = GPTConfig(vocab_size=64, seq_len=16, n_layer=1, d_model=32, n_head=2)


def gpt_plan(policy, config: ComputeConfig, *, model: GPTConfig = SMALL_GPT, batch: int = 2,
             module_dtype: Optional[torch.dtype] = None, **plan_kwargs) -> "nbscaler.Plan":
    """``nbscaler.plan`` of the shipped GPT of ``model`` on ``sample_batch(model, batch)``."""
    return nbscaler.plan(GPT(model), {"batch": sample_batch(model, batch)}, policy, config,
                         module_dtype=module_dtype, **plan_kwargs)


def model_plan(name: str, policy, config: ComputeConfig, *, seed: int = 0) -> "nbscaler.Plan":
    """``nbscaler.plan`` of the test model ``name`` (``tests.models.build``) on its batch ``seed``."""
    return nbscaler.plan(build(name), model_batch(name, seed), policy, config)


@pytest.fixture(scope="module")
def plan(request):
    """The plan the tests of a module share, each leaving it as it found it: ``model_plan(**PLAN)``
    of the module's ``PLAN`` where it names a test model, else ``gpt_plan(**PLAN)``; once per module."""
    spec = request.module.PLAN
    return model_plan(**spec) if "name" in spec else gpt_plan(**spec)


def pytest_unconfigure(config):
    if _SESSION_CACHE is not None:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


# Cluster engines are separate processes: they must import this checkout of nbscaler, installed
# or not.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[1]),
                                                       os.environ.get("PYTHONPATH")) if p)
CLUSTER_TIMEOUT_S = 20      # the suite's clusters' collective timeout


@pytest.fixture(scope="session")
def shell():
    """An IPython shell, as in a notebook: clusters started after it activate ``%px``."""
    from IPython.core.interactiveshell import InteractiveShell
    return InteractiveShell.instance()


@pytest.fixture(scope="session")
def cluster(shell):
    """One two-engine cluster for the whole session (``tests/cluster``, ``tests/faults``): starting
    engines takes seconds. Tests that break it on purpose leave it working again (``restart()``),
    so that the tests after them do not depend on the order they run in."""
    from nbscaler.cluster import Cluster
    with Cluster(n=2, timeout=CLUSTER_TIMEOUT_S, name="tests") as cl:
        yield cl


@pytest.fixture(scope="session")
def cluster4(shell):
    from nbscaler.cluster import Cluster
    with Cluster(n=4, timeout=CLUSTER_TIMEOUT_S, name="tests4") as cl:
        yield cl


@pytest.fixture(scope="module")
def hosts():
    """Two engine hosts and a controller host, each a network namespace (``tests.cluster.netns_hosts``)."""
    reason = netns_hosts.missing_reason()
    if reason:
        pytest.skip(reason)
    made = netns_hosts.make()
    try:
        yield made
    finally:
        netns_hosts.remove(made)


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
