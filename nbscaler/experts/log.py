"""How routing loaded the experts: a log of the (token, expert) pairs each routed-experts call sent
to each expert, kept while a ``RoutingLog`` is open.

The memory and time a plan predicts for dropless routing assume every expert gets as many pairs;
the log shows how far a real routing is from that (``imbalance``: the most pairs an expert got over
the mean), and under capacity routing how many pairs each expert dropped. ``next_step()`` between
training steps numbers the calls' steps; ``nbscaler.widgets.RoutingView(log, plan)`` draws the log
per step, by expert and by the rank that holds each expert.

>>> with RoutingLog() as log:                    # doctest: +SKIP
...     for batch in batches:
...         model(**batch).backward()
...         log.next_step()
>>> log.frame().groupby("expert").routed.sum()   # doctest: +SKIP
>>> RoutingView(log, plan)                       # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Dict, Iterator, List, Optional

import torch

_OPEN: List["RoutingLog"] = []
_DROPS_REPORTED = [False]       # the first drop of this process is reported; later ones are left to a log
_UNREAL = [0]                   # inside ``unreal_inputs``: calls on made-up inputs, whose drops mean nothing


class CapacityOverflowWarning(UserWarning):
    """Capacity routing dropped (token, expert) pairs: an expert got more pairs of a sequence than
    its capacity, and those pairs add nothing to their tokens."""


class RoutingLog:
    """Pairs per expert of every routed-experts call made on this process while open (a context
    manager; logs nest). A call is one op of one forward, numbered in the order they ran, in the
    training step ``next_step`` says (0 until it is called)."""

    def __init__(self) -> None:
        self.rows: List[Dict[str, Any]] = []
        self.calls = 0
        self.step = 0

    def next_step(self) -> None:
        """The calls from now on belong to the next training step."""
        self.step += 1

    def __enter__(self) -> "RoutingLog":
        _OPEN.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _OPEN.remove(self)

    def add(self, routed: torch.Tensor, served: Optional[torch.Tensor]) -> None:
        """One call: ``routed[e]`` pairs sent to expert ``e``, ``served[e]`` of them kept (``None``: all)."""
        routed = routed.tolist()
        served = routed if served is None else served.tolist()
        self.rows += [{"step": self.step, "call": self.calls, "expert": e, "routed": r, "served": s,
                       "dropped": r - s} for e, (r, s) in enumerate(zip(routed, served))]
        self.calls += 1

    def frame(self):
        """One row per call and expert: ``step``, ``call``, ``expert``, ``routed``, ``served``, ``dropped`` pairs."""
        import pandas as pd
        return pd.DataFrame(self.rows, columns=["step", "call", "expert", "routed", "served", "dropped"])

    def imbalance(self):
        """Per call: the most pairs an expert was routed over the mean (1.0: perfectly balanced)."""
        per_call = self.frame().groupby("call").routed
        return (per_call.max() / per_call.mean()).rename("imbalance")


def record(routed: torch.Tensor, served: Optional[torch.Tensor] = None) -> None:
    """Add a call's pairs per expert to every open log (nothing when none is open, or for the shapes
    alone: tracing and the cost model call the ops on fake tensors). The first call of a process
    that drops pairs is reported, log or not (``CapacityOverflowWarning``); until then each capacity
    call reads whether it dropped any (one device sync), after it none does. Inside a
    ``torch.compile`` region nothing is read: open a ``RoutingLog`` around eager steps to count drops."""
    if _shapes_only(routed):
        return
    if served is not None and not _DROPS_REPORTED[0] and not _UNREAL[0] and not torch.compiler.is_compiling():
        if bool((served != routed).any()):
            _DROPS_REPORTED[0] = True
            dropped = int((routed - served).sum())
            warnings.warn(f"capacity routing dropped {dropped} of {int(routed.sum())} (token, expert) pairs in one "
                          "call: an expert got more pairs of a sequence than its capacity, and those pairs add "
                          "nothing to their tokens. Later drops are not reported again; count them per expert and "
                          "step with nbscaler.experts.RoutingLog. To drop fewer, raise MoEConfig.capacity_factor, "
                          "or route dropless (capacity_factor=None).", CapacityOverflowWarning, stacklevel=3)
    if not _OPEN:
        return
    routed = routed.detach().cpu()
    served = served.detach().cpu() if served is not None else None
    for log in _OPEN:
        log.add(routed, served)


@contextlib.contextmanager
def unreal_inputs() -> Iterator[None]:
    """Calls inside run on made-up inputs (the cost model timing an op on random tensors): what
    they drop is not reported."""
    _UNREAL[0] += 1
    try:
        yield
    finally:
        _UNREAL[0] -= 1


def _shapes_only(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake
    return t.is_meta or is_fake(t)
