"""TimelineView: plan.timeline() drawn per rank (and stage), beside a measured run, with bubbles."""

import dataclasses

import pandas as pd
import pytest
import torch

import nbscaler
from nbscaler import Hardware
from nbscaler.cost import comm_model
from nbscaler.cost.comm_model import CommModel
from nbscaler.widgets import Measured, TimelineView
from nbscaler.widgets.palette import IDLE_COLOUR, PHASE_COLOURS
from nbscaler.widgets.formats import fmt_seconds
from nbscaler.widgets.plotting import PLOTLY_MIME, figure_spec
from nbscaler.widgets.timeline import TIMELINE_COLUMNS, TITLE_CHARS, bubble_per_rank, normalized, wrapped_title
from tests.models import batch, build
from tests.widgets.compiled import gpt_on_meta_pp, llama_pp, llama_tp, pipeline_config, shown_figure
from tests.widgets.offline import external_resources
from tests.widgets.svg import charts, hint, marks, texts


def drawn_blocks(figure, panel_row):
    """(y label, text) of every bar drawn in one panel (1: predicted, 2: measured)."""
    axis = "y" if panel_row == 1 else f"y{panel_row}"
    return sorted((y, t) for trace in figure.data if trace.yaxis == axis for y, t in zip(trace.y, trace.text))


def test_pipeline_rows_are_rank_and_stage_with_every_block():
    plan = llama_pp()
    view = TimelineView(plan)
    line = plan.timeline()
    expected = pd.DataFrame(line.to_rows(), columns=TIMELINE_COLUMNS)
    pd.testing.assert_frame_equal(view.predicted, normalized(expected))
    blocks = drawn_blocks(view.figure, 1)
    assert len(blocks) == len(expected) == 2 * 2 * 4              # 2 ranks x F,B x 4 micro-batches
    assert {y for y, _ in blocks} == {"rank 0 · stage 0", "rank 1 · stage 1"}
    assert {t for _, t in blocks} == {f"{p}{m}" for p in "FB" for m in range(4)}
    colours = {trace.name: trace.marker.color for trace in view.figure.data}
    assert colours["forward"] != colours["backward"]
    # per-rank bubbles average to the timeline's own bubble fraction
    assert view.bubbles.predicted.mean() == pytest.approx(line.bubble_fraction)
    assert view.bubbles.predicted[0] > 0 and "bubble, predicted" in view.bubble_table


def test_priced_on_a_target_the_view_draws_the_targets_timeline(monkeypatch):
    """``hardware=`` prices every op by its roofline there: nothing is profiled on this machine."""
    from nbscaler import Hardware
    from nbscaler.cost import timing
    plan, hw = llama_pp(), Hardware.named("H100-SXM-80GB")
    monkeypatch.setattr(timing, "profiler_for", lambda *a, **k: pytest.fail("profiled ops on this machine"))
    view = TimelineView(plan, hardware=hw)
    expected = pd.DataFrame(plan.timeline(hardware=hw).to_rows(), columns=TIMELINE_COLUMNS)
    pd.testing.assert_frame_equal(view.predicted, normalized(expected))
    assert view.assumptions.startswith("Predicted on H100-SXM-80GB (1 node(s) of 8 GPUs): op times from a roofline")


@pytest.mark.slow
def test_assumptions_are_stated_on_the_figure():
    view = TimelineView(llama_pp())
    text = view.figure.layout.annotations[-1].text
    assert "op times profiled" in text and "alpha-beta" in text and "Slowest ops" in text
    assert "stage 0 F" in text and "stage 1 B" in text


def test_assumptions_say_what_starting_a_send_costs(monkeypatch):
    calibrated = CommModel(alpha_s=1e-3, beta_s_per_byte=1e-9, calibrated=True, p2p_alpha_s=2e-4, p2p_post_s=2.5e-4)
    monkeypatch.setattr(comm_model, "load", lambda backend=None, nranks=2: calibrated)
    text = TimelineView(llama_pp()).figure.layout.annotations[-1].text
    assert "starting a send or a receive takes its rank 250 µs" in text
    assert "starting a send" not in TimelineView(llama_tp()).figure.layout.annotations[-1].text   # no pipeline


