"""The optimizers a target prices, and how to declare another: one table, ``OPTIMIZER_TENSORS``.

On a target an optimizer step is timed as memory-bound passes over the tensors it reads and writes
per parameter element (``cost.roofline``): the parameter and its gradient read, the parameter
written, and each tensor of state it keeps per element read and written again. That table knows
SGD (no state; one momentum buffer with ``momentum``), Adam and AdamW (two moments). Any other
optimizer is refused there, by name, rather than timed as an Adam it may not be
(``step_tensors``); ``register_optimizer`` declares it by the state tensors it keeps.

On this machine nothing is assumed: the step is timed by running the optimizer (``cost.profile``),
and everywhere its state's bytes are learnt by stepping it on tiny tensors (``cost.memory``).

>>> class Lion(torch.optim.Optimizer): ...                      # doctest: +SKIP
>>> register_optimizer(Lion, state_tensors=1)                   # doctest: +SKIP
"""

from __future__ import annotations

from typing import Any, Mapping

#: Tensors an optimizer step reads and writes per parameter element, the gradient included:
#: SGD reads p and g and writes p; with momentum it also reads and writes its buffer; Adam reads p,
#: g and its two moments and writes p and the moments.
OPTIMIZER_TENSORS = {"SGD": 3, "SGD+momentum": 5, "Adam": 7, "AdamW": 7}

#: Tensors a step without state reads and writes per element: the parameter and gradient read, the
#: parameter written (``OPTIMIZER_TENSORS['SGD']``).
STATELESS_TENSORS = 3


def register_optimizer(optimizer: type, state_tensors: int) -> None:
    """Declare ``optimizer`` (a class) to the target's time model: it keeps ``state_tensors``
    tensors of state per parameter, each as large as the parameter (Adam: 2, its moments; SGD with
    momentum: 1), which its step reads and writes. Known by its class name, as the table keys are."""
    if not isinstance(optimizer, type):
        raise TypeError(f"register_optimizer takes the optimizer's class, got {optimizer!r}")
    if not isinstance(state_tensors, int) or state_tensors < 0:
        raise ValueError(f"state_tensors={state_tensors!r}: give the number of tensors of state the optimizer "
                         "keeps per parameter, each as large as it (0 or more)")
    OPTIMIZER_TENSORS[optimizer.__name__] = STATELESS_TENSORS + 2 * state_tensors


def step_tensors(optimizer: type, kwargs: Mapping[str, Any]) -> int:
    """Tensors one step of ``optimizer`` (with ``kwargs``) reads and writes per parameter element;
    an optimizer the table does not know is refused, saying how to declare it."""
    name = getattr(optimizer, "__name__", repr(optimizer))
    if name == "SGD" and kwargs.get("momentum"):
        name = "SGD+momentum"
    if name not in OPTIMIZER_TENSORS:
        known = ", ".join(sorted(OPTIMIZER_TENSORS))
        raise ValueError(
            f"{name} is not an optimizer the target's time model knows ({known}): it times a step by the "
            f"tensors of state the optimizer keeps per parameter, and would have to guess them. Declare it "
            f"with nbscaler.register_optimizer({name}, state_tensors=k), k being the tensors of state it "
            f"keeps per parameter, each as large as the parameter (Adam: 2, SGD with momentum: 1), "
            "or price the plan with one it knows.")
    return OPTIMIZER_TENSORS[name]
