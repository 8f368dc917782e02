"""Per-op time from a one-off profile on the current device, cached by device and shapes.

The time model needs how long each op takes at the local shapes a rank runs it with. Rather than
a roofline guess, each distinct call (target, local input shapes and dtypes, constant arguments)
is run a few times on random tensors, forward and backward, and the median run is kept in a JSON
table under the cache folder (``cost.cache``), one per device (e.g. ``cpu-x86_64-1t``: the number
of threads matters on a CPU). A 12-layer transformer has a few dozen distinct calls, so profiling
it (in three rounds, ``OpProfiler.profile``) takes a few seconds, once. The median, not the
fastest run: on a CPU the fastest of a few repeats is a quarter or so below what the same op
takes inside a step (caches, allocator, interrupts), and a step is made of typical runs.

Times are stored as multiples of the reference workload timed beside them (``cost.speed``), and
read back at the speed the ranks last measured: a profile taken in a quiet minute still
describes ranks that run later, on a busier machine, or more of them than there are cores.

A single op's backward pays the autograd engine's start-up, which a whole backward pays once;
``engine_overhead_s`` measures it, and it is taken out of each op's backward time.

An op too large to run at its real shape here (a real-size model's products) is timed at a smaller
shape and scaled (``cost.shrink``): no op over the budget is ever run at its real shape.
"""

from __future__ import annotations

import dataclasses
import hashlib
import statistics
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

import torch

from nbscaler.cost import speed
from nbscaler.cost.cache import cache_dir, read_table, write_table
from nbscaler.cost.local import OpCall, call_args, call_node
from nbscaler.cost.shrink import Basis, Proxy, measure_rates, rate_seconds, shrink, shrink_update
from nbscaler.cost.speed import device_key, intra_op_threads, sync, warm_up
from nbscaler.experts.log import unreal_inputs
from nbscaler.recipe import Recipe

MIN_REPEATS, MAX_REPEATS, BUDGET_S = 3, 20, 0.05
#: On a CPU, an op whose run takes longer than this is timed by that one run (the warm-up's included):
#: at that length a run's spread and the warm-up's extra are a few percent, and a large op (a
#: 50k-vocabulary head) would otherwise take seconds to profile. Never on a GPU (``time_op``).
LONG_RUN_S = 0.2


#: Bytes a CPU run writes before it starts, to evict the core's L2 cache (0.5 to 2 MB on today's
#: CPUs). In a step an op's weights and inputs were last touched other ops ago; timed straight after
#: copying its inputs, a run found them in L2, and a whole forward and backward of the benchmark
#: models took 1.1 to 1.2 times the sum of their ops timed so, with a spread of a fifth between
#: profiles. After a 4 MB pass, 0.95 to 1.0 times, with half the spread.
EVICT_BYTES = 4 * 2 ** 20

#: Rounds of a profile (``OpProfiler.profile``), and the seconds of reference runs that open each.
PASSES, ROUND_REFERENCE_S = 3, 0.04

#: Bumped when the way ops are timed changes, so tables timed the old way are not read.
PROFILE_VERSION = 5


def op_key(op: OpCall) -> str:
    """What decides an op's time: its target, local inputs and constant arguments."""
    consts = repr(op.node.map_args(lambda t: None))
    shapes = repr([(s, str(d), g) for s, d, g in op.in_shapes])
    return hashlib.sha1(f"{op.node.target}|{shapes}|{consts}".encode()).hexdigest()[:20]


def _random_inputs(op: OpCall, device: torch.device) -> List[torch.Tensor]:
    """Inputs of the op's local shapes: uniform floats (cheaper to draw than normal ones, which
    matters for a vocabulary-sized weight), zeros for integers (valid indices and masks)."""
    return [torch.empty(shape, dtype=dtype, device=device).uniform_(-1, 1) if dtype.is_floating_point
            else torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, _ in op.in_shapes]


def _fresh(inputs: List[torch.Tensor], op: OpCall) -> List[torch.Tensor]:
    """Copies of ``inputs`` for one run: an in-place op changes only its copy, and an input that
    takes a gradient is not a leaf, so in-place ops work on it as at run time."""
    return [t.clone().requires_grad_().clone() if grad else t.clone()
            for t, (_, _, grad) in zip(inputs, op.in_shapes)]


