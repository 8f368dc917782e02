"""The interactive loop at real size: how long Llama-3-8B and Llama-3-70B take to plan, to price
and to show, and how much memory planning them takes.

Both are Hugging Face's ``LlamaForCausalLM`` at the published shapes, built on the meta device
(``benchmarks.plan_at_scale``: 8B under ``tp`` on 8 GPUs, 70B under ``hybrid``, tp 8 x 8 stages, 1F1B
over 8 micro-batches; one sequence of 2,048 tokens, bf16). Each model runs in a fresh process, which
times ``plan()``, the first ``plan.memory()`` (it replays each device's program on fake tensors), a
``plan.summary(hardware=...)`` priced on H100s (nothing profiled on this machine), a ``plan.summary()``
timed on this machine from a cold op cache (an empty ``NBSCALER_CACHE_DIR``: every distinct op
profiled, those too large to run at their real shape at a smaller one, ``cost.shrink``), then opens every
view the way a notebook does: the view is built, its widgets' state serialised as the kernel sends
it, and its ``_repr_mimebundle_`` (the saved HTML) made. Each time is given in wall seconds and in
the process's CPU seconds, which the other jobs of a shared machine inflate less. The process's peak
RSS closes the row.

    python -m benchmarks.real_size_planning            # writes benchmarks/results/real_size_planning.md
    python -m benchmarks.real_size_planning --print --layers 4
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import resource
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import torch

RESULTS = Path(__file__).parent / "results" / "real_size_planning.md"
MODELS = ("llama-8B", "llama-70B")
VIEWS = ("GraphView", "PlanView", "MemoryView", "TimelineView", "CodeView")


def _widget_state(widget: Any) -> int:
    """Bytes of the JSON state of ``widget`` and of every widget inside it, as a kernel sends them."""
    from ipywidgets import Widget
    total, todo, seen = 0, [widget], set()
    while todo:
        w = todo.pop()
        if not isinstance(w, Widget) or id(w) in seen:
            continue
        seen.add(id(w))
        state, buffers, _ = w._serialize_state() if hasattr(w, "_serialize_state") else (w.get_state(), [], None)
        total += len(json.dumps(state, default=str)) + sum(len(b) for b in buffers or [])
        todo += [v for v in w.get_state().values() if isinstance(v, (list, tuple))
                 for v in v if isinstance(v, Widget)]
        todo += [getattr(w, name) for name in w.keys if isinstance(getattr(w, name, None), Widget)]
    return total


def open_view(name: str, plan: Any, hardware: Any) -> Dict[str, float]:
    """Seconds to build view ``name`` of ``plan`` and show it, and the bytes it shows."""
    import nbscaler.widgets as views
    cls = getattr(views, name)
    start, cpu = time.perf_counter(), time.process_time()
    view = cls(plan, hardware=hardware) if name == "TimelineView" else cls(plan)
    built = time.perf_counter()
    state = _widget_state(view.widget)
    bundle = view._repr_mimebundle_()
    shown = time.perf_counter()
    html = len(bundle.get("text/html", ""))
    return {"build_s": built - start, "show_s": shown - built, "total_s": shown - start,
            "cpu_s": time.process_time() - cpu, "state_bytes": state, "html_bytes": html}


def _timed(fn: Any) -> Tuple[Any, float, float]:
    """``fn()``, its wall seconds and this process's CPU seconds (which other jobs' load inflates less)."""
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def _measure(name: str, layers: Optional[int], out: "multiprocessing.Queue") -> None:
    """One model in this (fresh) process: the times, the views and the peak RSS, put on ``out``."""
    warnings.simplefilter("ignore")
    from benchmarks.plan_at_scale import LAYERS, MODELS as BUILDERS
    make, hardware, _ = BUILDERS[name](layers or LAYERS[name])
    row: Dict[str, Any] = {"layers": layers or LAYERS[name]}
    plan, row["plan_s"], row["plan_cpu_s"] = _timed(make)
    row["ops"] = len(plan.graph.nodes)
    _, row["memory_s"], row["memory_cpu_s"] = _timed(lambda: plan.memory(torch.optim.Adam))
    _, row["summary_s"], row["summary_cpu_s"] = _timed(lambda: plan.summary(torch.optim.Adam, hardware=hardware))
    with tempfile.TemporaryDirectory() as cold:
        os.environ["NBSCALER_CACHE_DIR"] = cold           # nothing profiled yet: every op is timed
        _, row["local_s"], row["local_cpu_s"] = _timed(lambda: plan.summary(torch.optim.Adam))
    row["views"] = {v: open_view(v, plan, hardware) for v in VIEWS}
    row["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out.put(row)


def measure(name: str, layers: Optional[int]) -> Dict[str, Any]:
    """Model ``name`` measured in a process of its own, so that its peak RSS is its own."""
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=_measure, args=(name, layers, out))
    proc.start()
    while True:
        try:
            row = out.get(timeout=5)
            break
        except queue.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"measuring {name} failed in its process (exit code {proc.exitcode}); "
                                   f"run _measure({name!r}, ...) here to see why") from None
    proc.join()
    return row


def tables(rows: Dict[str, Dict[str, Any]]) -> str:
    lines = ["Seconds, wall / CPU of this process:", "",
             "| model | layers | ops | plan (s) | memory (s) | summary on H100 (s) | summary here, cold cache (s) "
             "| peak RSS (MB) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in rows.items():
        both = lambda k: f"{r[k + '_s']:.2f} / {r[k + '_cpu_s']:.2f}"
        lines.append(f"| {name} | {r['layers']} | {r['ops']:,} | {both('plan')} | {both('memory')} | "
                     f"{both('summary')} | {both('local')} | {r['peak_rss_mb']:,.0f} |")
    lines += ["", "Opening each view (wall seconds: build + state and saved HTML, then the CPU seconds of both; "
              "then the widget state and the saved HTML in kB):", "",
              "| model | " + " | ".join(VIEWS) + " |", "| --- |" + " ---: |" * len(VIEWS)]
    for name, r in rows.items():
        cells = [f"{v['build_s']:.2f} + {v['show_s']:.2f}, CPU {v['cpu_s']:.2f} "
                 f"({v['state_bytes'] / 1e3:,.0f} / {v['html_bytes'] / 1e3:,.0f})"
                 for v in (r["views"][n] for n in VIEWS)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--layers", type=int, default=None, help="layers of every model (default: its own)")
    parser.add_argument("--print", action="store_true", help="print the tables instead of writing the results file")
    opts = parser.parse_args()
    load = os.getloadavg()[0]
    rows = {name: measure(name, opts.layers) for name in opts.models}
    text = tables(rows)
    if not opts.print:
        RESULTS.write_text(f"# Planning real sizes: times, views and memory\n\n`python -m benchmarks.real_size_planning`, "
                           f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, on the shared 2-core CPU machine "
                           f"(load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end).\n\n{text}\n")
    print(text)


if __name__ == "__main__":
    main()
