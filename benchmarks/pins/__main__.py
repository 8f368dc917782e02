"""Pinned predictions: the figures a refactoring of the cost model or the plan space must leave
bit-identical, written once and compared after each change.

What is pinned, each on targets only (nothing here is timed on this machine):

- the Llama-3-8B plan space of ``benchmarks.space`` (192 configurations on 8 H100s): its frame,
  and its frame after each of that benchmark's knob turns there and back;
- every figure ``benchmarks.published`` computes for its rows (the chosen micro-batch's step, its
  shares, the ablations, the torchtitan rows) and the section ``benchmarks.published_sweep`` writes.

Floats are stored by ``repr``, which reads back to the same bits.

    python -m benchmarks.pins record        # writes benchmarks/pins/*.json
    python -m benchmarks.pins check         # recomputes and names every figure that moved
    python -m benchmarks.pins check --only space
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List

import pandas as pd

HERE = Path(__file__).parent


def _plain(value: Any) -> Any:
    """``value`` as JSON can hold it: frames as lists of records, floats kept to the bit."""
    if isinstance(value, pd.DataFrame):
        return [_plain(r) for r in value.to_dict("records")]
    if isinstance(value, pd.Series):
        return _plain(value.to_dict())
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items() if str(k) != "plan"}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item):           # numpy scalars
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    return repr(value)


def space() -> Dict[str, Any]:
    """The 8B space's frame, then after each knob turn of ``benchmarks.space``."""
    from benchmarks.space import GLOBAL_BATCH, KNOBS, RANGES, llama3_8b, tokens
    from nbscaler import Hardware
    from nbscaler.space.plan_space import PlanSpace
    warnings.filterwarnings("ignore", message="the cost model could not replay")
    s = PlanSpace(llama3_8b(), tokens(), Hardware.named("H100-SXM-80GB"), global_batch=GLOBAL_BATCH, **RANGES)
    frames = {"start": _plain(s.frame), "excluded": _plain(s.frame.attrs["excluded"])}
    for name, there, back in KNOBS:
        frames[f"{name}: there"] = _plain(s.set(**there))
        frames[f"{name}: back"] = _plain(s.set(**back))
    return frames


def published() -> Dict[str, Any]:
    """Every figure ``benchmarks.published`` and ``published_sweep`` compute."""
    from benchmarks.published.predict import predict
    from benchmarks.published.runs import NARAYANAN_2021
    from benchmarks.published.torchtitan import LLAMA_RUNS, predict_llama
    from benchmarks.published_sweep import section
    out: Dict[str, Any] = {}
    for run in NARAYANAN_2021:
        row = predict(run, log=lambda *_: None)
        best = row["best"]
        out[f"{run.params_b}B"] = _plain({"micro": best.micro, "step": _figures(best.step), "shares": row["shares"],
                                          "ablation": row["ablation"]})
    for run in LLAMA_RUNS:
        out[run.name] = _plain([{**{k: v for k, v in r.items() if k != "step"}, "step": _figures(r["step"])}
                                for r in predict_llama(run, log=lambda *_: None)])
    out["sweep section"] = untimed(section(NARAYANAN_2021))
    return out


def _figures(step) -> Dict[str, Any]:
    """What a ``StepFigures`` says of a step."""
    return {"step_time_s": step.step_time_s, "peak_bytes": step.peak_bytes, "fits": step.fits, "mfu": step.mfu,
            "hfu": step.hfu, "bubble": step.bubble, "tp": step.tp_comm_share, "dp": step.dp_comm_share,
            "sends": step.pp_send_share}


def untimed(section: str) -> str:
    """``section`` without its table's last column, the seconds each sweep took here."""
    return "\n".join(line.rsplit("|", 2)[0] + "|" if line.startswith("| ") else line for line in section.split("\n"))


PINS: Dict[str, Callable[[], Dict[str, Any]]] = {"space": space, "published": published}


def differences(old: Any, new: Any, where: str = "") -> List[str]:
    """Every place where ``new`` differs from ``old``, by path."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = [f"{where}/{k}: only {'before' if k in old else 'now'}" for k in sorted(set(old) ^ set(new))]
        for k in old:
            if k in new:
                out += differences(old[k], new[k], f"{where}/{k}")
        return out
    if isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            return [f"{where}: {len(old)} items before, {len(new)} now"]
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in differences(a, b, f"{where}[{i}]")]
    return [] if old == new else [f"{where}: {old!r} -> {new!r}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("record", "check"))
    parser.add_argument("--only", nargs="*", choices=list(PINS), default=list(PINS))
    args = parser.parse_args()
    moved = 0
    for name in args.only:
        start = time.perf_counter()
        figures = json.loads(json.dumps(PINS[name]()))
        path = HERE / f"{name}.json"
        if args.what == "record":
            path.write_text(json.dumps(figures, separators=(",", ":")) + "\n")
            print(f"{name}: recorded in {time.perf_counter() - start:.0f} s")
            continue
        diff = differences(json.loads(path.read_text()), figures)
        moved += len(diff)
        print(f"{name}: {len(diff)} figures moved ({time.perf_counter() - start:.0f} s)")
        for line in diff[:40]:
            print("  " + line)
    sys.exit(1 if moved else 0)


if __name__ == "__main__":
    main()