def _float_outputs(result) -> List[torch.Tensor]:
    from torch.utils._pytree import tree_flatten
    leaves, _ = tree_flatten(result)
    return [x for x in leaves if isinstance(x, torch.Tensor) and x.requires_grad and x.grad_fn is not None]


def _evict_caches(scratch: Optional[torch.Tensor]) -> None:
    """One pass over ``scratch`` (a CPU buffer of ``EVICT_BYTES``; None on a GPU)."""
    if scratch is not None:
        scratch.mul_(1.0)


def time_op(op: OpCall, device: torch.device) -> Tuple[float, float]:
    """Median forward and backward seconds of ``op`` on ``device`` (a few repeats, a small budget).

    On a CPU each run starts from caches a step would leave (``EVICT_BYTES``), not from inputs
    just copied into them. The inputs are random: a capacity routing's drops among them are not
    reported (``nbscaler.experts.log.unreal_inputs``)."""
    with unreal_inputs():
        return _time_op(op, device)


def _time_op(op: OpCall, device: torch.device) -> Tuple[float, float]:
    fwd, bwd = [], []
    spent = 0.0
    drawn = _random_inputs(op, device)
    scratch = torch.ones(EVICT_BYTES // 4) if device.type == "cpu" else None
    for i in range(MAX_REPEATS + 1):
        args, kwargs = call_args(op.node, _fresh(drawn, op), device, op.out_shapes[0][0] if op.out_shapes else ())
        _evict_caches(scratch)
        sync(device)
        start = time.perf_counter()
        result = call_node(op.node, args, kwargs)
        sync(device)
        middle = time.perf_counter()
        outs = _float_outputs(result)
        if outs:
            grads = [torch.ones_like(o) for o in outs]
            sync(device)
            middle2 = time.perf_counter()
            torch.autograd.backward(outs, grads)
            sync(device)
            end = time.perf_counter()
        else:
            middle2 = end = middle
        # On a GPU the first run always warms up: a kernel's first call loads it (over a second for
        # attention), however short the kernel.
        long_run = end - start > LONG_RUN_S and device.type == "cpu"
        if i or long_run:
            fwd.append(middle - start)
            bwd.append(end - middle2)
            spent += end - start
            if (len(fwd) >= MIN_REPEATS and spent > BUDGET_S) or long_run:
                break
    return statistics.median(fwd), statistics.median(bwd)


def engine_overhead_s(device: torch.device, repeats: int = 30) -> float:
    """The time a backward takes through one trivial op (median): the engine's fixed start-up."""
    times = []
    for _ in range(repeats):
        x = torch.ones(1, device=device, requires_grad=True)
        y = x * 1.0
        sync(device)
        start = time.perf_counter()
        y.backward()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class OpProfiler:
    """Op times on one device, profiled on first use and cached on disk.

    On a CPU, ops are timed with ``threads`` intra-op threads (this process's count by default):
    the count the ranks will run with, not the notebook's, which has all the cores to itself.
    Times are read at the speed ``ranks`` ranks on this device last measured (``cost.speed``).
    """

    def __init__(self, device: Optional[torch.device] = None, path: Optional[Path] = None,
                 threads: Optional[int] = None, ranks: int = 1):
        self.device = device or (torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
        self.threads = threads if self.device.type == "cpu" else None
        self.ranks = ranks
        self.key = device_key(self.device, self.threads)
        self.path = path or cache_dir() / f"ops-v{PROFILE_VERSION}-{self.key}.json"
        self.table: Dict[str, List[float]] = read_table(self.path)       # in reference units
        self.new: Dict[str, List[float]] = {}
        self._reference: Optional[float] = None
        self._speed: Optional[float] = None
        self.calibrated = False
        self.proxies: Dict[str, Proxy] = {}          # op_key -> how the op is timed
        self.run_keys: Dict[str, Optional[str]] = {}   # op_key -> the key its proxy's time is stored under

    def proxy(self, op: OpCall, key: Optional[str] = None) -> Proxy:
        """How ``op`` (of ``op_key`` ``key``) is timed (``cost.shrink``), worked out once per distinct op."""
        key = key or op_key(op)
        if key not in self.proxies:
            self._set_proxy(key, shrink(op))
        return self.proxies[key]

    def _set_proxy(self, key: str, proxy: Proxy) -> None:
        self.proxies[key] = proxy
        self.run_keys[key] = None if proxy.run is None else key if proxy.run is proxy.op else op_key(proxy.run)

    def _rates(self) -> List[float]:
        """Seconds per byte streamed and per FLOP of a product, in reference units (``Basis.RATES``)."""
        if "__rates__" not in self.table:
            with intra_op_threads(self.threads):
                warm_up(self.device)
                rates = measure_rates(self.device)
            self.table["__rates__"] = self.new["__rates__"] = [r / self.process_reference_s() for r in rates]
        return self.table["__rates__"]

    def process_reference_s(self) -> float:
        """The reference workload's seconds as this profiler first timed it in this process: what
        ops profiled one at a time (``time``) are divided by. Timed once, so that the ops a search
        compares one by one differ by their own times, not by when the reference was taken."""
        if self._reference is None:
            self._reference = speed.reference_s(self.device, self.threads)
        return self._reference

    @property
    def speed_s(self) -> float:
        """The reference's seconds that stored times are multiplied by: as the ranks last measured
        it, else as this process first timed it (then times read as profiled). Fixed until
        ``refresh_speed``, so the plans and searches in between compare like with like."""
        if self._speed is None:
            self.refresh_speed()
        if self._speed is None:
            self._speed = self.process_reference_s()
        return self._speed

    def refresh_speed(self) -> None:
        """Read the ranks' latest calibration (``speed.load``), when there is one."""
        measured = speed.load(self.key, self.ranks)
        if measured is not None:
            self._speed, self.calibrated = measured, True

    def _overhead_units(self) -> float:
        if "__engine__" not in self.table:
            with intra_op_threads(self.threads):
                warm_up(self.device)
                overhead = engine_overhead_s(self.device)
            self.table["__engine__"] = self.new["__engine__"] = [overhead / self.process_reference_s()]
        return self.table["__engine__"][0]

    @property
    def overhead_s(self) -> float:
        """The autograd engine's start-up per backward."""
        return self._overhead_units() * self.speed_s

    def profile(self, ops: Iterable[OpCall], passes: int = PASSES) -> None:
        """Time every op of ``ops`` not in the table yet, in ``passes`` rounds over all of them.

        Each round starts with the reference workload, and an op's stored time is the median over
        rounds of its time in reference units: a moment when the machine ran slow falls on one
        round of every op, not on every round of one op. One round (``time`` of a single op) uses
        ``process_reference_s`` instead.
        """
        keys = {op_key(op): op for op in ops}
        proxies = [self.proxy(op, key) for key, op in keys.items()]
        if any(p.basis == Basis.RATES for p in proxies):
            self._rates()
        missing = {self.run_keys[key]: p.run for key, p in zip(keys, proxies) if p.run is not None}   # each proxy
        missing = {k: op for k, op in missing.items() if k not in self.table}
        if not missing:
            return
        overhead = self._overhead_units()
        rounds: Dict[str, List[Tuple[float, float]]] = {k: [] for k in missing}
        with intra_op_threads(self.threads):
            warm_up(self.device)
            for _ in range(passes):
                reference = self.process_reference_s() if passes == 1 else speed.reference_s(self.device, budget_s=ROUND_REFERENCE_S)
                for k, op in list(missing.items()):
                    try:
                        fwd, bwd = time_op(op, self.device)
                    except Exception:           # a proxy whose constant arguments spell a shrunk size
                        if not self._give_up(k):
                            raise
                        del missing[k], rounds[k]
                        continue
                    rounds[k].append((fwd / reference, max(0.0, bwd / reference - overhead) if bwd else 0.0))
        for k, times in rounds.items():
            self.table[k] = self.new[k] = [statistics.median(t[0] for t in times), statistics.median(t[1] for t in times)]

    def _give_up(self, key: str) -> bool:
        """Price the ops whose proxy is ``key`` from rates instead; False when ``key`` is no proxy."""
        owners = [k for k, p in self.proxies.items() if p.basis != Basis.AS_IS and self.run_keys[k] == key]
        for k in owners:
            self._set_proxy(k, dataclasses.replace(self.proxies[k], run=None, dims=(), factor=(1.0, 1.0), basis=Basis.RATES))
        if owners:
            self._rates()
        return bool(owners)

    def time(self, op: OpCall) -> Tuple[float, float]:
        """Forward and backward seconds of ``op`` (engine start-up taken out of the backward);
        profiled in one round when missing (``profile`` times many ops more robustly). A large op
        reads its proxy's time times the proxy's factor (``cost.shrink``)."""
        key = op_key(op)
        proxy = self.proxy(op, key)
        if proxy.run is not None and self.run_keys[key] not in self.table:
            self.profile([op], passes=1)
            proxy = self.proxies[key]                 # priced from rates if its proxy could not run
        if proxy.basis == Basis.RATES:
            fwd, bwd = rate_seconds(op, *self._rates())
        elif proxy.basis == Basis.VIEW:
            fwd, bwd = 0.0, 0.0
        else:
            fwd, bwd = (t * f for t, f in zip(self.table[self.run_keys[key]], proxy.factor))
        scale = self.speed_s * op.scale        # ``op.scale``: the busiest expert-parallel device's share of a routing
        return fwd * scale, bwd * scale

    def update(self, numels: List[int], dtype: torch.dtype, recipe: Recipe) -> float:
        """Seconds of the reducer's copies and one step of ``recipe``'s optimizer over parameters of ``numels``
        (the median of ``PASSES`` rounds, each against its own reference). More than
        ``shrink.UPDATE_BUDGET`` elements are timed over fewer and scaled (``shrink.shrink_update``):
        the table keeps the time of the sizes timed."""
        numels, factor = shrink_update(numels)
        optimizer, optimizer_kwargs = recipe.optimizer, recipe.kwargs
        key = f"update|{optimizer.__module__}.{optimizer.__qualname__}|{sorted(optimizer_kwargs.items())}|{dtype}|{numels}"
        key = hashlib.sha1(key.encode()).hexdigest()[:20]
        if key not in self.table:
            with intra_op_threads(self.threads):
                rounds = [time_update(numels, dtype, optimizer, optimizer_kwargs, self.device, repeats=5)
                          / speed.reference_s(self.device, budget_s=ROUND_REFERENCE_S) for _ in range(PASSES)]
            self.table[key] = self.new[key] = [statistics.median(rounds)]
        return self.table[key][0] * factor * self.speed_s

    def save(self) -> None:
        """Write what was profiled since the last save."""
        if self.new:
            write_table(self.path, self.new)
            self.new = {}


def time_update(numels: List[int], dtype: torch.dtype, optimizer: type, optimizer_kwargs: Dict,
                device: torch.device, repeats: int = 11) -> float:
    """Seconds of what follows the backward on one rank, without communication: the reducer's
    copies into and out of its flat buckets, and one step of ``optimizer`` over parameters of
    ``numels`` elements."""
    if not numels:
        return 0.0
    params = [torch.nn.Parameter(torch.full((n,), 0.5, dtype=dtype, device=device)) for n in numels]
    for p in params:
        p.grad = torch.full_like(p, 0.1)       # the step's time does not depend on the values
    opt = optimizer(params, **optimizer_kwargs)
    flat = torch.empty(sum(numels), dtype=dtype, device=device)
    times = []
    for i in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        flat.zero_()
        offset = 0
        for p in params:                     # Bucket.flat_grads, then Bucket.set_grads
            flat[offset:offset + p.numel()].copy_(p.grad)
            offset += p.numel()
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()])
            offset += p.numel()
        opt.step()
        sync(device)
        if i:
            times.append(time.perf_counter() - start)
            if times[-1] > LONG_RUN_S:
                break
    return statistics.median(times)
