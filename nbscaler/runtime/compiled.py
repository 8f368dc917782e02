"""Rank modules run through ``torch.compile`` (``ComputeConfig(compile=True)``).

What a rank computes per micro-batch is one generated method: ``_forward`` (or ``_forward_train``
and ``_forward_eval`` where the module branches on ``self.training``), or under a pipeline one
``_stage{s}`` per stage it holds, with the same suffixes. With ``compile=True`` the module replaces
each of them, on the object, by a ``CompiledMethod``: the method run through
``torch.compile(backend=compile_backend, dynamic=False)``. The pipeline executor, ``train_step``
and a plain call reach them by the same names, so nothing else changes.

- **Static shapes.** Generated code states its shapes (``view((4, 8, 2, 8))``), so a graph with
  symbolic sizes would gain nothing: each new input shape compiles a graph of its own, once.
- **Collectives.** ``nbscaler.runtime.collectives`` are autograd Functions around
  ``torch.distributed`` calls on process groups. Dynamo traces them whole, without a graph break:
  each ``dist.all_reduce`` / ``dist.all_gather`` becomes a functional collective in the graph
  (``_c10d_functional.all_reduce`` and ``wait_tensor``), in the forward and in the Function's
  backward, run on the same process group (gloo on the CPU). Where it meets something it cannot
  trace, it breaks the graph there and runs that part eagerly; either way every rank of a group runs
  the same collectives in the same order. ``tests/runtime/test_compiled.py`` checks the losses and
  gradients against the eager run and against one process. ZeRO-3's gathers and frees
  (``self.shards.unshard`` / ``reshard``, Python bookkeeping) are left out of the graphs on purpose:
  they run eagerly between the compiled pieces.
- **Compile time.** Dynamo announces the start and end of every compile (``torch._dynamo.callback``):
  a forward compile while a method is called with inputs it has no graph for, and the backward
  compile that AOTAutograd runs when a backward first reaches that graph (when inductor's cache holds
  both graphs, the backward is loaded with the forward and timed with it). Both carry dynamo's
  compile id, and both are credited to the method whose call started the forward compile.
- **Recompiles.** A call that compiles when the method had compiled before warns once with a
  ``RecompileWarning`` that names the rank, the method, the new inputs and those of the call before.
  Same shapes never compile again; any other reason dynamo has (a guard on something else) is
  said too, as such. Past ``torch._dynamo.config.recompile_limit`` graphs of one method, dynamo would
  quietly run it eagerly from then on; a ``CompileError`` says so instead, with the fixes.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
import warnings
import weakref
from typing import Any, Dict, Iterator, List, Optional

import torch
from torch.utils._pytree import tree_leaves

from nbscaler.columns import StrEnum

#: What a compiled method belongs to: a ``ParallelModule`` (named here by its base class, so that this
#: module, which ``runtime.module`` imports, names nothing of it back).
RankModule = torch.nn.Module

#: The generated methods a rank runs per micro-batch (``nbscaler.comm.lower.rank_sections`` names them).
GENERATED_METHOD = re.compile(r"_(forward|stage\d+)(_train|_eval)?")


#: The columns of ``ParallelModule.compile_events``: one row per compile a rank ran.
COMPILE_COLUMNS = ("rank", "method", "kind", "inputs", "seconds")


class CompileKind(StrEnum):
    """Which graph a compile made: the ``forward`` (when a call had none for its inputs) or the
    ``backward`` (when a backward first reached that forward's graph)."""

    FORWARD = "forward"
    BACKWARD = "backward"


class RecompileWarning(UserWarning):
    """A compiled rank method compiled again: new input shapes (or another guard of dynamo's) came."""


class CompileError(RuntimeError):
    """``torch.compile`` could not compile a rank's generated method with the configured backend."""


def describe_inputs(args: tuple, kwargs: Dict[str, Any]) -> str:
    """The inputs of a call as a compiled graph is keyed on: each tensor's dtype and shape, each
    number, and whether gradients are on.

    >>> describe_inputs((torch.zeros(2, 3), {"n": 4}), {})
    'float32[2, 3], 4'
    """
    parts = []
    for leaf in tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor):
            parts.append(f"{str(leaf.dtype).removeprefix('torch.')}{list(leaf.shape)}")
        elif isinstance(leaf, (bool, int, float)):
            parts.append(repr(leaf))
    return ", ".join(parts) + ("" if torch.is_grad_enabled() else "; gradients off")


