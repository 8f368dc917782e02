"""How each kind of engine launch is set up: local processes, ``mpiexec``, or a Slurm job.

nbscaler does not start processes itself; ipyparallel's launcher classes do. This module only
chooses the options those launchers get, so that the engines come up isolated, with sane thread
counts, and without the usual first-run stumbles (``mpiexec`` refusing to run as root, or refusing
more ranks than cores on a laptop). Options the user passes always win over these defaults.
"""

from __future__ import annotations

import os
from typing import Any, Dict

from nbscaler.config import threads_per_rank

# Let Open MPI start more ranks than cores (a notebook on a laptop) and run as root (containers).
# Other MPI implementations ignore these variables.
OPEN_MPI_ENV = {"OMPI_MCA_rmaps_base_oversubscribe": "1"}
OPEN_MPI_ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


def launcher_options(engines: str, n: int, profile_dir: str, user_options: Dict[str, Any]) -> Dict[str, Any]:
    """Keyword arguments for the ipyparallel engine launcher of kind ``engines``.

    ``environment`` is merged (user keys win); every other user option replaces the default.
    """
    environment: Dict[str, str] = {}
    options: Dict[str, Any] = {}
    if engines in ("local", "mpi"):
        # Engines on this host: set the OpenMP pool size before torch is even imported there.
        threads = threads_per_rank(os.cpu_count() or 1, n)
        environment.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if engines == "mpi":
        environment.update(OPEN_MPI_ENV)
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            environment.update(OPEN_MPI_ROOT_ENV)
    if engines == "slurm":
        # The batch script goes into the cluster's own folder, not the notebook's working directory.
        options["batch_file_name"] = os.path.join(profile_dir, "slurm_engine.sbatch")
    user_options = dict(user_options)
    environment.update(user_options.pop("environment", {}))
    options.update(user_options)
    options["environment"] = environment
    return options
