"""The rank side of parallelize / train / infer: plain functions that run on every rank.

Each function here is what one rank does; ``RemoteModule`` (in ``remote.py``) calls it on every
engine of a cluster. Nothing here needs a cluster: under ``torchrun`` or
``nbscaler.runtime.launch.spawn`` the same functions give the same numbers, which is how the
cluster's results are checked.

A rank keeps its parallel modules by name in ``modules``, together with their optimizer and how
many steps they have trained, so a notebook can train a few steps, look at the curves, and go on.

What a training step does, with ``batch = data(step, unit)`` (``unit = rank // plan_ngpus``: ranks of
one unit must see the same batch):

- an end2end module (``ComputeConfig(use_end2end=True)``): ``batch`` is a list of micro-batches
  and ``module.train_step(batch)`` runs them; the step's loss is the sum of their losses;
- any other module: ``batch`` is a dict of forward arguments (or a tuple of positional ones, or a
  single argument); the loss is the module's output, or ``loss_fn(output, batch)``.

Then gradients are summed across units (``optimizer.sync_shard_grad``), ``after_backward`` may look
at them, and the optimizer steps. An optimizer built with a loss scaler (``scaler=LossScaler(...)``
among the optimizer's keywords, for fp16) scales each loss before its backward, and skips the steps
whose gradients overflowed; each step's row says the scale it used and whether it was skipped. A
pipelined module also reports the blocks of its schedule as it ran them, ``(rank, stage, micro,
phase, t_start, t_end)`` per block.

The first step of each call runs under ``MemoryMeter``, which counts its memory in the cost
model's categories (parameters, gradients, optimizer state, buffers, activations saved for the
backward, their sum ``peak_bytes``), the columns ``plan.summary()`` predicts. Its saved-tensor
hooks cost Python time, which that one step's time then includes.
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from nbscaler.cluster.engine import report
from nbscaler.config import ComputeConfig
from nbscaler.cost.calibration import calibrate_ranks
from nbscaler.parallel import build_optimizer, parallelize
from nbscaler.runtime.memory import MemoryMeter
from nbscaler.runtime.module import ParallelModule

DataFn = Callable[[int, int], Any]
LossFn = Callable[[Any, Any], torch.Tensor]
AfterBackward = Callable[[ParallelModule, torch.optim.Optimizer, int], Any]


@dataclass
class RankModule:
    """A parallel module on this rank, with what training has built up around it."""

    module: ParallelModule
    optimizer: Optional[torch.optim.Optimizer] = None
    steps_done: int = 0
    # The default process group the module's collectives were built on. A cluster rebuilds the
    # group after a failure; a module built on the old one cannot run any more.
    world: Optional[dist.ProcessGroup] = field(default_factory=lambda: dist.group.WORLD)

    @property
    def unit(self) -> int:
        return self.module.compute_config.unit_of(dist.get_rank())


modules: Dict[str, RankModule] = {}
_calibrated = False          # whether this engine's cluster has calibrated its time model yet


def parallelize_here(name: str, module: Any, dummy_forward_args: Dict[str, Any], pas_policy: Any,
                     compute_config: ComputeConfig, parallelize_kwargs: Dict[str, Any]) -> None:
    """``parallelize`` on this rank (rank 0 compiles, the others load) and keep it as ``name``.

    The first time a cluster parallelizes, it also calibrates the time model: its collectives and
    the speed its ranks compute at side by side (a second or so, cached on disk), so later plans
    predict this cluster's step times as the machine is now, not as it was when some earlier
    cluster ran.
    """
    global _calibrated
    calibrate_ranks(force=not _calibrated)
    _calibrated = True
    modules[name] = RankModule(parallelize(module, dummy_forward_args, pas_policy, compute_config,
                                           load_module=True, **parallelize_kwargs))


def train_here(name: str, data: DataFn, steps: int, optimizer_fn: Optional[Callable[..., torch.optim.Optimizer]],
               optimizer_kwargs: Dict[str, Any], loss_fn: Optional[LossFn],
               after_backward: Optional[AfterBackward]) -> Dict[str, Any]:
    """Train ``steps`` steps; returns this rank's telemetry rows and ``after_backward`` values."""
    held = held_module(name)
    if optimizer_fn is not None:
        held.optimizer = build_optimizer(held.module, optimizer_fn, **optimizer_kwargs)
    if held.optimizer is None:
        raise ValueError(f"module {name!r} has no optimizer yet: pass optimizer_fn (e.g. torch.optim.AdamW) "
                         "to its first train(); later calls keep that optimizer unless given a new one.")
    module, optimizer = held.module, held.optimizer
    module.train()
    rows: List[Dict[str, Any]] = []
    blocks: List[Dict[str, Any]] = []
    probes: List[Any] = []
    memory: Dict[str, Any] = {}
    for done in range(steps):
        step = held.steps_done
        t_start = time.time()
        scaler = getattr(optimizer, "scaler", None)         # set by build_optimizer(..., scaler=)
        scale, skipped_before = (scaler.value, scaler.skipped) if scaler is not None else (float("nan"), 0)
        compiled_before = module.compile_seconds
        with MemoryMeter(module, optimizer) if done == 0 else contextlib.nullcontext() as meter:
            loss = _forward_backward(module, data(step, held.unit), loss_fn,
                                     scaler.scale if scaler is not None else None)
            if module.compute_config.use_pipeline:
                blocks += _pipeline_blocks(module, step)
            optimizer.sync_shard_grad()
            if after_backward is not None:
                probes.append(after_backward(module, optimizer, step))
            optimizer.step()
        if meter is not None:
            memory = meter.stats()             # before zero_grad, while the gradients are held
        optimizer.zero_grad()
        t_end = time.time()
        rows.append({"rank": dist.get_rank(), "unit": held.unit, "step": step, "loss": loss,
                     "t_start": t_start, "t_end": t_end, "step_time": t_end - t_start, "loss_scale": scale,
                     "skipped": scaler is not None and scaler.skipped > skipped_before,
                     "compile_s": float("nan") if compiled_before is None else module.compile_seconds - compiled_before})
        held.steps_done += 1
        report(done=done + 1, loss=loss)
    return {"steps": rows, "schedule": blocks, "memory": _memory_row(module, memory), "probes": probes}


