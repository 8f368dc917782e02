"""PlanView: the plan as two sortable tables, filtered by module.

- **ops**: one row per op of the training graph (``plan.ops``): where it runs, how it is split, its
  global and local output shapes, FLOPs and bytes, and the collectives that convert its inputs;
- **collectives**: one row per edge that needs one (``plan.collectives``): the tensor, producer and
  consumer, the layout it has and the one wanted, the collective, its phase, devices and bytes;
- **experts** (a plan with routed experts): one row per routed-experts op and device, the experts the
  device holds and how their weights are stored (``nbscaler.planning.expert_tables``).

The live widget sorts and filters in Python (a column and a direction, a module); the saved HTML
carries the same table with a few lines of script that sort on a header click and filter on a
module, so it works without a kernel.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

import ipywidgets as widgets
import pandas as pd

from nbscaler.glossary import GLOSSARY_URL, layout_text, legend, split_text
from nbscaler.ir.layer_rules import parallel_splits
from nbscaler.planning.expert_tables import EXPERT_COLUMNS, expert_rows
from nbscaler.widgets.base import Measured, View
from nbscaler.widgets.formats import ascii_html, fmt_bytes, fmt_flops

if TYPE_CHECKING:
    from nbscaler.planning import Plan
    from nbscaler.planning.fingerprint import Fingerprint

ALL_MODULES = "(all modules)"
MAX_ROWS = 2000
"""Rows drawn at most; filter by module to see the rest."""

OP_VIEW_COLUMNS = ["id", "name", "module", "op", "devices", "stage", "split", "annotation", "out_shapes",
                   "local_out_shapes", "flops_fwd", "flops_bwd", "bytes_written", "collectives_in"]
COLLECTIVE_VIEW_COLUMNS = ["tensor", "producer", "consumer", "module", "have", "want", "collective", "phase",
                           "devices", "stage", "tensor_bytes", "bytes_per_device"]
FORMATTERS: Dict[str, Callable] = {"flops_fwd": fmt_flops, "flops_bwd": fmt_flops, "bytes_written": fmt_bytes,
                                   "tensor_bytes": fmt_bytes, "bytes_per_device": fmt_bytes,
                                   "have": layout_text, "want": layout_text, "held_bytes": fmt_bytes}
"""How a column's cells are written; ``split`` is written from its row (``split_text`` of the split and
the op, and under context or expert parallelism of what the op cuts: ``parallel_splits``); the cells
keep their values for sorting, and the frames theirs for code."""


def glossary_html(ops: pd.DataFrame, contexts: Optional[Dict[str, str]] = None) -> str:
    """The line a view's header starts with: a link to the glossary, then the readable name of each
    split label ``ops`` (rows of ``plan.ops``) shows; ``contexts``: the plan's ``parallel_splits``, whose
    ops are named by what context or expert parallelism cuts."""
    contexts = contexts or {}
    names = legend([(s, o, contexts.get(n)) for s, o, n in zip(ops.split, ops.op, ops.name) if s != "replicated"])
    return (f"<div class='nbs-glossary' style='font:11px sans-serif;color:#444;margin:2px 0'>"
            f"<a href='{GLOSSARY_URL}' target='_blank'>glossary of split and layout labels</a>"
            + (f": {ascii_html(names)}" if names else "") + "</div>")


def collectives_in(collectives: pd.DataFrame) -> Dict[str, str]:
    """Consumer op -> the collectives on its input edges, e.g. ``'all_reduce/B 4 KiB'``."""
    out: Dict[str, List[str]] = {}
    for row in collectives.itertuples():
        if row.consumer is not None and isinstance(row.consumer, str):
            out.setdefault(row.consumer, []).append(f"{row.collective}/{row.phase} {fmt_bytes(row.bytes_per_device)}")
    return {k: ", ".join(v) for k, v in out.items()}


def op_rows(plan: "Plan") -> pd.DataFrame:
    """``plan.ops`` with the collectives into each op, in the view's column order."""
    ops = plan.ops.copy()
    into = collectives_in(plan.collectives)
    ops["collectives_in"] = [into.get(name, "") for name in ops.name]
    ops["split"] = ops.split.fillna("replicated")
    return ops[OP_VIEW_COLUMNS]


