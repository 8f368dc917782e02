"""Where a traced value comes from, and whether the tracer computes it for real or only its shape.

The tracer needs shapes and dtypes, not numbers, for almost everything a forward computes. So it
runs every call that reads a parameter on *fake* tensors (``torch._subclasses.FakeTensorMode``):
the call returns a tensor with the right shape, dtype and strides, and no arithmetic happens. A
12-layer GPT traces in a fraction of a second instead of running its matmuls.

Calls that read no parameter run for real, because they are cheap and their values may matter to
Python control flow: ``torch.arange(x.shape[1])``, ``(position_ids[:, -1] == 0).all()``, masks
built from the ``attention_mask`` argument. Each value carries a ``Provenance``:

- ``static``: made from shapes and constants only; the same on every call, so reading it into a
  Python value (``if (ids == -1).any():``) is safe and costs nothing at run time;
- ``data``: reads the input data or a buffer; a Python value read from it holds for this input
  only, so the tracer specialises on it and the generated code checks it on every call (a guard);
- ``weights``: reads a parameter, or any tensor on the meta device; fake during a fake trace, so its
  value is unknown. Reading one into Python makes the tracer start again with real tensors
  (``NeedsRealValues``), which a module on the meta device cannot do (``meta_refusal``).

>>> values = TracedValues(fake=True)                       # doctest: +SKIP
>>> values.origin(torch.arange(4))                         # an unknown tensor: a constant
<Provenance.STATIC: 'static'>
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode,
                                          UnsupportedOperatorException)
from torch.utils._pytree import tree_flatten, tree_unflatten

from nbscaler.experts.grouped import FAKE_STAND_INS


class Provenance(StrEnum):
    """What a traced value depends on, from least to most (a call's result takes its arguments' most)."""

    STATIC = "static"       # shapes and constants
    DATA = "data"           # the input data or the module's buffers
    WEIGHTS = "weights"     # the module's parameters

    @property
    def rank(self) -> int:
        return _RANK[self]


_ORDER = [Provenance.STATIC, Provenance.DATA, Provenance.WEIGHTS]
_RANK = {p: i for i, p in enumerate(_ORDER)}


class NeedsRealValues(Exception):
    """A fake trace met a value it cannot know (a parameter-dependent value read into Python, or an
    op without a fake implementation); the trace must run again on real tensors."""


class TracedValues:
    """Provenance of every tensor the trace has seen, and the fake/real choice for each call."""

    def __init__(self, fake: bool, meta_device: torch.device = torch.device("cpu")):
        self.fake_mode: Optional[FakeTensorMode] = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
        self.meta_device = meta_device     # where a meta tensor's stand-in pretends to live (the inputs' device)
        self.provenance: Dict[int, Provenance] = {}
        self.alias: Dict[int, torch.Tensor] = {}     # id(real) -> its fake stand-in, once a call has read it
        self.keep_alive: List[Any] = []

    def mark(self, t: torch.Tensor, provenance: Provenance) -> None:
        self.provenance[id(t)] = provenance
        self.keep_alive.append(t)

    def origin(self, t: torch.Tensor) -> Provenance:
        """A tensor's provenance; one the trace never made is a constant captured by forward."""
        return self.provenance.get(id(t), Provenance.STATIC)

    def origin_of_call(self, args: Any, kwargs: Any) -> Provenance:
        return self._origin_of_leaves(tree_flatten((args, kwargs))[0])

    def _origin_of_leaves(self, leaves: List[Any]) -> Provenance:
        ranks = [_RANK[self.origin(x)] for x in leaves if isinstance(x, torch.Tensor)]
        return _ORDER[max(ranks, default=0)]

    def is_fake(self, t: torch.Tensor) -> bool:
        """Whether ``t`` stands for a value this trace does not compute."""
        return self.fake_mode is not None and (self.origin(t) is Provenance.WEIGHTS or self.fake_mode.is_our_fake(t))

    def run(self, func: Callable, args: Tuple, kwargs: Dict, on_new_fake: Callable[[torch.Tensor, torch.Tensor], None]
            ) -> Tuple[Any, Tuple, Dict, Provenance]:
        """Call ``func`` for real or on fake tensors; returns ``(out, call_args, call_kwargs, provenance)``.

        ``call_args`` are the arguments the call actually received (fake stand-ins for real tensors
        under a fake call), so that ``out is call_args[0]`` tells an in-place call. ``on_new_fake(real,
        fake)`` is told of every stand-in made, so the tracer can find it by identity.
        """
        leaves, spec = tree_flatten((tuple(args), dict(kwargs)))
        provenance = self._origin_of_leaves(leaves)
        if self.fake_mode is None or provenance is not Provenance.WEIGHTS:
            return func(*args, **kwargs), args, kwargs, provenance

        def stand_in(x):
            if not isinstance(x, torch.Tensor) or self.fake_mode.is_our_fake(x):
                return x
            fake = self.alias.get(id(x))
            if fake is None:
                fake = self._fake_of(x)
                self.alias[id(x)] = fake
                self.mark(fake, self.origin(x))
                on_new_fake(x, fake)
            return fake

        call_args, call_kwargs = tree_unflatten([stand_in(x) for x in leaves], spec)
        try:
            with self.fake_mode:
                out = FAKE_STAND_INS.get(func, func)(*call_args, **call_kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as err:
            raise NeedsRealValues(f"{getattr(func, '__name__', func)} needs the values of its inputs "
                                  f"({type(err).__name__}: {err})") from err
        except (UnsupportedOperatorException, NotImplementedError) as err:
            raise NeedsRealValues(f"{getattr(func, '__name__', func)} has no shape-only implementation "
                                  f"({type(err).__name__}: {err})") from err
        return out, call_args, call_kwargs, provenance

    def _fake_of(self, x: torch.Tensor) -> torch.Tensor:
        """A stand-in for ``x``. A meta tensor's pretends to live on the inputs' device, so that a
        module built on meta computes with the inputs and the tensors forward makes as a real one does."""
        if x.is_meta:
            return self.fake_mode.fake_tensor_converter.from_meta_and_device(self.fake_mode, x, self.meta_device)
        return self.fake_mode.from_tensor(x)

    def demote(self, real: torch.Tensor, fake: torch.Tensor) -> None:
        """A fake call wrote into the real tensor ``real``: from now on only its stand-in is valid."""
        self.alias[id(real)] = fake
        self.mark(real, Provenance.WEIGHTS)
