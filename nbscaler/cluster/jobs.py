"""What the batch scheduler says about the job the engines run in.

With a batch launcher (``engines='slurm'``, ``'pbs'``, ...) the engines are one job of the site's
scheduler, and the scheduler may end it behind the notebook's back: ``scancel`` from a terminal, the
job's time limit, a node failure, preemption. The engines then simply vanish. This module turns that
into words for the error the notebook sees: which job it was and, for Slurm, the state the
controller gives it (``CANCELLED``, ``TIMEOUT``, ``NODE_FAIL``, ``PREEMPTED``, ...), so the user knows
to ask for more time or a different partition rather than hunt for a crash.

Only Slurm is asked for the state (``scontrol show job``); for other schedulers the job id alone is
named.
"""

from __future__ import annotations

import re
import subprocess
import time
from typing import Any, Optional

# Enough for one short query of a controller; a slow answer only costs the state in the message.
QUERY_TIMEOUT_S = 10.0
# Slurm shows a job as COMPLETING, hiding why it ended, until its processes are gone; a job whose
# engines have died gets this long to finish completing before the message names it as it is.
COMPLETING_WAIT_S = 15.0
POLL_S = 0.2


def job_id(engine_set: Any) -> Optional[str]:
    """The batch job id of an ipyparallel engine set, or None when it is not a batch job."""
    return getattr(engine_set, "job_id", None) or None


def slurm_job_state(job: str) -> Optional[str]:
    """Slurm's state and reason for ``job``, e.g. ``'CANCELLED'`` or ``'TIMEOUT (TimeLimit)'``.

    None when ``scontrol`` is missing, fails, or no longer knows the job (Slurm forgets finished
    jobs after ``MinJobAge``).
    """
    try:
        done = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True,
                              timeout=QUERY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    state = re.search(r"\bJobState=(\S+)", done.stdout)
    if done.returncode != 0 or state is None:
        return None
    reason = re.search(r"\bReason=(\S+)", done.stdout)
    return state.group(1) + (f" ({reason.group(1)})" if reason and reason.group(1) != "None" else "")


def describe_end(launcher: str, job: Optional[str]) -> str:
    """A sentence on the engines' batch job for an error message; empty when there is none."""
    if job is None:
        return ""
    if "slurm" not in launcher.lower():
        return f"The engines ran as {launcher} job {job}; ask the scheduler why it ended. "
    state = slurm_job_state(job)
    deadline = time.monotonic() + COMPLETING_WAIT_S
    while state is not None and state.startswith("COMPLETING") and time.monotonic() < deadline:
        time.sleep(POLL_S)
        state = slurm_job_state(job)
    if state is None:
        return f"The engines ran as Slurm job {job} (`scontrol show job {job}` says why it ended). "
    if state.startswith(("RUNNING", "COMPLETING", "PENDING")):
        return f"The engines run as Slurm job {job}, which is {state}. "
    return (f"The engines ran as Slurm job {job}, which Slurm ended: {state} (scancel, its time limit, "
            "preemption or a node failure; `scontrol show job` has the details). ")
