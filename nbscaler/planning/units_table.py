"""ZeRO stage 3's units as a table: what each plan device gathers together, and what it stores of it.

One row per unit and plan device: how many of its parameters the device holds, their elements,
the bytes the unit takes gathered (flat, padded to a multiple of the ZeRO group, in the parameters'
dtype), the bytes of this rank's shard of it, and whether the forward frees it after the unit runs
(``comm.unit_gathers``: every unit but the rest of the model, unless
``zero_reshard_after_forward=False``). ``Plan.units`` shows it; empty without stage 3.
"""

from __future__ import annotations

from typing import Any

import pandas as pd

from nbscaler.comm.program import Reshard
from nbscaler.recipe import Recipe
from nbscaler.cost.memory import unit_bytes_held

UNIT_COLUMNS = ["device", "unit", "parameters", "numel", "gathered_bytes", "shard_bytes", "freed_after_forward"]


def units_frame(programs: Any, config: Any, recipe: Recipe) -> pd.DataFrame:
    """The units of every plan device of ``programs`` (``comm.lower.RankPrograms``) under ``config``."""
    rows = []
    n = config.grid.zero_group_size if config.use_zero else 1
    for device in range(config.plan_ngpus):
        program = programs.device(device)
        if not program.units:
            continue
        weights = {w.name: w for w in program.weights}
        freed = {i.unit for sec in program.sections for i in sec.instructions if isinstance(i, Reshard)}
        gathered = unit_bytes_held([w for w in program.weights if w.kind == "param"], config, recipe)
        for unit, names in program.units.items():
            rows.append({"device": device, "unit": unit, "parameters": len(names),
                         "numel": sum(weights[name].numel for name in names), "gathered_bytes": gathered[unit],
                         "shard_bytes": gathered[unit] // n, "freed_after_forward": unit in freed})
    return pd.DataFrame(rows, columns=UNIT_COLUMNS)
