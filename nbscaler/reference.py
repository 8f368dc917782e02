"""The reference run: the same training in one process, which every parallel run must reproduce.

A parallel run cuts a step's data by unit (unit ``u`` trains on its own batches) and by micro-batch,
and sums gradients over both (see the design notes). One process reproduces that by running every
unit's micro-batches through one copy of the model, summing all their losses, and calling backward
once: the gradient of the sum is the sum of the gradients. The demo, the Explorer and the tests all
check their runs against :func:`reference_run`, within :data:`MATCH_RTOL`.

>>> import torch
>>> torch.manual_seed(0)                                         # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> model = torch.nn.Linear(4, 1)
>>> def batches(step, unit):                                     # two micro-batches per unit
...     g = torch.Generator().manual_seed(100 * step + unit)
...     return [torch.randn(3, 4, generator=g) for _ in range(2)]
>>> run = reference_run(model, torch.optim.SGD(model.parameters(), lr=0.1), batches, steps=2, units=2,
...                     loss_of=lambda m, x: m(x).pow(2).mean(), keep_grads=True)
>>> len(run.losses), len(run.losses[0]), len(run.losses[0][0])   # steps, units, micro-batches
(2, 2, 2)
>>> run.unit_losses()[0][1] == sum(run.losses[0][1])
True
>>> sorted(run.grads[0])
['bias', 'weight']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Union

import torch

MATCH_RTOL = 1e-5
"""Relative error under which a parallel run's losses and gradients count as equal to the reference
run's (fp32): the project's correctness oracle."""

Batches = Callable[[int, int], Sequence[Any]]
"""``batches(step, unit)``: the micro-batches unit ``unit`` trains on at step ``step``."""
LossOf = Callable[[torch.nn.Module, Any], torch.Tensor]
"""``loss_of(model, micro_batch)``: the loss of one micro-batch."""


def call_model(model: torch.nn.Module, micro_batch: Any) -> torch.Tensor:
    """The loss of an end-to-end module: ``model(micro_batch)``."""
    return model(micro_batch)


def call_with_kwargs(model: torch.nn.Module, micro_batch: Dict[str, Any]) -> torch.Tensor:
    """The loss of a module whose forward takes the micro-batch's entries as keywords and returns the loss."""
    return model(**micro_batch)


@dataclass
class ReferenceRun:
    """What :func:`reference_run` recorded.

    Attributes:
        losses: ``losses[step][unit][micro]``, each micro-batch's loss.
        grads: with ``keep_grads``, ``grads[step]``: every parameter's summed gradient, by name,
            before clipping.
        norms: with ``clip``, ``norms[step]``: the total gradient norm before clipping.
    """

    losses: List[List[List[float]]] = field(default_factory=list)
    grads: List[Dict[str, torch.Tensor]] = field(default_factory=list)
    norms: List[float] = field(default_factory=list)

    def unit_losses(self) -> List[List[float]]:
        """``[step][unit]``: each unit's loss summed over its micro-batches (what a pipelined
        ``train_step`` reports as the step's loss)."""
        return [[sum(unit) for unit in step] for step in self.losses]


def reference_run(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: Batches, *,
                  steps: Union[int, Iterable[int]], units: int = 1, loss_of: LossOf = call_model,
                  clip: Optional[float] = None, keep_grads: bool = False) -> ReferenceRun:
    """Train ``model`` in this process as a parallel run of ``units`` data-parallel units would.

    Each step sums the losses of every unit's micro-batches (``batches(step, unit)``), runs one
    backward, optionally clips the gradients' total norm to ``clip``, and takes an ``optimizer``
    step. ``steps`` is a count, or the step numbers to run (a run resumed at step ``k`` passes
    ``range(k, k + n)``, so it gets the same batches as the parallel run). ``model`` is trained in
    place; copy it first to keep the original.
    """
    steps = range(steps) if isinstance(steps, int) else steps
    run = ReferenceRun()
    for step in steps:
        per_unit = [[loss_of(model, micro) for micro in batches(step, unit)] for unit in range(units)]
        sum(loss for unit in per_unit for loss in unit).backward()
        run.losses.append([[loss.item() for loss in unit] for unit in per_unit])
        if keep_grads:
            run.grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        if clip is not None:
            run.norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        optimizer.step()
        optimizer.zero_grad()
    return run