def test_without_a_pipeline_one_forward_and_backward_per_rank():
    view = TimelineView(llama_tp())
    blocks = drawn_blocks(view.figure, 1)
    computed = [(y, t) for y, t in blocks if not y.endswith("collectives")]
    assert computed == sorted((f"rank {r}", t) for r in range(4) for t in ("F0", "B0"))
    # two units: each rank sums its gradients with the other unit's after the backward (one bucket)
    assert [(y, t) for y, t in blocks if y.endswith("collectives")] == [(f"rank {r} · collectives", "bucket 0")
                                                                          for r in range(4)]
    assert (view.bubbles.predicted == 0).all()


@pytest.mark.slow                      # prices the run on this CPU: profiles the GPT's ops first
def test_measured_run_on_the_same_axis(run):
    plan, measured, _ = run
    view = TimelineView(plan, Measured(timeline=measured))
    assert len(view.figure.layout.annotations) >= 3                    # two panel titles and the assumptions
    assert view.figure.layout.xaxis.matches == "x2" or view.figure.layout.xaxis2.matches == "x"
    assert drawn_blocks(view.figure, 2) == [("rank 0 · stage 0", t) for t in ("B0", "B1", "F0", "F1")]
    span = measured.t_end.max() - measured.t_start.min()
    assert view.measured_frame.t_start.min() == 0 and view.measured_frame.t_end.max() == pytest.approx(span)
    busy = (measured.t_end - measured.t_start).sum()
    assert view.bubbles.measured[0] == pytest.approx(1 - busy / span)
    assert "bubble, measured" in view.bubble_table


def test_a_measured_panel_beside_predicted_collectives_draws_no_collectives_lane():
    plan, h100 = llama_tp(), Hardware.named("H100-SXM-80GB")
    measured = pd.DataFrame(plan.timeline(h100).to_rows())
    view = TimelineView(plan, Measured(timeline=measured), hardware=h100)   # on a target: the buckets drawn
    assert len(view.collectives) > 0
    svg = view.svg()                                   # the saved form draws both panels
    assert svg.count(">rank 0 &#183; collectives<") == 1 and "measured" in svg     # the lane's label, once


def test_cluster_telemetry_of_several_steps_draws_the_last():
    rows = pd.DataFrame(llama_pp().timeline().to_rows())
    steps = pd.concat([rows.assign(step=s, t_start=rows.t_start + 100 * s, t_end=rows.t_end + 100 * s)
                       for s in range(3)])
    frame = normalized(steps)
    assert len(frame) == len(rows) and frame.t_start.min() == 0
    assert bubble_per_rank(frame, 2).tolist() == pytest.approx(bubble_per_rank(normalized(rows), 2).tolist())


def test_update_redraws_in_place_and_saves_offline():
    view = TimelineView(llama_pp())
    box = view.widget
    view.update(measured=Measured(timeline=pd.DataFrame(llama_pp().timeline().to_rows())))
    assert view.widget is box and {t["yaxis"] for t in shown_figure(box)["data"]} == {"y", "y2"}
    assert "bubble, measured" in box.children[1].value
    view.update(llama_tp())
    assert {t["yaxis"] for t in shown_figure(box)["data"]} == {"y"} and "measured" not in view.bubbles
    page = view.to_html()
    assert external_resources(page) == [] and "Plotly.newPlot" in page and "rank 3" in page


def test_the_saved_form_draws_every_block_and_bubble_as_svg_beside_plotlys_figure():
    plan = llama_pp()
    view = TimelineView(plan, Measured(timeline=pd.DataFrame(plan.timeline().to_rows())))
    bundle = view._repr_mimebundle_()
    assert bundle[PLOTLY_MIME]["data"] == figure_spec(view.figure)["data"]      # live JupyterLab, no kernel
    page = bundle["text/html"]                                                 # nbconvert, nbviewer, GitHub
    assert "<script" not in page and external_resources(page) == [] and len(page) < 100_000
    (chart,) = charts(page)
    blocks = marks(chart, "rect", "nbs-block")
    assert len(blocks) == 2 * len(view.predicted) == 2 * 2 * 2 * 4            # 2 panels x ranks x F,B x micros
    assert {b.get("fill") for b in blocks if "forward" in hint(b)} == {PHASE_COLOURS["F"]}
    assert {b.get("fill") for b in blocks if "backward" in hint(b)} == {PHASE_COLOURS["B"]}
    words = texts(chart)
    assert {"rank 0 · stage 0", "rank 1 · stage 1", "forward", "backward", "idle (bubble)"} <= set(words)
    assert any(w.startswith("predicted: step") for w in words) and any(w.startswith("measured: step") for w in words)
    # each lane's grey band is its panel's step; the blocks leave uncovered exactly the rank's bubble
    bands = [r for r in marks(chart, "rect") if r.get("fill") == IDLE_COLOUR and "idle where" in hint(r)]
    assert len(bands) == 4
    lane = [b for b in blocks if hint(b).startswith("predicted rank 0 ")]
    covered = sum(float(b.get("width")) for b in lane) / float(bands[0].get("width"))
    assert covered == pytest.approx(1 - view.bubbles.predicted[0], abs=0.01)


