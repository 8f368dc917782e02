"""MemoryView: the predicted bars are plan.memory()'s numbers; measured bars and the gap come from a run."""

import html

import pytest
import torch

from nbscaler import Hardware
from nbscaler.columns import MEMORY_CATEGORIES, SummaryColumn as C
from nbscaler.widgets import Measured, MemoryView
from nbscaler.widgets.memory import LABELS, MEASURED, PREDICTED, capacity_note
from nbscaler.widgets.palette import MEMORY_COLOURS, OVER_CAPACITY_COLOUR
from nbscaler.widgets.plotting import PLOTLY_MIME
from nbscaler.widgets.formats import fmt_bytes
from tests.widgets.compiled import gpt_on_meta_pp, llama_pp, llama_tp, shown_figure
from tests.widgets.offline import external_resources
from tests.widgets.svg import charts, hint, marks, texts


def positions(x):
    """(rank labels, side labels) of a trace's bars: a prediction alone has ranks only."""
    if len(x) == 2 and not isinstance(x[0], str):
        return x
    return x, [PREDICTED] * len(x)


def bars(view, side):
    """kind label -> {rank label: bytes} of one side's bars, read off the figure."""
    out = {}
    for trace in view.figure.data:
        ranks, sides = positions(trace.x)
        out.setdefault(trace.name, {}).update({r: y for r, s, y in zip(ranks, sides, trace.y) if s == side})
    return {k: v for k, v in out.items() if v}


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
    assert list(live["data"][0]["x"]) == ["rank 0", "rank 1"]          # no side's label under a prediction alone
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
        for side, frame, shown in ((PREDICTED, predicted, kinds), (MEASURED, measured, ["param_bytes", "grad_bytes"])):
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


# -- on a target ---------------------------------------------------------------------------------
T4, H100 = Hardware.named("T4"), Hardware.named("H100-SXM-80GB")


def alert_edges(view):
    """rank label -> the edge colour of that rank's predicted bar in each trace of the figure."""
    out = {}
    for trace in view.figure.data:
        if trace.type != "bar" or trace.hoverinfo == "skip":      # the legend's own swatches: bars of zero
            continue
        ranks, sides = positions(trace.x)
        for r, s, colour, width in zip(ranks, sides, trace.marker.line.color, trace.marker.line.width):
            if s == PREDICTED and width:
                out.setdefault(r, set()).add(colour)
    return out


def test_a_plan_that_does_not_fit_a_t4_is_red_on_it_and_not_on_an_h100():
    plan = gpt_on_meta_pp()
    summary = plan.summary(torch.optim.AdamW, hardware=H100)
    view = MemoryView(plan, optimizer=torch.optim.AdamW, hardware=T4)
    peak = view.predicted.set_index("rank").peak_bytes
    assert peak[0] > T4.memory_bytes > peak[1]                    # the first stage does not fit, the second does
    assert view.over_capacity == {0} and alert_edges(view) == {"rank 0": {OVER_CAPACITY_COLOUR}}
    # the one test of fitting: the summary's column on the T4 says the same
    on_t4 = plan.summary(torch.optim.AdamW, hardware=T4)
    assert view.over_capacity == set(on_t4["rank"][~on_t4.fits])
    (line,) = [s for s in view.figure.layout.shapes if s.type == "line"]
    assert line.y0 == line.y1 == T4.memory_bytes
    (marker,) = [t for t in view.figure.data if t.type == "scatter"]
    assert list(positions(marker.x)[0]) == ["rank 0"] and list(marker.y) == [peak[0]]
    note = f"1 of 2 ranks fit in {fmt_bytes(16e9)} (T4); the largest, rank 0, exceeds it by {fmt_bytes(peak[0] - 16e9)}"
    assert any(note in a.text for a in view.figure.layout.annotations)
    swatches = [t for t in view.figure.data if t.showlegend is not False and t.type == "bar"]
    assert all(t.hoverinfo == "skip" for t in swatches)
    assert [t.marker.color for t in swatches] == [MEMORY_COLOURS[k] for k in MEMORY_CATEGORIES]
    assert all(t.marker.line.width == 0 and list(t.y) == [0] for t in swatches)   # no kind looks edged in red
    assert view._title().endswith("AdamW on T4")

    fine = MemoryView(plan, optimizer=torch.optim.AdamW, hardware=H100)
    assert summary.fits.all() and fine.over_capacity == set() and alert_edges(fine) == {}
    assert any("2 of 2 ranks fit in" in a.text and "uses" in a.text for a in fine.figure.layout.annotations)
    assert not [t for t in fine.figure.data if t.type == "scatter" and len(positions(t.x)[0])]


