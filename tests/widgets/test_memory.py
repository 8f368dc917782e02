"""MemoryView: the predicted bars are plan.memory()'s numbers; measured bars and the gap come from a run."""

import pytest
import torch

from nbscaler.columns import MEMORY_CATEGORIES, SummaryColumn as C
from nbscaler.widgets import Measured, MemoryView
from nbscaler.widgets.memory import LABELS, MEASURED, PREDICTED
from nbscaler.widgets.palette import MEMORY_COLOURS
from nbscaler.widgets.plotting import PLOTLY_MIME
from nbscaler.widgets.formats import fmt_bytes
from tests.widgets.compiled import gpt_pipeline_run, llama_pp, llama_tp, shown_figure
from tests.widgets.offline import external_resources
from tests.widgets.svg import charts, hint, marks, texts


def bars(view, side):
    """kind label -> {rank label: bytes} of one side's bars, read off the figure."""
    out = {}
    for trace in view.figure.data:
        ranks, sides = trace.x
        out.setdefault(trace.name, {}).update({r: y for r, s, y in zip(ranks, sides, trace.y) if s == side})
    return {k: v for k, v in out.items() if v}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return gpt_pipeline_run(str(tmp_path_factory.mktemp("gen")))


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW])
def test_predicted_bars_are_the_cost_models_numbers(optimizer):
    plan = llama_tp()
    view = MemoryView(plan, optimizer=optimizer)
    expected = plan.memory(optimizer)
    drawn = bars(view, PREDICTED)
    for kind in MEMORY_CATEGORIES:
        assert drawn[LABELS[kind]] == {f"rank {r}": v for r, v in zip(expected[str(C.RANK)], expected[str(kind)])}
    assert view.gap is None and bars(view, MEASURED) == {}
    assert "predicted peak" in view.gap_table


def test_measured_beside_predicted_with_the_gap(run):
    plan, _, memory = run
    view = MemoryView(plan, Measured(memory=memory), optimizer=torch.optim.AdamW)
    predicted = plan.memory(torch.optim.AdamW)
    assert bars(view, MEASURED)[LABELS[C.ACTIVATION_BYTES]] == {"rank 0": memory.activation_bytes[0]}
    gap = view.gap.iloc[0]
    kinds = [str(k) for k in MEMORY_CATEGORIES]
    assert gap.predicted_bytes == predicted[kinds].sum(axis=1)[0]
    assert gap.measured_bytes == memory[kinds].sum(axis=1)[0]
    assert gap.gap_pct == pytest.approx(100 * (gap.measured_bytes - gap.predicted_bytes) / gap.predicted_bytes)
    assert f"{gap.gap_pct:+.1f}%" in view.gap_table
    # the cost model and the meter count the same storages on this model
    assert abs(gap.gap_pct) < 5


def test_measured_with_fewer_kinds_compares_what_both_have():
    plan = llama_tp()
    predicted = plan.memory()
    cluster_rows = predicted[["rank", "param_bytes", "grad_bytes"]].assign(param_bytes=lambda f: f.param_bytes * 2)
    view = MemoryView(plan, Measured(memory=cluster_rows))
    assert set(bars(view, MEASURED)) == {LABELS[C.PARAM_BYTES], LABELS[C.GRAD_BYTES]}
    p, g = predicted.param_bytes[0], predicted.grad_bytes[0]
    assert view.gap.gap_pct[0] == pytest.approx(100 * p / (p + g))
    assert view.gap.kinds[0] == "parameters, gradients"


def test_update_redraws_the_live_widget_in_place():
    view = MemoryView(llama_tp())
    box = view.widget
    assert len(shown_figure(box)["data"]) == len(MEMORY_CATEGORIES)
    view.update(measured=Measured(memory=llama_tp().memory()))
    assert view.widget is box and len(shown_figure(box)["data"]) == 2 * len(MEMORY_CATEGORIES)
    assert (view.gap.gap_pct == 0).all() and "+0.0%" in box.children[1].value
    view.update(llama_pp())                          # a new plan drops the old plan's measurements
    live = shown_figure(box)
    assert view.gap is None and len(live["data"]) == len(MEMORY_CATEGORIES)
    assert live["data"][0]["x"][0] == ["rank 0", "rank 1"]
    assert live["layout"]["title"]["text"] == view.figure.layout.title.text


def test_saved_html_draws_offline():
    view = MemoryView(llama_tp())
    page = view.to_html()
    assert "Plotly.newPlot" in page and len(page) > 1_000_000             # plotly.js inlined
    assert external_resources(page) == []
    assert len(view.to_html(include_plotlyjs=False)) < 100_000


def test_the_saved_form_stacks_each_ranks_kinds_as_svg_predicted_beside_measured():
    plan = llama_tp()
    predicted = plan.memory()
    measured = predicted[["rank", "param_bytes", "grad_bytes"]].assign(param_bytes=lambda f: f.param_bytes * 2)
    view = MemoryView(plan, Measured(memory=measured))
    bundle = view._repr_mimebundle_()
    assert PLOTLY_MIME in bundle and "<script" not in bundle["text/html"]
    (chart,) = charts(bundle["text/html"])
    segments = marks(chart, "rect", "nbs-bar")
    kinds = [str(k) for k in MEMORY_CATEGORIES]
    assert len(segments) == 4 * (len(kinds) + 2)                  # 4 ranks: every kind predicted, 2 measured
    scale = float(segments[0].get("height")) / predicted.param_bytes[0]
    for rank in range(4):
        for side, frame, shown in ((PREDICTED, predicted, kinds), (MEASURED, measured, kinds[:2])):
            for kind in shown:
                value = frame.loc[frame["rank"] == rank, kind].iloc[0]
                want = f"rank {rank}, {LABELS[kind]} ({side}): {fmt_bytes(value)}"
                (segment,) = [s for s in segments if hint(s) == want]
                assert segment.get("fill") == MEMORY_COLOURS[kind]
                assert float(segment.get("height")) == pytest.approx(value * scale, abs=0.15)
    figure_colours = {trace.name: trace.marker.color for trace in view.figure.data}
    assert figure_colours == {LABELS[k]: MEMORY_COLOURS[k] for k in kinds}    # one palette for both
    words = texts(chart)
    assert {f"rank {r}" for r in range(4)} <= set(words) and words.count(MEASURED) == 4
    assert {LABELS[k] for k in kinds} <= set(words) and view._title() in words
