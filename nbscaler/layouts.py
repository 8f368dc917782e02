"""The vocabulary of layouts and of the collectives that change them, defined once.

After partitioning, each device of a group holds some piece of every tensor. The words:

- **replicated** (``R``): every device holds the whole tensor;
- **split on a dim** (``S(d)``): device ``i`` holds slice ``i`` along dim ``d``;
- **partial sum** (``P``): the tensor is the *sum* of what the devices hold (a split reduction axis);
- **sum-gradient** (``R*``): replicated in the forward, but each device computes only part of the
  gradient, so the backward sums it over the group (Megatron's *f* operator). A tensor that carries
  no gradient asks for plain ``R`` instead;
- **first-only** (``V``): the value counts on the first device only, the others hold zeros (the bias
  of a row-parallel linear, which would otherwise be added ``n`` times).

``COLLECTIVES`` says, for each collective the generated code calls, what it costs: the bytes each
device sends forward and backward (ring algorithms, as a fraction of the whole tensor of ``T``
bytes over ``n`` devices), the collective its backward runs, and the primitive the cost model prices
it as. ``comm/`` turns layout changes into these names, ``runtime.collectives`` implements each as
a function of the same name, and ``cost/`` prices them; a new collective is one row here.

``EMULATED`` says which primitive a backend does not run as itself, and what it runs instead:
the runtime (its calls), the traffic table (its bytes), the cost models (their times) and
generated code (its comments) all ask ``runs``, so a new backend fact is one row here.

The rule that picks a host's backend (``choose_backend``, ``host_backend``; ``runtime.backend``
explains it) is here too, so the runtime that runs it and the cost model that prices it ask one rule.

This module imports nothing of nbscaler but ``columns`` (for ``StrEnum``), so every layer may import it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from nbscaler.columns import StrEnum


class _Word(StrEnum):
    """A word of the vocabulary: compares, hashes and prints as its value."""

    def __repr__(self) -> str:
        return repr(self.value)


class LayoutKind(_Word):
    """How a tensor is laid out over the devices of a group (see the module docstring)."""

    REPLICATED = "R"
    SPLIT = "S"
    PARTIAL = "P"
    SUM_GRAD = "R*"
    FIRST_ONLY = "V"


class Collective(_Word):
    """A function of ``nbscaler.runtime.collectives`` (and ``SEND_RECV``, a pipeline crossing)."""

    ALL_GATHER = "all_gather"
    ALL_GATHER_SUM_GRAD = "all_gather_sum_grad"
    CHUNK = "chunk"
    ALL_REDUCE = "all_reduce"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    SUM_GRAD = "sum_grad"
    FIRST_ONLY = "first_only"
    RING_PASS = "ring_pass"
    EXPERT_EXCHANGE = "expert_exchange"
    EXPERT_COUNTS = "expert_counts"
    TOKEN_COUNT = "token_count"
    SEND_RECV = "send_recv"


class ContextKind(_Word):
    """How a context-parallel attention reads the keys and values of the other devices
    (``pas_config['context_parallel_kind']``; ``nbscaler.runtime.context``)."""

    ALL_GATHER = "all_gather"     # gathered whole before attention (Llama 3)
    RING = "ring"                 # passed round the devices while the block in hand computes


EXPERT_SPLIT = "experts"
"""What ``nbscaler.ir.expert_rules.expert_splits`` gives an expert-parallel op: its tokens split by
batch, its experts over the same devices (``nbscaler.glossary.split_name`` names it)."""


Share = Callable[[int], float]          # n devices -> bytes each sends, as a fraction of the tensor
_NONE: Share = lambda n: 0.0
_RING: Share = lambda n: (n - 1) / n
_TWICE: Share = lambda n: 2 * (n - 1) / n
_SQUARE: Share = lambda n: (n - 1) / n ** 2


@dataclass(frozen=True)
class CollectiveSpec:
    """What one collective does to the bytes, forward and backward.

    ``priced_as`` is the primitive the cost model times the forward as (``None``: local, free);
    the backward is ``backward`` priced on a local input of ``backward_input(nbytes, n)`` bytes,
    where ``nbytes`` is the forward's local input."""

    forward_share: Share
    backward: Optional[Collective] = None
    backward_share: Share = _NONE
    priced_as: Optional[Collective] = None
    backward_input: Callable[[int, int], int] = lambda nbytes, n: nbytes
    inside: Optional[str] = None      # the runtime function that runs it within its own call, if not comm.<name>


