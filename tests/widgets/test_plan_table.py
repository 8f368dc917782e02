"""PlanView: the plan's own ops and collectives, filtered by module and sorted, live and saved."""

import pytest

from nbscaler import ComputeConfig
from nbscaler.widgets import PlanView
from nbscaler.widgets.plan_table import ALL_MODULES, in_module, module_choices
from tests.widgets.compiled import llama_pp, llama_tp
from tests.widgets.offline import external_resources


@pytest.fixture(scope="module")
def view():
    return PlanView(llama_tp())


def test_tables_are_the_plans_own(view):
    plan = llama_tp()
    assert len(view.ops) == len(plan.ops) and len(view.collectives) == len(plan.collectives) > 0
    assert view.ops.flops_fwd.tolist() == plan.ops.flops_fwd.tolist()
    assert view.ops.local_out_shapes.tolist() == plan.ops.local_out_shapes.tolist()
    assert view.collectives.bytes_per_device.sum() == plan.collectives.bytes_per_device.sum()
    # the collective converting each edge is named on its consumer
    first = plan.collectives.iloc[0]
    row = view.ops.set_index("name").loc[first.consumer]
    split = plan.ops.set_index("name").loc[first.consumer].split
    assert first.collective in row.collectives_in and row.split == (split if isinstance(split, str) else "replicated")


def test_module_filter_and_sort(view):
    assert module_choices(view.ops.module)[:3] == ["blocks", "blocks.0", "blocks.0.attn"]
    view.module.value = "blocks.0.attn"
    view.sort.value, view.descending.value = "flops_fwd", True
    shown = view.shown
    expected = in_module(llama_tp().ops, "blocks.0.attn")
    assert len(shown) == len(expected) > 0 and set(shown.name) == set(expected.name)
    assert all(m == "blocks.0.attn" or m.startswith("blocks.0.attn.") for m in shown.module)
    assert shown.flops_fwd.tolist() == sorted(shown.flops_fwd, reverse=True)
    assert view.html.value.count("<tr data-module=") == len(shown)
    view.table.value = "collectives"             # the sort choices follow the table
    assert view.sort.value == "tensor" and "bytes_per_device" in view.sort.options
    assert set(view.shown.consumer) <= set(expected.name) | {None}
    view.table.value, view.module.value, view.descending.value = "ops", ALL_MODULES, False


def test_update_with_another_plan_keeps_the_module_filter():
    view = PlanView(llama_tp())
    view.module.value = "blocks.1"
    other = llama_tp().replan("dp", ComputeConfig(1, 2))
    view.update(other)
    assert view.plan is other and view.module.value == "blocks.1"
    assert set(view.ops.split) == {"replicated"} and set(view.ops.devices) == {(0,)}
    assert len(view.collectives) == len(other.collectives) and set(view.ops.collectives_in) == {""}
    view.update(llama_pp())
    assert set(view.ops.stage) == {0, 1} and "send_recv" in set(view.collectives.collective)


def test_saved_html_has_every_row_and_its_own_script(view):
    page = view.to_html()
    assert page.count("<tr data-module=") == len(view.ops) + len(view.collectives)
    assert "<script>" in page and "select class='nbs-module'" in page
    assert external_resources(page) == []
    bundle = view._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and bundle["text/html"] == page


def test_splits_and_layouts_read_by_name_and_the_glossary_comes_first():
    """The saved table writes each split and layout by its readable name with the label beside it,
    keeps the label itself in the frame (code reads it), and starts with a link to the glossary."""
    from nbscaler.glossary import GLOSSARY_URL
    from tests.widgets.compiled import llama_tp

    view = PlanView(llama_tp())
    page = view.to_html()
    assert page.index(GLOSSARY_URL) < page.index("<table")
    assert "column-parallel (n)" in page and "row-parallel, partial sums (k)" in page
    assert ">replicated<" in page and "n column-parallel" in page           # cells, and the header's names
    assert {"n", "k", "replicated"} <= set(view.ops.split)                    # the values stay labels
    if len(view.collectives):
        assert any(f"({x})<" in page for x in set(view.collectives.have) | set(view.collectives.want))
