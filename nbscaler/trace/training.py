"""Notice whether a forward reads ``self.training``, so a second trace (eval mode) is made only when needed.

A module's behaviour can differ between ``train()`` and ``eval()`` only through its ``training``
flag (Dropout, BatchNorm, ``if self.training:`` in user code, ``F.dropout(x, p, self.training)``).
While ``watch_training_reads`` is active, ``nn.Module.training`` is a property on the class: a data
descriptor wins over the instance attribute, so every read of any module's flag goes through it
and is noted. Writes still land in the instance's ``__dict__``, where the flag always lives.

>>> reads = []                                        # doctest: +SKIP
>>> with watch_training_reads(reads):
...     torch.nn.Dropout()(x)
>>> bool(reads)
True
"""

from __future__ import annotations

import contextlib
from typing import Iterator, List

import torch


@contextlib.contextmanager
def watch_training_reads(reads: List[torch.nn.Module]) -> Iterator[None]:
    """Append every module whose ``training`` flag is read inside the block to ``reads``."""
    Module = torch.nn.Module
    if "training" in Module.__dict__:          # already watched (a nested trace): the outer watch sees it
        yield
        return

    def get(module: torch.nn.Module) -> bool:
        reads.append(module)
        return module.__dict__["training"]

    def put(module: torch.nn.Module, value: bool) -> None:
        module.__dict__["training"] = value

    Module.training = property(get, put)
    try:
        yield
    finally:
        del Module.training