C = Collective
COLLECTIVES: Dict[Collective, CollectiveSpec] = {
    C.ALL_GATHER: CollectiveSpec(_RING, priced_as=C.ALL_GATHER),
    C.ALL_GATHER_SUM_GRAD: CollectiveSpec(_RING, C.REDUCE_SCATTER, _RING, priced_as=C.ALL_GATHER,
                                          backward_input=lambda nbytes, n: nbytes * n),
    C.CHUNK: CollectiveSpec(_NONE, C.ALL_GATHER, _RING, backward_input=lambda nbytes, n: nbytes // n),
    C.ALL_REDUCE: CollectiveSpec(_TWICE, priced_as=C.ALL_REDUCE),
    C.REDUCE_SCATTER: CollectiveSpec(_RING, C.ALL_GATHER, _RING, priced_as=C.REDUCE_SCATTER,
                                     backward_input=lambda nbytes, n: nbytes // n),
    C.ALL_TO_ALL: CollectiveSpec(_SQUARE, C.ALL_TO_ALL, _SQUARE, priced_as=C.ALL_TO_ALL),
    C.SUM_GRAD: CollectiveSpec(_NONE, C.ALL_REDUCE, _TWICE),
    C.FIRST_ONLY: CollectiveSpec(_NONE),
    # context parallelism's ring: each device passes its block on n-1 times (an all-gather's bytes,
    # point to point); the backward passes the blocks again and their gradients n times, home
    C.RING_PASS: CollectiveSpec(_RING, C.RING_PASS, lambda n: (2 * n - 1) / n, priced_as=C.ALL_GATHER,
                                backward_input=lambda nbytes, n: -(-(2 * n - 1) * nbytes // (n - 1)),
                                inside="nbscaler.runtime.context.context_attention"),
    # expert parallelism: a device's rows to their experts' devices, or back (one of the two an op
    # runs), an all-to-all of the rows' bytes (``T`` here) sending (n-1)/n of them; the backward
    # sends their gradients the other way
    C.EXPERT_EXCHANGE: CollectiveSpec(_RING, C.EXPERT_EXCHANGE, _RING, priced_as=C.ALL_TO_ALL,      # and _capacity
                                      inside="nbscaler.runtime.experts.expert_parallel_dropless"),
    # dropless routing first tells each device how many rows of each expert it will get: an
    # all-to-all of the per-expert counts (``T``: E int64), forward only
    C.EXPERT_COUNTS: CollectiveSpec(_RING, priced_as=C.ALL_TO_ALL,
                                    inside="nbscaler.runtime.experts.expert_parallel_dropless"),
    # a mean loss split along its tokens divides by the whole group's count of counted tokens: an
    # all-reduce of one int64, forward only
    C.TOKEN_COUNT: CollectiveSpec(_TWICE, priced_as=C.ALL_REDUCE, inside="nbscaler.runtime.losses.split_cross_entropy"),
}
"""Every layout-changing collective, the ring a context-parallel attention runs inside its call
(``RING_PASS``, priced as the all-gather whose bytes it moves; ``cost.context_calls`` says how
much of it the attention's compute hides), and the exchange an expert-parallel op runs inside its
call (``EXPERT_EXCHANGE``: the rows out, or back, priced as the all-to-all it is), and the token
count a split loss all-reduces inside its call (``TOKEN_COUNT``). ``SEND_RECV`` is not here: it moves the whole tensor ``T``
to the next stage and its gradient back, priced by the cost model's point-to-point time."""
del C


class Backend(StrEnum):
    """A ``torch.distributed`` backend the runtime runs on (``runtime.backend`` chooses one)."""

    NCCL = "nccl"
    GLOO = "gloo"


#: Bytes each device sends per byte of its local input, for each primitive, with ring algorithms.
WIRE_SHARE: Dict[Collective, Share] = {
    Collective.ALL_GATHER: lambda n: n - 1,
    Collective.ALL_REDUCE: lambda n: 2 * (n - 1) / n,
    Collective.REDUCE_SCATTER: _RING,
    Collective.ALL_TO_ALL: _RING,
}


@dataclass(frozen=True)
class Emulation:
    """How a backend runs a primitive it has no algorithm of its own for: ``runs`` crosses the
    links instead, on the same local input, and each device keeps its slice of the result.
    ``in_backend``: the backend's own call does this (the runtime still calls it); else the
    runtime calls ``runs`` itself."""

    runs: Collective
    in_backend: bool
    why: str


EMULATED: Dict[Tuple[Backend, Collective], Emulation] = {
    (Backend.GLOO, Collective.REDUCE_SCATTER): Emulation(
        Collective.ALL_REDUCE, in_backend=True,
        why="torch's gloo runs reduce_scatter_tensor as an all-reduce of the whole input, then keeps its slice"),
}
"""Every (backend, primitive) that does not run as itself; a pair not here runs as named. In torch
2.13 nccl runs all four primitives natively; gloo runs all-gather and all-to-all natively (the
latter for contiguous tensors only, which the runtime gives it) and reduce-scatter as above."""


def emulation(backend: Optional[str], primitive: Optional[Collective]) -> Optional[Emulation]:
    """How ``backend`` emulates ``primitive`` (``None``: it runs it as itself, or the backend is
    unknown or not given, which means the ideal collective)."""
    try:
        return EMULATED.get((Backend(backend), primitive)) if backend is not None else None
    except ValueError:
        return None


def runs(backend: Optional[str], primitive: Optional[Collective]) -> Optional[Collective]:
    """The primitive whose bytes cross the links when ``backend`` runs ``primitive``."""
    found = emulation(backend, primitive)
    return primitive if found is None else found.runs


def wire_factor(backend: Optional[str], primitive: Optional[Collective], n: int) -> float:
    """How many times the ideal ``primitive``'s bytes over ``n`` devices ``backend`` sends."""
    ran = runs(backend, primitive)
    if ran == primitive or n <= 1:
        return 1.0
    return WIRE_SHARE[ran](n) / WIRE_SHARE[primitive](n)


def emulations(primitive: Optional[Collective]) -> List[Tuple[Backend, Emulation]]:
    """Every backend that emulates ``primitive``, with how (for comments in generated code)."""
    return [(backend, e) for (backend, p), e in EMULATED.items() if p == primitive]


# -- which backend a host's ranks run (``runtime.backend`` says why) ----------------------------
#: The environment variable that chooses the backend, overriding the rule.
BACKEND_ENV = "NBSCALER_BACKEND"


@dataclass(frozen=True)
class BackendChoice:
    """A backend, the GPUs its ranks share out (0: they compute on the CPU), and the line to show
    the user ('' for none)."""

    backend: Backend
    gpus: int
    note: str = ""

    @property
    def on_gpu(self) -> bool:
        return self.gpus > 0

    def device(self, local_rank: int) -> torch.device:
        """The device of the rank that is ``local_rank`` on its host."""
        return torch.device("cuda", local_rank % self.gpus) if self.on_gpu else torch.device("cpu")


def choose_backend(device_count: int, local_world_size: int, requested: Optional[str] = None) -> BackendChoice:
    """The backend for ``local_world_size`` ranks on a host with ``device_count`` GPUs.

    ``requested`` ('nccl', 'gloo', or None/'' for the rule in the module docstring) is what the
    user asked for. Raises ``ValueError`` for an unknown backend, or nccl without a GPU.
    """
    if local_world_size < 1:
        raise ValueError(f"local_world_size must be at least 1, got {local_world_size}")
    enough = 0 < local_world_size <= device_count
    if requested:
        try:
            backend = Backend(requested.lower())
        except ValueError:
            raise ValueError(f"backend {requested!r} (from the argument or {BACKEND_ENV}) is not one of "
                             f"{', '.join(repr(b.value) for b in Backend)}") from None
        if backend is Backend.NCCL and device_count == 0:
            raise ValueError(f"nccl needs GPUs, and this host shows none: use gloo ({BACKEND_ENV}=gloo), or "
                             "check that CUDA and its driver are installed where the ranks run.")
        return BackendChoice(backend, device_count if backend is Backend.NCCL else 0)
    if enough:
        return BackendChoice(Backend.NCCL, device_count)
    if device_count == 0:
        return BackendChoice(Backend.GLOO, 0)
    return BackendChoice(Backend.GLOO, 0, note=(
        f"nbscaler: {local_world_size} ranks on this host share {device_count} GPU(s), and nccl needs one per "
        f"rank, so they run gloo on the CPU; start at most {device_count} ranks per host for nccl (or set "
        f"{BACKEND_ENV}=nccl if each rank has a GPU of its own), or {BACKEND_ENV}=gloo to choose gloo yourself."))


def host_backend(local_world_size: int, requested: Optional[str] = None) -> BackendChoice:
    """``choose_backend`` for this host's GPUs, with ``requested`` defaulting to ``NBSCALER_BACKEND``."""
    return choose_backend(torch.cuda.device_count(), local_world_size, requested or os.environ.get(BACKEND_ENV))
