"""A plan's tables as timing-free text, carried by every notebook output that shows them.

A saved notebook is read on GitHub without a kernel, long after it ran; it shows whatever the code
of that day planned. To tell whether it still shows what the code plans today, each output that
shows a plan's tables carries a *fingerprint* of them beside its HTML, under the MIME type
``FINGERPRINT_MIME`` (notebook viewers skip a type they do not know):

- ``ops``: ``plan.ops``, one row per op: placement, split, shapes, FLOPs and bytes;
- ``collectives``: ``plan.collectives``, one row per collective: layouts, phase, devices, bytes;
- ``memory``: ``plan.memory()``, bytes per rank by category; ``summary``: ``plan.summary()``;
- ``code``: one rank's generated file, line by line (``CodeView``).

Nothing measured enters it: no column of seconds (a name ending in ``_s``), and not where the
model's source lives (``source_file``, ``source_line``), which differs between checkouts. What is
left is a function of the code and the notebook alone, so running a notebook again with unchanged
code gives the same fingerprints, and ``differences`` names the rows that changed when it does not.

One exception: a plan that autodist chose by the op times it measured on this machine
(``chosen_by_time``) may place ops differently on another machine, or under another load. For
those, ``differences`` compares what the choice leaves alone: the traced ops, their global shapes,
FLOPs and bytes.

``plan.ops``, ``plan.collectives``, ``plan.memory()`` and ``plan.summary()`` keep theirs in the
frame's ``attrs`` (made when first shown), which pandas carries through slices (``plan.ops[["name", "split"]]``); in an
IPython kernel a display hook puts it into the frame's output. The same hook writes a summary's
numbers with their units (``with_units``: 82.9 MFLOP, 768 KiB, 123 ms), where a slice still holds
them; the frame keeps its numbers.
"""

from __future__ import annotations

import numbers
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import pandas as pd

from nbscaler.columns import StrEnum, SummaryColumn
from nbscaler.units import summary_format

FINGERPRINT_MIME = "application/vnd.nbscaler.fingerprint+json"
ATTR = "nbscaler_fingerprint"
"""The key of a table's fingerprint in ``DataFrame.attrs``."""

NOT_PLAN_COLUMNS = ("source_file", "source_line")
"""Where the model's source lives: not a fact of the plan, and different in every checkout."""
PLACEMENT_COLUMNS = ("stage", "devices", "split", "inner_split", "local_out_shapes", "local_flops_fwd")
"""The op columns a placement decides: left out of the comparison when time chose the placement."""
TIMED_CHOICE_KEY = "autodist"
"""The ``graph.meta`` record of a placement chosen by measured op times (``nbscaler.policy.autodist``)."""


class Table(StrEnum):
    """A plan table a fingerprint can hold."""

    OPS = "ops"
    COLLECTIVES = "collectives"
    MEMORY = "memory"
    SUMMARY = "summary"
    CODE = "code"


KEYS: Dict[str, Tuple[str, ...]] = {Table.OPS: ("name",), Table.COLLECTIVES: ("tensor", "consumer", "phase"),
                                    Table.MEMORY: ("rank",), Table.SUMMARY: ("rank",), Table.CODE: ("line",)}
"""The columns that name a row, so that a changed row is reported as one row with changed cells."""


def is_timing(column: str) -> bool:
    """Seconds (``step_time_s``, ``op_s``, ``t_start``...): they depend on the machine and its load."""
    return column.endswith("_s") or column in ("t_start", "t_end")


