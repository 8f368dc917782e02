"""Calibrating the time model where the ranks run: what their collectives cost and how fast they
compute side by side. The cluster does it when it first parallelizes; the benchmarks before each
measurement. One function, so both calibrate the same things."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch.distributed as dist

from nbscaler.cost import comm_model, speed
from nbscaler.cost.comm_model import CommModel


@dataclass(frozen=True)
class Calibration:
    """What the ranks measured at one moment: the collectives' models by group size (those this
    call calibrated), and the reference workload's seconds on ``device_key`` with ``nranks`` ranks
    all busy (``cost.speed``)."""
    comm: Dict[int, CommModel]
    reference_s: Optional[float]
    device_key: str
    nranks: int


def calibrate_ranks(force: bool = False) -> Calibration:
    """Calibrate on every rank (each calls it) and cache the results for later plans.

    Collectives: each group size not calibrated yet, or all of them with ``force``
    (``comm_model.ensure_calibrated``). Speed: with ``force`` as rank 0 passes it (else None).
    """
    comm = comm_model.ensure_calibrated(force=force)
    timed = [force]
    dist.broadcast_object_list(timed, src=0)          # rank 0 decides, so every rank joins or none
    reference = speed.calibrate() if timed[0] else None
    return Calibration(comm, reference, speed.device_key(speed.rank_device()), dist.get_world_size())