def collective_rows(plan: "Plan") -> pd.DataFrame:
    """``plan.collectives`` with the module of each edge's consumer (or producer)."""
    coll = plan.collectives.copy()
    module_of = dict(zip(plan.ops.name, plan.ops.module))
    coll["module"] = [module_of.get(c) or module_of.get(p) or "" for c, p in zip(coll.consumer, coll.producer)]
    return coll[COLLECTIVE_VIEW_COLUMNS]


def module_choices(modules: pd.Series) -> List[str]:
    """Every module path and each of its ancestors (``blocks``, ``blocks.0``, ``blocks.0.attn``)."""
    paths = set()
    for m in modules.dropna():
        parts = str(m).split(".")
        paths.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if parts[0])
    return sorted(paths, key=lambda p: [(0, int(x), "") if x.isdigit() else (1, 0, x) for x in p.split(".")])


def in_module(frame: pd.DataFrame, module: Optional[str]) -> pd.DataFrame:
    """Rows whose module is ``module`` or inside it."""
    if not module or module == ALL_MODULES:
        return frame
    m = frame.module.fillna("")
    return frame[(m == module) | m.str.startswith(module + ".")]


def _sort_key(value) -> str:
    """What the saved table's script sorts by: numbers as numbers, everything else as text."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
        return json.dumps(float(value))
    return json.dumps(str(value))


def table_html(frame: pd.DataFrame, table_class: str, limit: int = MAX_ROWS,
               contexts: Optional[Dict[str, str]] = None) -> str:
    """A plain ``<table>``: formatted cells, each with its raw value in ``data-v`` for sorting
    (``contexts``: the plan's ``parallel_splits``, for the ``split`` cells)."""
    contexts = contexts or {}
    head = "".join(f"<th data-col='{c}'>{ascii_html(c)}</th>" for c in frame.columns)
    rows = []
    for values in frame.head(limit).itertuples(index=False):
        cells = []
        row = dict(zip(frame.columns, values))
        for col, v in row.items():
            if col == "split" and "op" in row:
                text = split_text(None if v == "replicated" else v, row["op"], contexts.get(row.get("name")))
            else:
                text = FORMATTERS[col](v) if col in FORMATTERS else ("" if v is None or v != v else v)
            cells.append(f"<td data-v='{ascii_html(_sort_key(v))}'>{ascii_html(text)}</td>")
        rows.append(f"<tr data-module='{ascii_html(values[frame.columns.get_loc('module')] or '')}'>"
                    f"{''.join(cells)}</tr>")
    more = (f"<p class='nbs-more'>{len(frame) - limit} more rows not shown: filter by module.</p>"
            if len(frame) > limit else "")
    return f"<table class='{table_class}'><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>{more}"


STYLE = ("<style>.nbs-plan table{border-collapse:collapse;font:12px monospace}"
         ".nbs-plan th{position:sticky;top:0;background:#eee;cursor:pointer;text-align:left;padding:2px 6px}"
         ".nbs-plan td{border-top:1px solid #ddd;padding:1px 6px;white-space:nowrap}"
         ".nbs-plan .nbs-scroll{max-height:480px;overflow:auto}</style>")

SCRIPT = """<script>(function(root){
function sortBy(table, i){var body=table.tBodies[0];var rows=Array.from(body.rows);
 var dir=table.dataset.col==i&&table.dataset.dir=='1'?-1:1;table.dataset.col=i;table.dataset.dir=dir;
 rows.sort(function(a,b){var x=JSON.parse(a.cells[i].dataset.v),y=JSON.parse(b.cells[i].dataset.v);
  return (x<y?-1:x>y?1:0)*dir;});rows.forEach(function(r){body.appendChild(r);});}
root.querySelectorAll('table').forEach(function(t){Array.from(t.tHead.rows[0].cells).forEach(function(th,i){
 th.addEventListener('click',function(){sortBy(t,i);});});});
var pick=root.querySelector('select.nbs-module');pick.addEventListener('change',function(){var m=pick.value;
 root.querySelectorAll('tbody tr').forEach(function(r){var rm=r.dataset.module;
  r.style.display=(!m||rm==m||rm.indexOf(m+'.')==0)?'':'none';});});
})(document.currentScript.parentElement);</script>"""


class PlanView(View):
    """The ops and the collectives of a plan, sortable, filtered by module.

    >>> view = PlanView(plan)                      # doctest: +SKIP
    >>> view.module.value = "blocks.0.attn"        # doctest: +SKIP
    >>> view.shown_ops                             # the rows the table shows, a DataFrame  # doctest: +SKIP
    """

    def __init__(self, plan: "Plan", measured: Optional[Measured] = None, *, limit: int = MAX_ROWS) -> None:
        super().__init__(plan, measured=measured)
        self.limit = limit
        self.module = widgets.Dropdown(description="module", options=[ALL_MODULES])
        self.table = widgets.ToggleButtons(options=["ops", "collectives"], value="ops")      # experts: _redraw
        self.sort = widgets.Dropdown(description="sort by", options=OP_VIEW_COLUMNS, value="id")
        self.descending = widgets.ToggleButton(value=False, description="descending", icon="sort")
        self.html = widgets.HTML()
        self._quiet = False                 # set while the view itself changes its controls
        for control in (self.module, self.table, self.sort, self.descending):
            control.observe(self._refresh, names="value")
        self.glossary = widgets.HTML()
        self.widget = widgets.VBox([self.glossary, widgets.HBox([self.table, self.module, self.sort, self.descending]),
                                    self.html])
        self._redraw()

    def _redraw(self) -> None:
        self.ops = op_rows(self.plan)
        self.collectives = collective_rows(self.plan)
        self.experts = expert_rows(self.plan)
        self.contexts = parallel_splits(self.plan.graph)
        self.table.options = ["ops", "collectives"] + (["experts"] if len(self.experts) else [])
        self.glossary.value = glossary_html(self.ops, self.contexts)
        keep = self.module.value
        choices = [ALL_MODULES] + module_choices(self.ops.module)
        self._quiet = True
        try:
            self.module.options = choices
            self.module.value = keep if keep in choices else ALL_MODULES
        finally:
            self._quiet = False
        self._refresh()

    def _refresh(self, _change=None) -> None:
        if self._quiet:
            return
        columns = {"ops": OP_VIEW_COLUMNS, "collectives": COLLECTIVE_VIEW_COLUMNS}.get(self.table.value, EXPERT_COLUMNS)
        if list(self.sort.options) != columns:
            self._quiet = True
            try:
                self.sort.options = columns
                self.sort.value = columns[0]
            finally:
                self._quiet = False
        self.html.value = STYLE + f"<div class='nbs-plan'><div class='nbs-scroll'>{self._shown_html()}</div></div>"

    @property
    def shown(self) -> pd.DataFrame:
        """The rows the live table shows: the chosen table, filtered and sorted."""
        frame = {"ops": self.ops, "collectives": self.collectives}.get(self.table.value, self.experts)
        frame = in_module(frame, self.module.value)
        key = self.sort.value
        order = frame[key].map(lambda v: v if isinstance(v, (int, float)) else str(v))
        return frame.iloc[order.argsort(kind="stable")[::-1 if self.descending.value else 1]]

    def _shown_html(self) -> str:
        name = f"nbs-{self.table.value}"
        return table_html(self.shown, name, self.limit, self.contexts)

    def fingerprint(self) -> Optional["Fingerprint"]:
        """The plan's ops and collectives, which this view shows."""
        from nbscaler.planning.fingerprint import of_frames
        return of_frames(self.plan.ops, self.plan.collectives)

    def to_html(self) -> str:
        options = "".join(f"<option value='{ascii_html(m)}'>{ascii_html(m)}</option>"
                          for m in module_choices(self.ops.module))
        title = ascii_html(repr(self.plan))
        return (f"{STYLE}<div class='nbs-view nbs-plan'>{glossary_html(self.ops, self.contexts)}<b>{title}</b><br>"
                f"<label>module <select class='nbs-module'><option value=''>{ALL_MODULES}</option>{options}"
                f"</select></label> <small>click a header to sort</small>"
                f"<h4>ops ({len(self.ops)})</h4><div class='nbs-scroll'>"
                f"{table_html(self.ops, 'nbs-ops', self.limit, self.contexts)}</div>"
                f"<h4>collectives ({len(self.collectives)})</h4><div class='nbs-scroll'>"
                f"{table_html(self.collectives, 'nbs-collectives', self.limit)}</div>"
                f"{self._experts_html()}{SCRIPT}</div>")

    def _experts_html(self) -> str:
        """The experts table of the saved view (nothing for a plan without routed experts)."""
        if self.experts.empty:
            return ""
        return (f"<h4>experts ({len(self.experts)}: routed-experts ops by device)</h4><div class='nbs-scroll'>"
                f"{table_html(self.experts, 'nbs-experts', self.limit)}</div>")
