"""Modules the tracer records as one of nbscaler's ops instead of call by call.

A stand-in computes what the module computes, as an op a policy knows how to split: Hugging Face's
expert modules become ``dropless_experts`` (``nbscaler.experts.huggingface``), so expert
parallelism and tensor-parallel experts apply to them. Each entry of ``STAND_INS`` takes a module
and returns the forward to record in its place, or ``None`` to leave it alone.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional, Tuple

import torch.nn as nn

from nbscaler.experts.huggingface import experts_stand_in

StandIn = Callable[[nn.Module], Optional[Callable]]

STAND_INS: Tuple[StandIn, ...] = (experts_stand_in,)


@contextlib.contextmanager
def stand_ins(root: nn.Module) -> Iterator[int]:
    """Within the block, every sub-module of ``root`` a ``STAND_INS`` entry recognises runs its stand-in
    (an instance ``forward``, removed afterwards); yields how many there are."""
    replaced = []
    for module in root.modules():
        for stand_in in STAND_INS:
            forward = stand_in(module)
            if forward is not None:
                had = "forward" in vars(module)
                replaced.append((module, had, vars(module).get("forward")))
                module.forward = forward
                break
    try:
        yield len(replaced)
    finally:
        for module, had, old in replaced:
            if had:
                module.forward = old
            else:
                del module.forward
