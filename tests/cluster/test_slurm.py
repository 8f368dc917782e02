"""The Slurm launcher path, run against stand-ins for ``sbatch``, ``srun`` and ``scancel``.

There is no Slurm here, so three small shell scripts play it on this machine: ``sbatch`` runs the
batch script in the background as a new process group (the job id), ``srun`` starts
``$SLURM_NTASKS`` copies of its command, ``scancel`` signals the group. Everything above them (the
batch script ipyparallel writes, job submission and cancellation, engines registering from inside
a job) is the real code path.
"""

import os
import stat

import pytest
import torch.distributed as dist

from nbscaler.cluster import Cluster
from nbscaler.cluster.watchdog import cluster_processes

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

FAKE_SLURM = {
    "sbatch": """#!/bin/bash
ntasks=$(sed -n 's/^#SBATCH --ntasks=\\([0-9]*\\).*/\\1/p' "$1")
SLURM_NTASKS=${ntasks:-1} setsid bash "$1" </dev/null >/dev/null 2>&1 &
echo "Submitted batch job $!"
""",
    "srun": """#!/bin/bash
for ((task = 0; task < SLURM_NTASKS; task++)); do SLURM_PROCID=$task "$@" & done
wait
""",
    "scancel": """#!/bin/bash
if [ "$1" = -s ]; then kill -"$2" -- -"$3"; else kill -TERM -- -"$1"; fi
""",
}


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    for name, script in FAKE_SLURM.items():
        path = tmp_path / name
        path.write_text(script)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def test_slurm_engines_form_the_group(fake_slurm):
    with Cluster(n=2, engines="slurm", timeout=20, name="slurm",
                 launcher_options={"timelimit": "0:10:00"}) as cl:
        script = open(os.path.join(cl.profile_dir, "slurm_engine.sbatch")).read()
        assert "#SBATCH --ntasks=2" in script and "#SBATCH --time=0:10:00" in script
        assert cl.run(lambda: (dist.get_rank(), dist.get_world_size())) == [(0, 2), (1, 2)]
        cluster_id = cl.cluster_id
    assert cluster_processes(cluster_id) == []
