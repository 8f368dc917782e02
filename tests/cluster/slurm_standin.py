"""Stand-ins for ``sbatch``, ``srun`` and ``scancel``, for machines where Slurm cannot run.

They keep the Slurm launcher path exercised where no real Slurm can be started (not installed, or
not root): ``sbatch`` runs the batch script in the background as a new process group whose id is
the job id, ``srun`` starts ``$SLURM_NTASKS`` copies of its command, ``scancel`` signals the group.
Everything above them (the batch script ipyparallel writes, submission and cancellation, engines
registering from inside a job) is the real code path. Job states and ``squeue`` are not played.
"""

from __future__ import annotations

import stat
from pathlib import Path

SCRIPTS = {
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


class StandInSlurm:
    """The three scripts in ``folder``; put ``folder`` first on ``PATH`` to use them."""

    real = False
    version = "stand-in scripts (no real Slurm)"

    def __init__(self, folder: Path):
        self.folder = folder
        for name, script in SCRIPTS.items():
            path = folder / name
            path.write_text(script)
            path.chmod(path.stat().st_mode | stat.S_IXUSR)
