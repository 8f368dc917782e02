"""Where a pipeline step's time goes, per rank: nbscaler's executor against ``torch.distributed.pipelining``.

Both sides of ``benchmarks.native`` (the same GPT, weights and micro-batches) run a few steps on
every rank while every point-to-point call is counted and timed: the messages and bytes sent and
received per step, the time spent inside ``isend``/``irecv`` and waiting on their works, the time in
forward and backward compute, in the optimizer, and the step's wall and CPU time
(``time.process_time``). CPU time is the steady figure on a loaded machine: it counts what this
rank did, not how long it waited for a core.

    python -m benchmarks.pipeline_profile --ranks 4 --scheduler 1f1b --steps 5
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from benchmarks import native_sides as sides
from nbscaler.runtime import pipeline as executor
from nbscaler.runtime.launch import spawn

Counters = Dict[str, float]


class _TimedWork:
    """A ``dist.Work`` whose ``wait`` adds its duration to a counter."""

    def __init__(self, work, counters: Counters, key: str):
        self._work, self._counters, self._key = work, counters, key

    def wait(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._counters[self._key] += time.perf_counter() - start

    def __getattr__(self, name):
        return getattr(self._work, name)


_inside_batch = [False]       # an isend/irecv made by batch_isend_irecv: its time is the batch's


def _timed(fn, counters: Counters, kind: str, tensor_of):
    def call(*args, **kwargs):
        start, outer = time.perf_counter(), not _inside_batch[0]
        _inside_batch[0] = kind == "batch"
        try:
            result = fn(*args, **kwargs)
        finally:
            _inside_batch[0] = not outer
        if outer:
            counters[f"{kind}_call_s"] += time.perf_counter() - start
        for tensor in tensor_of(args, kwargs):
            counters[f"{kind}_msgs"] += 1
            counters[f"{kind}_bytes"] += tensor.numel() * tensor.element_size()
        if isinstance(result, list):
            return [_TimedWork(w, counters, f"{kind}_wait_s") for w in result]
        return _TimedWork(result, counters, f"{kind}_wait_s")
    return call


@contextmanager
def counting_p2p(counters: Counters):
    """Count and time every ``isend``/``irecv`` (batched or not) while the block runs."""
    names = ("isend", "irecv", "batch_isend_irecv")
    originals = [getattr(c10d, n) for n in names]
    first = lambda args, kwargs: [args[0] if args else kwargs["tensor"]]           # noqa: E731
    wrapped = [_timed(originals[0], counters, "send", first), _timed(originals[1], counters, "recv", first),
               _timed(originals[2], counters, "batch", lambda args, kwargs: [])]   # its ops count as sends/recvs
    for module in (dist, c10d):              # c10d checks a P2POp's op against its own names
        for name, fn in zip(names, wrapped):
            setattr(module, name, fn)
    try:
        yield
    finally:
        for module in (dist, c10d):
            for name, fn in zip(names, originals):
                setattr(module, name, fn)


def _timing(obj, name: str, counters: Counters, key: str) -> None:
    """Replace ``obj.name`` by a version that adds its duration to ``counters[key]``."""
    fn = getattr(obj, name)

    def call(*args, **kwargs):
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            counters[key] += time.perf_counter() - start
            counters[key.replace("_s", "_cpu_s")] += time.thread_time() - cpu
    setattr(obj, name, call)


def _profile_side(side: sides.Side, steps: int, compute_fns) -> Counters:
    counters: Counters = defaultdict(float)
    for obj, name, key in compute_fns:
        _timing(obj, name, counters, key)
    _timing(side.optimizer, "step", counters, "optimizer_s")
    side.step()                                              # warm-up, not counted
    counters.clear()
    dist.barrier()
    wall, cpu, main_cpu = time.perf_counter(), time.process_time(), time.thread_time()
    usage = resource.getrusage(resource.RUSAGE_SELF)
    with counting_p2p(counters):
        for _ in range(steps):
            side.step()
    after = resource.getrusage(resource.RUSAGE_SELF)
    counters["voluntary_switches"] = after.ru_nvcsw - usage.ru_nvcsw          # blocked, then woken
    counters["involuntary_switches"] = after.ru_nivcsw - usage.ru_nivcsw      # preempted
    counters["main_cpu_s"] = time.thread_time() - main_cpu
    counters["cpu_s"] = time.process_time() - cpu
    counters["wall_s"] = time.perf_counter() - wall
    counters["overhead_cpu_s"] = counters["main_cpu_s"] - counters["forward_cpu_s"] - counters["backward_cpu_s"]
    return {k: v / steps for k, v in counters.items()}


def _profile(setup: sides.Setup, scheduler: str, gen_dir: str, steps: int,
             receive_ahead: Optional[int] = None) -> Dict[str, Counters]:
    if receive_ahead is not None:
        executor.RECEIVE_AHEAD = receive_ahead
    ours = sides.nbscaler_pipeline(setup, gen_dir, scheduler)
    stages = [n for n in dir(type(ours.module)) if n.startswith("_stage")]
    # Tensor.backward calls torch.autograd.backward: timing the latter times every backward once.
    fns = [(ours.module, n, "forward_s") for n in stages] + [(torch.autograd, "backward", "backward_s")]
    original = torch.autograd.backward
    try:
        result = {"nbscaler": _profile_side(ours, steps, fns)}
    finally:
        torch.autograd.backward = original
    events = ours.module.pipeline_events
    result["nbscaler"]["blocks_s"] = sum(e["t_end"] - e["t_start"] for e in events)
    theirs = sides.torch_pipeline(setup, scheduler)
    stage = theirs._step.__closure__ and _stage_of(theirs)
    fns = [(stage, "forward_one_chunk", "forward_s"), (stage, "backward_one_chunk", "backward_s")]
    result["torch"] = _profile_side(theirs, steps, fns)
    result["torch"]["compute_s"] = result["torch"]["forward_s"] + result["torch"]["backward_s"]
    result["nbscaler"]["compute_s"] = result["nbscaler"]["forward_s"] + result["nbscaler"]["backward_s"]
    return result


def _stage_of(side: sides.Side):
    for cell in side._step.__closure__:
        schedule = cell.cell_contents
        if hasattr(schedule, "_stage"):
            return schedule._stage
    raise RuntimeError("the PyTorch side's schedule was not found")


COLUMNS = ["wall_s", "cpu_s", "main_cpu_s", "overhead_cpu_s", "voluntary_switches", "involuntary_switches", "compute_s", "forward_s", "forward_cpu_s", "backward_s", "backward_cpu_s",
           "optimizer_s", "send_msgs", "send_bytes",
           "send_call_s", "send_wait_s", "recv_msgs", "recv_bytes", "recv_call_s", "recv_wait_s", "batch_msgs",
           "batch_call_s", "batch_wait_s"]


def table(per_rank: List[Dict[str, Counters]]) -> str:
    lines = ["| side | rank | " + " | ".join(COLUMNS) + " |", "| --- " * (len(COLUMNS) + 2) + "|"]
    for side in ("nbscaler", "torch"):
        for rank, result in enumerate(per_rank):
            row = result[side]
            cells = [f"{row.get(c, 0.0):.0f}" if c.endswith(("msgs", "bytes", "switches")) else f"{1e3 * row.get(c, 0.0):.1f}"
                     for c in COLUMNS]
            lines.append(f"| {side} | {rank} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--scheduler", default="1f1b", choices=["1f1b", "gpipe"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--receive-ahead", type=int, help="blocks whose receives nbscaler posts ahead")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nbscaler-profile-") as gen_dir:
        per_rank = spawn(_profile, args.ranks, sides.Setup(), args.scheduler, gen_dir, args.steps, args.receive_ahead,
                         timeout=1800, threads=1)
    print(f"per step, ms (times) and counts; {args.ranks} ranks, {args.scheduler}")
    print(table(per_rank))
    for side in ("nbscaler", "torch"):
        print(side, "median wall ms", f"{1e3 * statistics.median(r[side]['wall_s'] for r in per_rank):.1f}",
              "CPU ms per rank", [round(1e3 * r[side]["cpu_s"]) for r in per_rank],
              "main-thread CPU outside compute, ms per rank", [round(1e3 * r[side]["overhead_cpu_s"]) for r in per_rank])


if __name__ == "__main__":
    main()