def test_zero_bubble_weight_blocks_are_drawn_in_their_own_colour():
    cfg = pipeline_config(2).with_changes(pipeline_scheduler="zb_h1")
    plan = nbscaler.plan(build("llama"), batch("llama", 0), "pp", cfg)
    (chart,) = charts(TimelineView(plan)._repr_mimebundle_()["text/html"])
    blocks = marks(chart, "rect", "nbs-block")
    weights = [b for b in blocks if "weight gradients" in hint(b)]
    assert len(weights) == 2 * 4 and {b.get("fill") for b in weights} == {PHASE_COLOURS["W"]}   # ranks x micros
    assert "weight gradients" in texts(chart)


# -- on a target ---------------------------------------------------------------------------------
def test_on_a_target_the_timeline_is_the_targets_with_its_step_bubble_and_mfu(monkeypatch):
    from nbscaler.cost.profile import OpProfiler

    def refuse(*args, **kwargs):
        raise AssertionError("an op was profiled on this machine")
    for name in ("profile", "time", "update"):
        monkeypatch.setattr(OpProfiler, name, refuse)
    plan, hw = gpt_on_meta_pp(), Hardware.named("H100-SXM-80GB")
    view = TimelineView(plan, hardware=hw, optimizer=torch.optim.AdamW)
    line = plan.timeline(hardware=hw)
    pd.testing.assert_frame_equal(view.predicted, normalized(pd.DataFrame(line.to_rows(), columns=TIMELINE_COLUMNS)))
    summary = plan.summary(torch.optim.AdamW, hardware=hw)
    title = view._title()
    assert title == (f"Timeline of one training step: pp on H100-SXM-80GB x 8: "
                     f"step {fmt_seconds(summary.step_time_s.max())}, bubble {line.bubble_fraction:.0%}, "
                     f"MFU {summary.mfu.mean():.0%}")
    assert view.figure.layout.title.text == title.replace("x 8: step", "x 8:<br>step")   # two lines in a pane
    assert summary.step_time_s.max() > line.makespan          # the step adds the optimizer to the blocks
    assert "roofline" in view.assumptions and "profiled" not in view.assumptions
    (chart,) = charts(view.notebook_html())
    assert title in texts(chart)
    monkeypatch.undo()
    here = TimelineView(llama_pp())                            # without hardware: this machine, as before
    assert here._title() == "Timeline of one training step: pp" and "profiled" in here.assumptions


def test_a_long_target_name_wraps_the_title_into_lines_the_narrow_pane_shows():
    """In the Explorer the timeline has half the width: a long target's title was cut off on the right."""
    hw = dataclasses.replace(Hardware.named("H100-SXM-80GB", nodes=8), name="H100-SXM-80GB x 8 nodes, NDR InfiniBand")
    view = TimelineView(gpt_on_meta_pp(), hardware=hw, optimizer=torch.optim.AdamW)
    lines = view.figure.layout.title.text.split("<br>")
    assert len(lines) >= 3 and all(len(line) <= TITLE_CHARS for line in lines), lines
    assert " ".join(lines) == " ".join(view._title_parts())            # nothing dropped, words whole
    assert any(line.endswith(f"on {hw.name} x 64:") for line in lines) and lines[-1].startswith("step ")
    assert view.figure.layout.margin.t >= 22 * len(lines) + 30          # room above the plot for every line
    assert wrapped_title(["Timeline of one training step: pp"]) == "Timeline of one training step: pp"


