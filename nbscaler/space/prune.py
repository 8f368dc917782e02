"""Pruning a sweep for a search: price only what can be a layout's fastest fitting row.

autodist on a target wants the fastest configuration that fits, and the runners-up of each tp x pp
layout; pricing all of a 70B sweep's rows to find them spends most of the time on rows that were
never candidates. Two bounds let a search skip them without changing what it finds:

- a configuration's pipeline makespan (``pricing.pipeline_seconds``) is never more than its step,
  so once a layout has a fitting row faster than that floor (or the fastest of all, times the
  factor, is), the configuration cannot be its layout's best within the factor;
- what its forwards save before the first backward releases anything (``pricing.saved_floor``) is
  never more than its peak, so when that alone overflows the device it cannot fit.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

from nbscaler.columns import SweepColumn as S
from nbscaler.cost.hardware import Hardware
from nbscaler.space.pricing import saved_floor


def check_prune(prune: Optional[float]) -> None:
    """``ValueError`` unless ``prune`` is ``None`` or a factor >= 1."""
    if prune is not None and not (isinstance(prune, (int, float)) and not isinstance(prune, bool) and prune >= 1):
        raise ValueError(f"sweep's prune={prune!r}: give a factor >= 1 (e.g. 1.25: each layout's fastest fitting "
                         "row within 25% of the fastest), or None to price every configuration.")


def pruned_rows(runnable: List[Tuple], priced: Callable, hardware: Hardware, within: float) -> List[Dict]:
    """The rows a pruned sweep prices, in the order of the pipeline's makespan (a floor of the
    step): not those whose floor reaches their tp x cp x ep x pp layout's fastest fitting step, or
    ``within`` times the fastest fitting step of all; not those whose saved activations alone
    overflow the target, but for the first (the fastest, were memory no object).

    ``runnable``: ``(floor, config, cfg, facts, staged)`` per configuration; ``priced(config, cfg,
    facts, staged)`` returns a row."""
    rows: List[Dict] = []
    fastest: Dict[Tuple, float] = {}      # per tp x cp x ep x pp layout and software: its fastest fitting step so far
    for k, (floor, config, cfg, facts, staged) in enumerate(sorted(runnable, key=lambda r: r[0])):
        layout = (config[S.TP], config[S.CP], config[S.EP], config[S.PP], config.get(S.FLOAT8),
                  config.get(S.COMPILED))
        if floor >= min(fastest.get(layout, float("inf")), within * min(fastest.values(), default=float("inf"))):
            continue
        if k > 0 and not hardware.fits(saved_floor(staged, cfg)):
            continue
        rows.append(priced(config, cfg, facts, staged))
        if rows[-1][S.FITS]:
            fastest[layout] = min(fastest.get(layout, float("inf")), rows[-1][S.STEP_TIME_S])
    return rows