def cell_text(value: Any) -> str:
    """One cell as canonical text: integral numbers without ``.0``, other floats to 10 significant
    digits, missing values empty, sequences element by element (``(4, 32, 64)``)."""
    if isinstance(value, (list, tuple)):
        inner = ", ".join(cell_text(v) for v in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if value is None or (not isinstance(value, str) and pd.api.types.is_scalar(value) and pd.isna(value)):
        return ""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    if isinstance(value, numbers.Real):
        f = float(value)
        return str(int(f)) if f.is_integer() else format(f, ".10g")
    return str(value)


@dataclass(frozen=True)
class Fingerprint:
    """The timing-free rows of one or more tables of one plan (``plan`` is its ``repr``)."""

    plan: str
    tables: Mapping[str, Dict[str, Any]] = field(default_factory=dict)   # name -> {"columns", "rows"}
    chosen_by_time: bool = False       # placed by op times measured here (autodist): see the module doc

    def __or__(self, other: "Fingerprint") -> "Fingerprint":
        return Fingerprint(self.plan, {**self.tables, **other.tables}, self.chosen_by_time or other.chosen_by_time)

    def to_json(self) -> Dict[str, Any]:
        return {"plan": self.plan, "chosen_by_time": self.chosen_by_time,
                "tables": {k: dict(v) for k, v in self.tables.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Fingerprint":
        tables = {str(k): {"columns": list(v["columns"]), "rows": [list(r) for r in v["rows"]]}
                  for k, v in data["tables"].items()}
        return cls(str(data["plan"]), tables, bool(data.get("chosen_by_time", False)))

    def choice_free(self) -> "Fingerprint":
        """The ops table without the columns a placement decides, and no other table."""
        ops = self.tables.get(str(Table.OPS))
        if ops is None:
            return Fingerprint(self.plan, {}, self.chosen_by_time)
        keep = [i for i, c in enumerate(ops["columns"]) if c not in PLACEMENT_COLUMNS]
        return Fingerprint(self.plan, {str(Table.OPS): {"columns": [ops["columns"][i] for i in keep],
                                                        "rows": [[r[i] for i in keep] for r in ops["rows"]]}},
                           self.chosen_by_time)


SPARSE_COLUMNS = ("inner_split",)
"""Columns of a dimension most plans do not use (a grid placement's second cut): left out of a
table's fingerprint where every row leaves them empty, so they say nothing of that plan."""


def frame_rows(frame: pd.DataFrame) -> Dict[str, Any]:
    """A table's plan columns and its rows as canonical text."""
    columns = [str(c) for c in frame.columns if str(c) not in NOT_PLAN_COLUMNS and not is_timing(str(c))]
    columns = [c for c in columns if c not in SPARSE_COLUMNS or frame[c].notna().any()]
    rows = [[cell_text(v) for v in values] for values in frame[columns].itertuples(index=False)]
    return {"columns": columns, "rows": rows}


class TableFingerprint:
    """What a plan table keeps in its ``attrs``: the table, to make its fingerprint from the first
    time a notebook shows it or a slice of it (a large plan has thousands of ops, mostly never shown)."""

    def __init__(self, frame: pd.DataFrame, table: Table, plan: Any) -> None:
        self._frame, self._table = frame, table
        self._plan, self._timed = repr(plan), chosen_by_time(plan)
        self._made: Optional[Fingerprint] = None
        # A summary's numbers as made, which a shown slice is compared with (``with_units``); small.
        self.numbers: Optional[pd.DataFrame] = frame.copy() if table == Table.SUMMARY else None

    def get(self) -> Fingerprint:
        if self._made is None:
            self._made = Fingerprint(self._plan, {str(self._table): frame_rows(self._frame)}, self._timed)
        return self._made

    def __deepcopy__(self, memo: Dict[int, Any]) -> "TableFingerprint":
        return self            # pandas deep-copies ``attrs`` on every slice; this stays shared


def tag(frame: pd.DataFrame, table: Table, plan: Any) -> pd.DataFrame:
    """Attach ``frame``'s fingerprint (as table ``table`` of ``plan``) to it and return it."""
    frame.attrs[ATTR] = TableFingerprint(frame, table, plan)
    _show_in_notebooks()
    return frame


def chosen_by_time(plan: Any) -> bool:
    """Whether ``plan``'s placement was chosen by op times measured in this process's machine."""
    return TIMED_CHOICE_KEY in plan.graph.meta


def code_fingerprint(plan: Any, rank: int) -> Fingerprint:
    """Runtime ``rank``'s generated file, one row per line."""
    lines = plan.sources[rank].splitlines()
    rows = [[str(i), t] for i, t in enumerate(lines, 1)]
    return Fingerprint(repr(plan), {f"{Table.CODE} rank {rank}": {"columns": ["line", "text"], "rows": rows}},
                       chosen_by_time(plan))


def of_frames(*frames: pd.DataFrame) -> Optional[Fingerprint]:
    """The fingerprints ``frames`` carry, merged (``None`` when none carries one)."""
    found = [f.attrs[ATTR].get() for f in frames if isinstance(f.attrs.get(ATTR), TableFingerprint)]
    if not found:
        return None
    merged = found[0]
    for fp in found[1:]:
        merged = merged | fp
    return merged


def bundle(fingerprint: Optional[Fingerprint]) -> Dict[str, Any]:
    """The MIME bundle entry that carries ``fingerprint`` (empty without one)."""
    return {FINGERPRINT_MIME: fingerprint.to_json()} if fingerprint is not None else {}


# -- comparing ------------------------------------------------------------------------------------
def _row_text(columns: Sequence[str], row: Sequence[str]) -> str:
    return " ".join(f"{c}={v}" for c, v in zip(columns, row) if v != "")


def table_differences(name: str, saved: Mapping[str, Any], now: Mapping[str, Any], limit: int = 3) -> Optional[str]:
    """What differs between two versions of table ``name``, in one line (``None``: nothing)."""
    if list(saved["columns"]) != list(now["columns"]):
        return f"{name} columns differ: saved {list(saved['columns'])} vs now {list(now['columns'])}"
    columns = list(now["columns"])
    old = [tuple(r) for r in saved["rows"]]
    new = [tuple(r) for r in now["rows"]]
    if old == new:
        return None
    key_at = [columns.index(k) for k in KEYS.get(name.split()[0], ()) if k in columns]
    keyed = {tuple(r[i] for i in key_at): r for r in new} if key_at else {}
    new_set, old_set = set(new), set(old)
    gone = [r for r in old if r not in new_set]
    added = [r for r in new if r not in old_set]
    notes: List[str] = []
    for r in gone:
        match = keyed.get(tuple(r[i] for i in key_at)) if key_at else None
        if match is not None and match in added:
            added.remove(match)
            changed = [f"{c} '{a or '-'}' -> '{b or '-'}'" for c, a, b in zip(columns, r, match) if a != b]
            notes.append(f"{' '.join(r[i] for i in key_at)}: {', '.join(changed)}")
        else:
            notes.append(f"saved only: {_row_text(columns, r)}")
    notes += [f"now only: {_row_text(columns, r)}" for r in added]
    if not notes:
        notes = ["the same rows in another order"]
    more = f" (and {len(notes) - limit} more)" if len(notes) > limit else ""
    return f"{name} differ ({len(old)} rows saved, {len(new)} now): " + "; ".join(notes[:limit]) + more


def differences(saved: Fingerprint, now: Fingerprint) -> List[str]:
    """One line per table that differs between a saved fingerprint and today's (for a placement
    chosen by time, only in what the choice leaves alone)."""
    if saved.chosen_by_time or now.chosen_by_time:
        saved, now = saved.choice_free(), now.choice_free()
    out = []
    for name in sorted(set(saved.tables) | set(now.tables)):
        if name not in now.tables or name not in saved.tables:
            where = "saved" if name in saved.tables else "now"
            out.append(f"{name} shown only {where}")
            continue
        line = table_differences(name, saved.tables[name], now.tables[name])
        if line is not None:
            out.append(line)
    if not out and saved.plan != now.plan:
        out.append(f"the plan differs: saved {saved.plan} vs now {now.plan}")
    return out


# -- showing in a kernel --------------------------------------------------------------------------
def with_units(frame: pd.DataFrame) -> Optional[pd.DataFrame]:
    """``frame`` as a notebook shows it when it is a plan summary or a slice of one: each column that
    still holds the summary's own numbers written with its unit (``units.summary_format``), as text.
    A column changed since (``summary.param_bytes / 2**20``) keeps pandas's writing, which a unit
    would mislabel. ``None`` for any other frame, one whose rows were filtered, or one left with no
    column of the summary's numbers."""
    held = frame.attrs.get(ATTR)
    made = held.numbers if isinstance(held, TableFingerprint) else None
    if made is None or len(frame) != len(made):
        return None
    same = [c for c in frame.columns if c != SummaryColumn.RANK and c in made.columns
            and frame[c].reset_index(drop=True).equals(made[c].reset_index(drop=True))]
    if not same:
        return None
    shown = frame.copy()
    for c in same:
        shown[c] = frame[c].map(summary_format(str(c)))
    return shown


def _frame_bundle(frame: pd.DataFrame) -> Dict[str, Any]:
    """IPython's MIME bundle hook for DataFrames: the fingerprint a plan table carries, if any, and
    a summary's HTML and text with units (``with_units``); other frames' come from pandas as before."""
    data = bundle(of_frames(frame))
    shown = with_units(frame)
    if shown is not None:
        data.update({"text/html": shown._repr_html_(), "text/plain": repr(shown)})
    return data


def _show_in_notebooks() -> None:
    """In an IPython kernel, register ``_frame_bundle`` for DataFrames (once; any hook registered
    before keeps working). Outside one, nothing: IPython is not even imported."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None:
        return
    formatter = shell.display_formatter.mimebundle_formatter
    previous = formatter.type_printers.get(pd.DataFrame)
    if previous is _frame_bundle or getattr(previous, "__wrapped__", None) is _frame_bundle:
        return
    if previous is None:
        formatter.for_type(pd.DataFrame, _frame_bundle)
        return

    def both(frame: pd.DataFrame) -> Any:
        got = previous(frame)
        data, meta = got if isinstance(got, tuple) else (got or {}, {})
        return {**data, **_frame_bundle(frame)}, meta
    both.__wrapped__ = _frame_bundle             # type: ignore[attr-defined]
    formatter.for_type(pd.DataFrame, both)