def test_on_a_target_the_step_counts_the_master_copies_the_memory_view_counts():
    plan, hw = gpt_on_meta_pp(), Hardware.named("H100-SXM-80GB")
    plain = TimelineView(plan, hardware=hw, optimizer=torch.optim.AdamW)
    master = TimelineView(plan, hardware=hw, optimizer=torch.optim.AdamW, master_dtype=torch.float64)
    expected = plan.summary(torch.optim.AdamW, hardware=hw, master_dtype=torch.float64)
    pd.testing.assert_frame_equal(master.target, expected)
    assert master.target.step_time_s.max() > plain.target.step_time_s.max()    # wider copies: a slower step


def test_zero3_gathers_and_reduce_scatters_are_drawn_on_their_own_lane_named_with_their_unit():
    from nbscaler import ComputeConfig
    from nbscaler.ir.graph import REST_UNIT
    from nbscaler.models.gpt import GPT, GPTConfig, sample_batch
    from nbscaler.widgets.palette import COLLECTIVE_COLOURS
    model = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=64)
    plan = nbscaler.plan(GPT(model), {"batch": sample_batch(model, 2)}, "dp",
                         ComputeConfig(1, 2, use_zero=True, zero_stage=3))
    view = TimelineView(plan, hardware=Hardware.named("H100-SXM-80GB"))
    line = plan.timeline(hardware=Hardware.named("H100-SXM-80GB"))
    units = {REST_UNIT, "blocks.0", "blocks.1"}
    drawn = drawn_blocks(view.figure, 1)
    lane = [t for y, t in drawn if y == "rank 0 · collectives"]
    assert len(lane) == len([c for c in line.collectives if c.rank == 0]) == 3 + 2 + 3     # gathers, again, reduces
    assert set(lane) == units
    assert list(view.figure.layout.yaxis.categoryarray)[::-1] == ["rank 0", "rank 0 · collectives", "rank 1",
                                                                   "rank 1 · collectives"]
    (chart,) = charts(view._repr_mimebundle_()["text/html"])
    calls = [b for b in marks(chart, "rect", "nbs-block") if "of micro-batch" in hint(b) and "waits" in hint(b)]
    assert len(calls) == len(line.collectives)
    assert {b.get("fill") for b in calls if "all-gather of blocks.0" in hint(b)} == {COLLECTIVE_COLOURS["all_gather"]}
    assert {"all-gather", "reduce-scatter", "rank 1 · collectives"} <= set(texts(chart))
    assert "ZeRO stage 3" in view.assumptions and "ZeRO stage 3" not in TimelineView(llama_pp()).assumptions


def test_data_parallel_buckets_are_drawn_on_the_collectives_lane_where_the_step_prices_them():
    from nbscaler import ComputeConfig
    from nbscaler.models.gpt import GPT, GPTConfig, sample_batch
    from nbscaler.widgets.palette import COLLECTIVE_COLOURS
    model = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=64)
    plan = nbscaler.plan(GPT(model), {"batch": sample_batch(model, 2)}, "dp",
                         ComputeConfig(1, 2, reduce_bucket_bytes=8 * 2**10))
    hw = Hardware.named("H100-SXM-80GB")
    view = TimelineView(plan, hardware=hw)
    line = plan.timeline(hardware=hw)
    buckets = [c for c in line.collectives if c.rank == 0]
    assert buckets and all(c.sync and c.kind == "all_reduce" for c in buckets)
    lane = [t for y, t in drawn_blocks(view.figure, 1) if y == "rank 0 · collectives"]
    assert sorted(lane) == sorted(c.unit for c in buckets) and "bucket 0" in lane
    # what the drawing says the step waits is the exposed synchronisation the step adds
    exposed = view.collectives[view.collectives["rank"] == 0].waited_s.sum()
    assert exposed == pytest.approx(plan.step_figures(hardware=hw).devices[0].sync_s) and exposed > 0
    (chart,) = charts(view._repr_mimebundle_()["text/html"])
    drawn = [b for b in marks(chart, "rect", "nbs-block") if "all-reduce of bucket" in hint(b)]
    assert len(drawn) == len(line.collectives) and all("the step waits" in hint(b) for b in drawn)
    assert {b.get("fill") for b in drawn} == {COLLECTIVE_COLOURS["all_reduce"]}
    assert "all-reduce" in texts(chart) and "reduce-scatter" not in texts(chart)      # the kinds drawn
    assert "Gradient synchronisation" in view.assumptions and "ZeRO stage 3" not in view.assumptions