def test_the_saved_svg_draws_the_capacity_at_its_height_and_the_red_edge():
    plan = gpt_on_meta_pp()
    view = MemoryView(plan, optimizer=torch.optim.AdamW, hardware=T4)
    (chart,) = charts(view.notebook_html())
    predicted = view.predicted.set_index("rank")
    segments = marks(chart, "rect", "nbs-bar")
    rank0 = [s for s in segments if hint(s).startswith("rank 0,")]
    base = max(float(s.get("y")) + float(s.get("height")) for s in segments)          # the zero line
    scale = (base - min(float(s.get("y")) for s in rank0)) / predicted.peak_bytes[0]  # pixels per byte
    (limit,) = marks(chart, "line", "nbs-limit")
    assert float(limit.get("y1")) == float(limit.get("y2")) == pytest.approx(base - T4.memory_bytes * scale, abs=0.2)
    (edge,) = marks(chart, "rect", "nbs-alert")
    assert edge.get("stroke") == OVER_CAPACITY_COLOUR and edge.get("fill") == "none"
    assert edge.get("x") == rank0[0].get("x")                                        # around rank 0's bar
    assert float(edge.get("height")) == pytest.approx(predicted.peak_bytes[0] * scale, abs=0.3)
    words = texts(chart)
    assert capacity_note(view.predicted, T4) in [html.unescape(w) for w in words]
    assert f"T4 capacity {fmt_bytes(T4.memory_bytes)}" in words
    # without hardware nothing of it is drawn
    (plain,) = charts(MemoryView(plan, optimizer=torch.optim.AdamW).notebook_html())
    assert not marks(plain, "line", "nbs-limit") and not marks(plain, "rect", "nbs-alert")


def test_the_axis_and_the_capacity_line_read_in_one_unit_binary_bytes():
    """plotly's own '.3s' ticks wrote 80.0GB where the capacity line said 74.5 GiB: the axis now
    ticks round numbers of GiB, written as the line, the hover texts and the saved SVG write bytes."""
    plan = gpt_on_meta_pp()
    view = MemoryView(plan, optimizer=torch.optim.AdamW, hardware=H100)
    axis = view.figure.layout.yaxis
    assert axis.tickformat is None and axis.ticksuffix is None and "GiB = 2^30 bytes" in axis.title.text
    assert list(axis.ticktext) == [fmt_bytes(v) for v in axis.tickvals]
    assert all(t.endswith(" GiB") for t in axis.ticktext[1:]) and axis.ticktext[0] == "0 B"
    assert all((v / 2 ** 30) == round(v / 2 ** 30) for v in axis.tickvals)           # whole GiB, steps of 20
    assert axis.tickvals[-1] >= H100.memory_bytes and axis.range[1] >= axis.tickvals[-1]   # the line is on it
    line = [a.text for a in view.figure.layout.annotations if "capacity" in a.text]
    assert line == [f"H100-SXM-80GB capacity {fmt_bytes(H100.memory_bytes)}"] and line[0].endswith("GiB")
    (chart,) = charts(view.notebook_html())
    assert any("GiB = 2^30 bytes" in w for w in texts(chart))
    small = MemoryView(llama_tp()).figure.layout.yaxis                # without a target: the unit of its bars
    assert all(t.endswith((" KiB", " MiB")) for t in small.ticktext[1:])


def test_the_saved_chart_draws_its_axis_title_whole():
    """The y-axis title ended at the plot's left edge and ran off the picture (it showed as
    'iB = 2^30 bytes)'): it now starts inside the chart and ends before its right edge."""
    from nbscaler.widgets.svgchart import text_width

    (chart,) = charts(MemoryView(llama_tp()).notebook_html())
    width = float(chart.get("viewBox").split()[2]) if chart.get("viewBox") else float(chart.get("width"))
    (title,) = [t for t in chart.iter() if t.tag.endswith("text") and "GiB = 2^30 bytes" in (t.text or "")]
    size, x = float(title.get("font-size")), float(title.get("x"))
    start = x - text_width(title.text, size) if title.get("text-anchor") == "end" else x
    assert 0 <= start and start + text_width(title.text, size) <= width, (start, width)
