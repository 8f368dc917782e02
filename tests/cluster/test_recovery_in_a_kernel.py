"""The recovery paths in a real Jupyter kernel, driven by nbclient as a notebook would be.

The notebook makes the three mistakes a user makes (a typo in a function run on the ranks, a rank
that never joins a collective, and the stop button pressed mid-training), each in a cell expected
to fail, and after each one compiles and trains a ``tp`` and a ``pp`` module on the same cluster and
checks them against one process. The stop button is a SIGINT to the kernel process, sent when a
rank says that training is under way.
"""

import os
import signal

import nbformat
import pytest
from nbclient import NotebookClient

from tests.multiprocess import RankSignal

pytestmark = [pytest.mark.cluster, pytest.mark.notebook, pytest.mark.timeout(600)]

SETUP = """
import time, torch, torch.distributed as dist
from nbscaler.cluster import Cluster, RankError
from tests.multiprocess import Case, RankSignal, case_batch, check_on_cluster, parallelize_on, pipeline

TP, PP = Case("mlp", "tp", 2, 2), Case("gpt", "pp", 2, 2, config=pipeline("1f1b", 2, 4))
cl = Cluster(n=2, timeout=15, name="kernel-recovery")

def check_tp_and_pp():
    check_on_cluster(cl, TP, GEN_DIR + "/tp")
    check_on_cluster(cl, PP, GEN_DIR + "/pp")

pm = parallelize_on(cl, TP, GEN_DIR + "/before")
pm.train(lambda step, unit: case_batch(TP, step, unit), 1, torch.optim.SGD, lr=0.1, progress=False);
"""

TYPO = "cl.run(lambda: dist.get_rnak())"

STALL = """
def rank_1_stalls(step, unit):
    while dist.get_rank() == 1:
        time.sleep(0.05)
    return case_batch(TP, step, unit)

pm = parallelize_on(cl, TP, GEN_DIR + "/stall")
pm.train(rank_1_stalls, 3, torch.optim.SGD, lr=0.1, progress=False)
"""

INTERRUPTED = """
def slow_batches(step, unit):
    if step == 2 and dist.get_rank() == 0:
        STARTED.fire()
    time.sleep(0.2)
    return case_batch(TP, step, unit)

pm = parallelize_on(cl, TP, GEN_DIR + "/interrupted")
pm.train(slow_batches, 1000, torch.optim.SGD, lr=0.1, progress=False)
"""


def code(source, fails=False):
    cell = nbformat.v4.new_code_cell(source)
    if fails:
        cell.metadata["tags"] = ["raises-exception"]
    return cell


def test_a_notebook_recovers_from_every_mistake(tmp_path):
    started = RankSignal()
    notebook = nbformat.v4.new_notebook(cells=[
        code(f"GEN_DIR = {str(tmp_path)!r}\n" + SETUP + f"STARTED = RankSignal({started.path!r})\n"),
        code(TYPO, fails=True), code("check_tp_and_pp()"),
        code(STALL, fails=True), code("check_tp_and_pp()"),
        code(INTERRUPTED, fails=True), code("check_tp_and_pp()"),
        code("cl.stop()"),
    ])
    client = NotebookClient(notebook, timeout=500, kernel_name="python3",
                            resources={"metadata": {"path": os.getcwd()}})
    # What the stop button does to a local kernel: SIGINT to its process.
    started.then(lambda: os.kill(client.km.provisioner.pid, signal.SIGINT))
    try:
        client.execute()
    finally:
        started.close()
    errors = [next(o for o in cell.outputs if o.output_type == "error") for cell in notebook.cells
              if "raises-exception" in cell.metadata.get("tags", [])]
    assert [e.ename for e in errors] == ["RankError", "RankError", "KeyboardInterrupt"]
    assert "get_rnak" in errors[0].evalue and "rank 0" in errors[1].evalue
    for cell in notebook.cells:
        if "raises-exception" not in cell.metadata.get("tags", []):
            assert not any(o.output_type == "error" for o in cell.outputs), cell.source
