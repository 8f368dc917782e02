"""Trace a module once per mode of ``self.training``, or once when both modes compute the same."""

from __future__ import annotations

from typing import Any, Dict

import torch

from nbscaler.config import ComputeConfig
from nbscaler.ir.graph import IRGraph
from nbscaler.trace.tracer import check_forward_args, trace_module


def trace_modes(module: torch.nn.Module, dummy_args: Dict[str, Any], cfg: ComputeConfig,
                modes_agree: bool = False) -> Dict[str, IRGraph]:
    """One graph per mode of ``self.training``, or a single ``'any'`` graph when both are the same.

    The eval mode is traced only when the training trace read some module's ``training`` flag;
    even then, two traces that record the same calls make one ``'any'`` graph. ``modes_agree``:
    the caller has seen both modes record the same calls on a model like this one (autodist on a
    target, on the two-layer copy of the same layers), so the eval mode is not traced again.
    """
    check_forward_args(module, dummy_args)
    guards = cfg.guard_data_dependent
    if cfg.inference_only:
        return {"any": trace_module(module, dummy_args, "eval", guards=guards)}
    train = trace_module(module, dummy_args, "train", guards=guards)
    if modes_agree or not train.meta["reads_training"]:
        return {"any": train}
    evaluate = trace_module(module, dummy_args, "eval", guards=guards)
    if train.signature() == evaluate.signature():
        return {"any": train}
    return {"train": train, "eval": evaluate}