class CompiledMethod:
    """One generated method of one rank, run through ``torch.compile``; it counts and times its
    compiles and says when it compiles again."""

    def __init__(self, module: RankModule, name: str, backend: str):
        self.name = name
        self.rank = module.world_rank
        self.backend = backend
        self.compiled = torch.compile(getattr(module, name), backend=backend, dynamic=False)
        self.compiling_calls = 0            # calls during which dynamo compiled anything of this method
        self.seconds = 0.0                  # forward and backward compiles, wall clock
        self.events: List[Dict[str, Any]] = []      # one row per compile (COMPILE_COLUMNS)
        self.last_inputs: Optional[str] = None
        _CLOCK.ensure_listening()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        inputs = describe_inputs(args, kwargs)
        before = len(self.events)
        # Past dynamo's recompile limit a method would run eagerly with only a log line: fail instead.
        with _CLOCK.running(self, inputs), torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            try:
                out = self.compiled(*args, **kwargs)
            except torch._dynamo.exc.BackendCompilerFailed as err:
                raise CompileError(self._failure(err)) from err
            except torch._dynamo.exc.FailOnRecompileLimitHit as err:
                raise CompileError(self._limit_hit(inputs)) from err
        if len(self.events) > before:
            self.compiling_calls += 1
            if self.compiling_calls > 1:
                self._say_recompiled(inputs)
        self.last_inputs = inputs
        return out

    def credit(self, kind: CompileKind, inputs: str, seconds: float) -> None:
        """Record one compile of this method."""
        self.seconds += seconds
        self.events.append(dict(zip(COMPILE_COLUMNS, (self.rank, self.name, kind.value, inputs, seconds))))

    def _say_recompiled(self, inputs: str) -> None:
        why = (f"for new inputs {inputs} (before: {self.last_inputs})" if inputs != self.last_inputs else
               f"for the same inputs {inputs}, on a guard of dynamo's other than shapes "
               "(TORCH_LOGS=recompiles names it)")
        warnings.warn(f"nbscaler: rank {self.rank} compiled {self.name} again {why}; compile number "
                      f"{self.compiling_calls} of this method.", RecompileWarning, stacklevel=3)

    def _limit_hit(self, inputs: str) -> str:
        limit = torch._dynamo.config.recompile_limit
        return (f"rank {self.rank}: {self.name} has compiled as many graphs as dynamo keeps for one method "
                f"(torch._dynamo.config.recompile_limit = {limit}) and would run eagerly for inputs {inputs}. "
                "Give it fewer input shapes (pad batches to a few sizes), raise "
                "torch._dynamo.config.recompile_limit, or set ComputeConfig.compile=False to run eagerly.")

    def _failure(self, err: BaseException) -> str:
        inner = getattr(err, "inner_exception", None) or err.__cause__ or err     # what the backend raised
        lines = str(inner).strip().splitlines()
        cause = f"{type(inner).__name__}: {lines[0].rstrip('.')}" if lines else type(inner).__name__
        return (f"rank {self.rank}: torch.compile(backend={self.backend!r}) could not compile {self.name}: "
                f"{cause}. Make the backend runnable here (install what it needs), choose another "
                "ComputeConfig.compile_backend ('inductor', the default; 'aot_eager' needs no C++ compiler), or "
                "set ComputeConfig.compile=False to run eagerly.")


class _CompileClock:
    """Times dynamo's compiles and credits each to the method whose call started it (one per
    process: dynamo's callbacks are process-wide)."""

    def __init__(self) -> None:
        self.listening = False
        self.local = threading.local()         # .method, .inputs: the compiled call running on this thread
        self.owners: "weakref.WeakValueDictionary[str, CompiledMethod]" = weakref.WeakValueDictionary()
        self.inputs: Dict[str, str] = {}        # compile id -> the inputs its forward was compiled for
        self.started: Dict[tuple, float] = {}

    def ensure_listening(self) -> None:
        if not self.listening:
            from torch._dynamo.callback import on_compile_end, on_compile_start
            on_compile_start(self._start)
            on_compile_end(self._end)
            self.listening = True

    @contextlib.contextmanager
    def running(self, method: CompiledMethod, inputs: str) -> Iterator[None]:
        outer = getattr(self.local, "method", None), getattr(self.local, "inputs", None)
        self.local.method, self.local.inputs = method, inputs
        try:
            yield
        finally:
            self.local.method, self.local.inputs = outer

    def _start(self, args: Any) -> None:
        key = (str(args.callback_trigger), str(args.compile_id))
        self.started[key] = time.perf_counter()
        method = getattr(self.local, "method", None)
        if _is_forward(args) and method is not None:
            self.owners[str(args.compile_id)] = method
            self.inputs[str(args.compile_id)] = self.local.inputs

    def _end(self, args: Any) -> None:
        start = self.started.pop((str(args.callback_trigger), str(args.compile_id)), None)
        owner = self.owners.get(str(args.compile_id))
        if start is not None and owner is not None:
            kind = CompileKind.FORWARD if _is_forward(args) else CompileKind.BACKWARD
            owner.credit(kind, self.inputs.get(str(args.compile_id), ""), time.perf_counter() - start)


def _is_forward(args: Any) -> bool:
    return args.callback_trigger.name == "DYNAMO"


_CLOCK = _CompileClock()


def _check_torch() -> None:
    """What this module asks of dynamo: compile ids in its compile callbacks, and a hard failure at
    the recompile limit (both in the torch ``make setup`` installs; older ones lack them)."""
    import torch._dynamo.callback
    if not (hasattr(torch._dynamo.callback, "CallbackArgs")
            and hasattr(torch._dynamo.config, "fail_on_recompile_limit_hit")):
        raise RuntimeError(f"ComputeConfig.compile=True needs a torch whose dynamo passes compile ids to its compile "
                           f"callbacks and can fail at its recompile limit; torch {torch.__version__} cannot. Install "
                           "the torch that `make setup` pins, or set compile=False.")


#: What generated code calls on ZeRO-3's units (``self.shards``): bookkeeping in Python (the order
#: units were first gathered, storage resized, hooks), run eagerly between the compiled pieces so that
#: its state changes (the order is recorded in the first step) are no reason to compile again.
EAGER_SHARD_CALLS = ("unshard", "reshard")


def compile_methods(module: RankModule) -> Dict[str, CompiledMethod]:
    """Replace each generated method of ``module`` by its ``CompiledMethod``; returns them by name."""
    _check_torch()
    from nbscaler.runtime.fsdp import ShardedUnits
    if isinstance(module.reducer, ShardedUnits):
        for name in EAGER_SHARD_CALLS:
            setattr(module.reducer, name, torch.compiler.disable(getattr(module.reducer, name)))
    backend = module.compute_config.compile_backend
    names = [n for n in dir(type(module)) if GENERATED_METHOD.fullmatch(n)]
    compiled = {name: CompiledMethod(module, name, backend) for name in names}
    for name, method in compiled.items():
        setattr(module, name, method)
    return compiled
