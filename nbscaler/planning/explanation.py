"""``Plan.explain()``: what the policy did and, for autodist, why, as text with a table behind it.

For a built-in policy: the share of FLOPs it split, the heaviest ops, the collectives and the modules
recomputed in the backward (``recompute_modules``). For
autodist, also the search (time, exact or not, the staging it picked), the predicted step time and
memory per device, the ops that cost most in compute and in communication, and for the layers that
matter most, the choice against the runner-up in the terms that decided it. For autodist on a
target, the configuration it chose against the runners-up (``planning.target_explanation``).
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, List

import pandas as pd

from nbscaler.planning.tables import explain_text
from nbscaler.planning.target_explanation import explain_lines
from nbscaler.policy.autodist.explain import reason
from nbscaler.policy.recompute import recomputed_regions
from nbscaler.policy.staging import layer_of
from nbscaler.units import unit_formatters

if TYPE_CHECKING:
    from nbscaler.planning.planner import Plan


class Explanation(str):
    """The explanation's text (print it); ``.table`` holds its figures, one row per op."""

    table: pd.DataFrame

    def __new__(cls, text: str, table: pd.DataFrame) -> "Explanation":
        self = super().__new__(cls, text)
        self.table = table
        return self

    def _repr_html_(self) -> str:
        text = html.escape(str(self), quote=False).replace("\n", "<br>")
        return (f"<div style='font-family:monospace'>{text}</div>" +
                self.table.head(20).to_html(formatters=unit_formatters(self.table)))


def explain(plan: "Plan", top: int = 5) -> Explanation:
    info = plan.graph.meta.get("autodist")
    if info is None:
        table = plan.ops.nlargest(top * 4, "flops_fwd")[["name", "module", "op", "split", "devices", "flops_fwd"]]
        return Explanation("\n".join([explain_text(plan)] + recompute_lines(plan) + assumed_text(plan)),
                           table.reset_index(drop=True))
    if "target" in info:
        lines = [explain_text(plan)] + recompute_lines(plan) + [""] + explain_lines(info["target"])
        return Explanation("\n".join(lines), pd.DataFrame([info["target"]["chosen"], *info["target"]["runners_up"]]))
    rows = pd.DataFrame(info["rows"])
    lines = [explain_text(plan)] + recompute_lines(plan) + ["", _search_line(info)]
    summary = plan.summary()
    lines.append("predicted per device: step " + ", ".join(f"{t:.3g} s" for t in summary.step_time_s.round(6)) +
                 "; peak memory " + ", ".join(f"{b / 2**20:.3g} MiB" for b in summary.peak_bytes))
    lines += assumed_text(plan)
    lines += _top(rows, "op_s", "compute", top) + _top(rows, "comm_s", "communication", top)
    lines.append("the layers that cost most, and the choice for their heaviest op against the runner-up:")
    rows["layer"] = rows.module.map(layer_of)
    rows["cost_s"] = rows.op_s + rows.comm_s
    for layer, group in rows.groupby("layer", sort=False).cost_s.sum().nlargest(top).items():
        heaviest = rows.loc[rows[rows.layer == layer].cost_s.idxmax()]
        lines.append(f"  {layer or 'top level'} ({group * 1e3:.3g} ms): {heaviest['name']} ({heaviest['op']}) "
                     f"{reason(heaviest)}")
    return Explanation("\n".join(lines), rows.drop(columns=["layer", "cost_s"]))


def assumed_text(plan: "Plan") -> List[str]:
    """What a prediction of the plan on this machine assumes (``plan.assumed()``), one line each."""
    return ["assumed by predictions on this machine:"] + [f"  {line}" for line in plan.assumed()]


def recompute_lines(plan: "Plan", most: int = 6) -> List[str]:
    """The modules recomputed in the backward, and the most their rebuild holds at once (or nothing)."""
    regions = list(recomputed_regions(plan.graph))
    if not regions:
        return []
    shown = ", ".join(regions[:most]) + (f", ... ({len(regions)} in all)" if len(regions) > most else "")
    line = (f"recomputed in the backward: {shown}. Each keeps only its inputs for the backward and runs its "
            "forward again there")
    runs = plan.local_runs or {}
    rebuilt = max((b for stages in runs.values() for run in stages.values() for b in run.rebuilt.values()), default=0)
    if rebuilt:
        line += f"; rebuilding one holds up to {rebuilt / 2**20:.3g} MiB more while its backward runs"
    return [line + "."]


#: What a kept built-in placement does that the op-by-op search does not.
_WHY_KEPT = {"tp": "it splits fused projections by heads, a strided split the search does not make",
             "data": "it splits the batch through every op, which the search weighs one edge at a time"}


def _search_line(info) -> str:
    how = "exact" if info["exact"] else f"the best of up to {info['states']} partial plans kept per op"
    line = f"autodist searched in {info.get('search_s', 0):.2f} s ({how})"
    if info.get("unit_scores"):
        tried = ", ".join(f"{d}: {t * 1e3:.3g} ms" for d, t in info["unit_scores"].items())
        line += (f"; chose units of {info['plan_ngpus']} device(s), the fastest "
                 f"predicted per sample (devices per unit: step time per sample {tried})")
    if info.get("staging") and info["staging"] != "none":
        line += f"; stages cut by {info['staging']} (of {', '.join(info['stagings'])}, by the schedule simulator)"
    if info.get("kept", "search") != "search":
        scores = info["rival_scores"]
        line += (f"; kept {info['kept']}'s placement, predicted at {scores[info['kept']] * 1e3:.3g} ms a step "
                 f"against the search's {scores['search'] * 1e3:.3g} ms ({_WHY_KEPT[info['kept']]}; the table "
                 "below is the search's)")
    if info.get("chose_recompute"):
        line += (f"; no plan fit the memory limit without recomputation, so it recomputes every layer of "
                 f"{', '.join(info['chose_recompute'])}")
    if info.get("memory_limit_bytes"):
        line += (f"; memory limit {info['memory_limit_bytes'] / 2**20:.4g} MiB, predicted peak "
                 f"{info['peak_bytes'] / 2**20:.4g} MiB")
    return line + "."


def _top(rows: pd.DataFrame, column: str, what: str, top: int) -> List[str]:
    worst = rows[rows[column] > 0].nlargest(top, column)
    if worst.empty:
        return [f"no {what} to speak of."]
    return [f"top ops by {what}:"] + [f"  {r['name']} ({r['module'] or 'top level'}): {r[column] * 1e3:.3g} ms, "
                                      f"{r['choice']}" for _, r in worst.iterrows()]
