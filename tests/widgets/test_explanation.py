"""ExplanationView without a browser: it shows ``plan.explain()`` and follows a new plan."""

from __future__ import annotations

import html

import pytest

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.widgets.explanation import ROWS, ExplanationView
from tests.models import batch, build


@pytest.mark.slow       # a second or so: make test runs it, the edit-test loop does not
def test_the_view_shows_autodists_account_and_its_costliest_choices():
    plan = nbscaler.plan(build("cnn"), batch("cnn", 0), "autodist",
                         ComputeConfig(2, 2, pas_config={"autodist_plan_ngpus": "auto"}))
    view = ExplanationView(plan, rows=6)
    assert view.text == str(plan.explain())
    assert "autodist searched in" in view.text and "chose units of" in view.text
    table = view.table
    assert len(table) == 6 < len(plan.graph) and {"choice", "runner_up", "margin_s"} <= set(table.columns)
    costs = (table.op_s + table.comm_s).tolist()
    assert costs == sorted(costs, reverse=True)                   # the costliest ops first
    full = plan.explain().table
    assert costs[0] == (full.op_s + full.comm_s).max()
    first_line = view.text.splitlines()[0]
    assert html.escape(first_line) in view.widget.value and "nbscaler-explanation-table" in view.widget.value


def test_a_new_plan_redraws_the_explanation_in_place():
    model, args = build("mlp"), batch("mlp", 0)
    searched = nbscaler.plan(model, args, "autodist", ComputeConfig(2, 2))
    view = ExplanationView(searched)
    widget = view.widget
    view.update(searched.replan("tp", ComputeConfig(2, 2)))
    assert view.widget is widget and "autodist searched in" not in widget.value
    assert "under 'tp'" in view.text and html.escape(view.text.splitlines()[0]) in widget.value
    assert len(view.table) <= ROWS
