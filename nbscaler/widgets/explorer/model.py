"""What the Explorer compiles and trains: a module, its dummy forward arguments, and its batches.

Two kinds of model:

- ``shipped_gpt(...)``: the GPT of ``nbscaler.models.gpt`` at a small size, with random token
  batches that differ by step, data-parallel unit and micro-batch (seeded, so a run can be
  repeated and checked against one process);
- ``user_model(module, dummy_args)``: the user's module; every step trains on the dummy arguments.

``ModelSpec.batches(step, unit, nmicros)`` is what the ranks call; it is a ``functools.partial`` of
a module-level function, so it travels to the engines by reference.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from nbscaler.models.gpt import GPT, GPTConfig, sample_batch

LossFn = Callable[[Any, Any], torch.Tensor]


@dataclass
class ModelSpec:
    """A module ready to plan: its forward arguments and how training batches are made.

    ``end2end`` modules take the whole batch as their one forward argument and return the loss;
    they can be pipelined and train on micro-batches. The others are called with the forward
    arguments, and the loss is their output or ``loss_fn(output, batch)``.
    """

    label: str
    module: torch.nn.Module
    dummy_args: Dict[str, Any]
    batches: Callable[[int, int, int], Any] = field(repr=False)
    loss_fn: Optional[LossFn] = field(default=None, repr=False)
    end2end: bool = True

    def data(self, nmicros: int) -> Callable[[int, int], Any]:
        """``data(step, unit)`` for ``RemoteModule.train``: a list of micro-batches for end2end
        modules, the forward arguments otherwise."""
        return functools.partial(_step_batch, self.batches, nmicros if self.end2end else 1, self.end2end)


def _step_batch(batches: Callable[[int, int, int], List[Any]], nmicros: int, end2end: bool, step: int,
                unit: int) -> Any:
    micro_batches = batches(step, unit, nmicros)
    return micro_batches if end2end else micro_batches[0]


def _gpt_batches(cfg: GPTConfig, batch_size: int, step: int, unit: int, nmicros: int) -> List[Dict[str, torch.Tensor]]:
    return [sample_batch(cfg, batch_size, seed=10_000 * step + 100 * unit + m) for m in range(nmicros)]


def _repeated(dummy_args: Dict[str, Any], end2end: bool, step: int, unit: int, nmicros: int) -> List[Any]:
    micro = next(iter(dummy_args.values())) if end2end else dummy_args
    return [micro] * nmicros


def shipped_gpt(n_layer: int = 2, d_model: int = 64, n_head: int = 4, vocab_size: int = 128, seq_len: int = 32,
                batch_size: int = 4, seed: int = 0) -> ModelSpec:
    """The shipped GPT at a size a laptop compiles in a second, with seeded random batches."""
    cfg = GPTConfig(vocab_size=vocab_size, seq_len=seq_len, n_layer=n_layer, d_model=d_model, n_head=n_head)
    torch.manual_seed(seed)
    module = GPT(cfg)
    return ModelSpec(label=f"GPT ({n_layer} layers, d_model {d_model})", module=module,
                     dummy_args={"batch": sample_batch(cfg, batch_size)},
                     batches=functools.partial(_gpt_batches, cfg, batch_size))


def user_model(module: torch.nn.Module, dummy_args: Dict[str, Any], loss_fn: Optional[LossFn] = None) -> ModelSpec:
    """The user's module; training repeats the dummy arguments every step.

    A module with one forward argument and no ``loss_fn`` is end2end (it returns its loss, as the
    shipped GPT does); any other returns its loss, or an output that ``loss_fn`` turns into one.
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(dummy_args, dict) or not dummy_args:
        raise TypeError("dummy_args must be a non-empty dict of forward arguments, e.g. {'x': torch.randn(8, 16)}")
    end2end = loss_fn is None and len(dummy_args) == 1
    return ModelSpec(label=type(module).__name__, module=module, dummy_args=dummy_args,
                     batches=functools.partial(_repeated, dummy_args, end2end), loss_fn=loss_fn, end2end=end2end)