@torch.no_grad()
def infer_here(name: str, batch: Any) -> Any:
    """Forward ``batch`` (or ``batch(unit)`` when it is callable) in eval mode; returns the output."""
    held = held_module(name)
    module = held.module
    module.eval()
    if callable(batch):
        batch = batch(held.unit)
    if module.compute_config.use_end2end:
        return module.infer_step(batch)
    return _call(module, batch)


def held_module(name: str) -> RankModule:
    """The parallel module ``name`` of this rank, or a KeyError that says how to get one."""
    if name not in modules:
        known = ", ".join(repr(n) for n in modules) or "none"
        raise KeyError(f"no parallel module {name!r} on rank {dist.get_rank()} (known: {known}); "
                       "parallelize it on this cluster first (engines restarted since lose their modules).")
    held = modules[name]
    if held.world is not dist.group.WORLD:
        raise RuntimeError(f"parallel module {name!r} was built on a process group that has been replaced since "
                           "(an earlier call failed or was interrupted, and the group was rebuilt): its state "
                           "may be half a step old. Parallelize it again to go on.")
    return held


def _call(module: torch.nn.Module, batch: Any) -> Any:
    if isinstance(batch, dict):
        return module(**batch)
    if isinstance(batch, tuple):
        return module(*batch)
    return module(batch)


def _forward_backward(module: ParallelModule, batch: Any, loss_fn: Optional[LossFn],
                      scale_fn: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> float:
    """One step's forward and backward (of each loss times the loss scale, with ``scale_fn``);
    returns the loss, unscaled."""
    if module.compute_config.use_end2end:
        outputs = module.train_step(batch if isinstance(batch, list) else [batch], scale_fn=scale_fn)
        return float(sum(_loss_of(out) for out in outputs))
    output = _call(module, batch)
    loss = loss_fn(output, batch) if loss_fn is not None else output
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
        raise TypeError("training needs a scalar loss: the module returned "
                        f"{type(loss).__name__}; pass loss_fn=lambda output, batch: ... to compute one.")
    (scale_fn(loss) if scale_fn is not None else loss).backward()
    return loss.item()


def _pipeline_blocks(module: ParallelModule, step: int) -> List[Dict[str, Any]]:
    """The blocks the step just ran, timed on the wall clock like the steps (the executor uses
    ``perf_counter``, whose origin differs between processes)."""
    to_wall_clock = time.time() - time.perf_counter()
    return [{**event, "step": step, "t_start": event["t_start"] + to_wall_clock,
             "t_end": event["t_end"] + to_wall_clock} for event in module.pipeline_events]


def _loss_of(output: Any) -> float:
    loss = output[0] if isinstance(output, (tuple, list)) else output
    return float(loss)


def _memory_row(module: ParallelModule, metered: Dict[str, Any]) -> Dict[str, Any]:
    """Memory of this rank: the metered step's categories (``MemoryMeter.stats``), and the
    process's peaks."""
    # ru_maxrss is in kilobytes on Linux, in bytes on macOS.
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    device = module.device
    return {
        "rank": dist.get_rank(),
        "device": str(device),
        **{k: v for k, v in metered.items() if k != "rank"},
        "peak_rss_bytes": peak_rss,
        "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }
