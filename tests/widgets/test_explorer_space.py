"""The Explorer's space tab, without a browser: the sweep drawn with its front, knobs that re-price
without tracing, a click that loads the configuration's plan into the panes, bad knobs as messages."""

from __future__ import annotations

import re

import pandas as pd
import pytest
import torch

from nbscaler.space.pareto import pareto_front
from nbscaler.widgets import Explorer
from nbscaler.widgets.explorer.app import SPACE_TAB
from nbscaler.widgets.explorer.panes import ViewName
from nbscaler.widgets.palette import layout_colour
from tests.models import batch, build
from tests.widgets.svg import NS, charts, hint, marks, texts
from nbscaler.widgets.space import RIGHT, WIDTH, describe, space_svg

RANGES = dict(tp=(1, 2), pp=(1, 2), micro_batch=(1, 2), zero_stage=(1,))
GROUP = r"tp \d+ (x cp \d+ )?(x ep \d+ )?x pp \d+"    # a legend entry: ``tp 2 x pp 1``, ``tp 1 x cp 2 x pp 1``


def swept_explorer() -> Explorer:
    ex = Explorer(sweep_ranges=RANGES, optimizer_fn=torch.optim.AdamW)
    ex.space.set(global_batch=8)
    ex.sweep()
    assert ex.error is None, ex.error
    return ex


@pytest.fixture
def explorer():
    ex = swept_explorer()
    yield ex
    ex.close()


@pytest.fixture(scope="module")
def kept_explorer():
    """One Explorer for the tests of knobs it refuses, each leaving its space as it found it."""
    ex = swept_explorer()
    yield ex
    ex.close()


def test_the_sweep_is_drawn_every_configuration_a_mark_and_the_front_ringed(explorer):
    frame, svg = explorer.space.frame, explorer.space.chart.svg
    assert explorer.tabs.titles[explorer.tabs.selected_index] == SPACE_TAB
    # tp x pp x micro x recompute (none, selective, full) on 8 GPUs (21), and the 12 of tp 2 again with
    # sequence parallelism
    assert svg.count('class="nbs-point') == len(frame) == 33
    front = pareto_front(frame)
    assert svg.count("nbs-front-point") == front.sum() == len(explorer.space.front) >= 2
    assert explorer.space.front == [i for i in range(len(frame)) if front.iloc[i]]
    assert "on the Pareto front" in svg and "H100-SXM-80GB capacity 74.5 GiB" in svg
    assert "Swept 33 configurations" in explorer.status.value


@pytest.mark.slow       # seconds on its own: make test runs it, the edit-test loop does not
def test_a_knob_change_reprices_without_tracing_and_says_how_long(explorer):
    space = explorer.space.space
    traces, before = space.traces, explorer.space.frame
    explorer.space.set(hardware="A100-SXM-40GB", nodes=2, global_batch=16, precision="bf16, no master copy")
    assert explorer.error is None and space.traces == traces and explorer.space.frame is not before
    assert space.hardware.name == "A100-SXM-40GB" and space.hardware.ngpus == 16
    assert space.master_dtype is None and space.global_batch == 16
    assert (explorer.space.frame.tp * explorer.space.frame.pp * explorer.space.frame.dp == 16).all()
    assert re.search(r"Re-priced \d+ configurations on A100-SXM-40GB, 2 node\(s\) of 8 GPUs in \d+ ms "
                     r"\(from cached costs, nothing traced\)", explorer.status.value), explorer.status.value
    assert "A100-SXM-40GB x 2 node(s)" in explorer.space.chart.svg
    explorer.space.set(sequence=16)                     # new shapes: one trace per micro-batch size
    assert space.traces == traces + 2 and "traced again 2 time(s)" in explorer.status.value
    explorer.space.set(precision="fp16, fp32 master")   # a new dtype too
    assert space.module_dtype == torch.float16 and space.traces == traces + 4
    explorer.space.set(metric="MFU")
    assert "MFU, higher is better" in explorer.space.chart.svg


def test_clicking_a_point_loads_its_plan_into_the_panes(explorer):
    frame, space = explorer.space.frame, explorer.space.space
    row = explorer.space.front[-1]                  # the least memory on the front
    explorer.space.pick(row)
    assert explorer.error is None, explorer.error
    plan, chosen = explorer.plan, frame.iloc[row]
    assert plan.config.plan_ngpus == chosen.tp * chosen.pp and plan.config.runtime_ngpus == 8
    assert plan.config.pipeline_nmicros == chosen.micro_batches and plan.config.zero_stage == max(1, chosen.zero_stage)
    for name in (ViewName.GRAPH, ViewName.PLAN, ViewName.TIMELINE, ViewName.MEMORY):
        view = explorer.panes.views[name]
        assert view.plan is plan and explorer.panes.slots[name].children[0] is view.widget
    memory = explorer.panes.views[ViewName.MEMORY]
    assert memory.hardware is space.hardware and explorer.panes.views[ViewName.TIMELINE].hardware is space.hardware
    # the memory pane of the plan shows the peak the space priced for its row
    assert memory.predicted.peak_bytes.max() == pytest.approx(chosen.peak_bytes, rel=1e-9)
    assert 'class="nbs-selected"' in explorer.space.chart.svg and "Loaded:</b> tp" in explorer.space.picked.value
    assert "Loaded tp" in explorer.status.value


def test_a_sequence_parallel_point_says_so_and_loads_a_sequence_parallel_plan(explorer):
    frame = explorer.space.frame
    row = next(i for i in range(len(frame)) if frame.sequence_parallel.iloc[i])
    chosen = frame.iloc[row]
    assert "sequence parallel" in describe(chosen) and describe(chosen) in explorer.space.chart.svg
    assert not any("sequence parallel" in describe(r) for _, r in frame[~frame.sequence_parallel].iterrows())
    explorer.space.pick(row)
    assert explorer.error is None, explorer.error
    config = explorer.plan.config
    assert config.pas_config["sequence_parallel"] is True and config.plan_ngpus == 2 * chosen.pp
    memory = explorer.panes.views[ViewName.MEMORY]
    assert memory.predicted.peak_bytes.max() == pytest.approx(chosen.peak_bytes, rel=1e-9)
    assert "sequence parallel" in explorer.space.picked.value and "sequence parallel" in explorer.status.value


@pytest.mark.parametrize("knobs, message", [
    ({"nodes": 0}, "nodes=0 must be a whole number"),
    ({"global_batch": 0}, "global_batch=0"),
    ({"sequence": 0}, "sequence=0 must be a whole number of tokens"),
    ({"hardware": "T4", "precision": "bf16, fp32 master"}, "has no bfloat16 peak"),
])
def test_a_bad_knob_is_a_message_and_the_space_stays(kept_explorer, knobs, message):
    explorer = kept_explorer
    before = explorer.space.frame
    explorer.space.set(**knobs)
    assert "Could not re-price the space" in explorer.status.value and message in explorer.error
    assert explorer.space.frame is before
    explorer.space.set(**{"nodes": 1, "global_batch": 8, "sequence": 32, "hardware": "H100-SXM-80GB"})
    assert explorer.error is None and len(explorer.space.frame) == len(before)


def test_an_unknown_knob_says_which_knobs_there_are(kept_explorer):
    with pytest.raises(ValueError, match="no knob stages; its knobs are hardware"):
        kept_explorer.space.set(stages=2)


def layout_colours(svg):
    """The chart's legend (group -> swatch colour) and the fills its marks of each group have."""
    (chart,) = charts(svg)
    legend = {hint(r): r.get("fill") for r in marks(chart, "rect") if re.fullmatch(GROUP, hint(r))}
    points = {}
    for g in marks(chart, "g"):
        if "nbs-point" in (g.get("class") or ""):     # "tp 1 x cp 2 (ring) x pp 1 ...": the kind is not the group's
            group = re.match(r"tp \d+ (x cp \d+ (\(\w+\) )?)?(x ep \d+ )?x pp \d+", hint(g)).group(0)
            points.setdefault(re.sub(r" \(\w+\)", "", group), set()).add(g[0].get("fill"))
    return legend, points


def test_a_layouts_colour_is_the_same_in_every_sweep_and_the_legend_agrees(explorer):
    legend, points = layout_colours(explorer.space.chart.svg)
    assert set(legend) == set(points) == {"tp 1 x pp 1", "tp 1 x pp 2", "tp 2 x pp 1", "tp 2 x pp 2"}
    assert all(points[g] == {legend[g]} for g in legend) and len(set(legend.values())) == 4
    explorer.space.set(nodes=2)       # 16 GPUs: tp 1 x pp 1 would need dp 16 of a batch of 8, and drops out
    after, after_points = layout_colours(explorer.space.chart.svg)
    assert explorer.error is None and set(after) == set(legend) - {"tp 1 x pp 1"}
    assert all(after_points[g] == {after[g]} == {legend[g]} for g in after)      # nobody took its colour
    assert after == {g: layout_colour(*_sizes(g)) for g in after}


def _sizes(group: str):
    """A legend name's (tp, pp, cp, ep): ``tp 2 x pp 1``, ``tp 1 x cp 2 x pp 1`` or ``tp 1 x ep 2 x pp 1``."""
    sizes = dict(re.findall(r"(tp|cp|ep|pp) (\d+)", group))
    return int(sizes["tp"]), int(sizes["pp"]), int(sizes.get("cp", 1)), int(sizes.get("ep", 1))


def test_a_layout_colour_is_a_function_of_tp_and_pp_alone_and_tells_them_apart():
    sizes = [(tp, pp) for tp in (1, 2, 4, 8, 16, 32, 64) for pp in (1, 2, 4, 8, 16, 32)]
    colours = [layout_colour(tp, pp) for tp, pp in sizes]
    assert len(set(colours)) == len(sizes) and colours == [layout_colour(tp, pp) for tp, pp in sizes]
    assert len({layout_colour(tp, 1) for tp in (2, 3, 4, 6, 8, 12)}) == 6             # not only powers of two
    with pytest.raises(ValueError, match="whole numbers >= 1"):
        layout_colour(0, 1)


def test_a_context_parallel_layout_has_a_colour_no_other_layout_has():
    sizes = [(tp, pp, cp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4) for cp in (1, 2, 4, 8)]
    colours = {layout_colour(*size) for size in sizes}
    assert len(colours) == len(sizes)                  # tp 1 x cp 2 is not tp 2's colour, nor tp 1's
    assert layout_colour(1, 1, 2) not in {layout_colour(2, 1), layout_colour(1, 1)}


def test_an_expert_parallel_layout_has_a_colour_no_other_layout_has():
    sizes = [(tp, pp, cp, 1) for tp in (1, 2, 4, 8) for pp in (1, 2, 4) for cp in (1, 2, 4, 8)]
    sizes += [(1, pp, 1, ep) for pp in (1, 2, 4) for ep in (2, 4, 8)]
    assert len({layout_colour(*size) for size in sizes}) == len(sizes)


@pytest.mark.slow
def test_a_loaded_point_sets_the_knobs_to_its_configuration_without_placing_again(explorer):
    explorer.space.set(nodes=2)                    # 16 GPUs: more than the device knobs usually offer
    frame = explorer.space.frame
    row = next(i for i in range(len(frame)) if frame.pp[i] == 2 and frame.recompute[i] == "full")
    chosen, placed = frame.iloc[row], []
    explorer.controls.on_knobs = lambda: placed.append(explorer.controls.knobs())
    explorer.space.pick(row)
    assert explorer.error is None and placed == []                # the knobs follow quietly: no second plan
    knobs, config = explorer.controls, explorer.plan.config
    assert knobs.policy.value == "hybrid" and knobs.loaded.value.startswith("<small>from the space tab: tp")
    assert (knobs.plan_ngpus.value, knobs.runtime_ngpus.value, knobs.stages.value, knobs.nmicros.value) == \
        (chosen.tp * chosen.pp, 16, chosen.pp, chosen.micro_batches)
    assert (knobs.use_zero.value, knobs.zero_stage.value, knobs.recompute.value) == (True, chosen.zero_stage, "full")
    said = knobs.knobs().compute_config()
    for field in ("plan_ngpus", "runtime_ngpus", "pipeline_nstages", "pipeline_nmicros", "scheduler", "use_zero",
                  "zero_stage", "pas_config"):
        assert getattr(said, field) == getattr(config, field), field
    # a knob turned next re-places the loaded plan's own trace, keeping what the knobs say
    explorer.controls.on_knobs = explorer._knobs_changed
    explorer.set(scheduler="gpipe")
    assert explorer.error is None and explorer.plan.config.scheduler == "gpipe" and knobs.loaded.value == ""
    again = explorer.plan.config
    assert again.pas_config["recompute_modules"] == config.pas_config["recompute_modules"] == ["blocks"]
    assert (again.plan_ngpus, again.runtime_ngpus, again.zero_stage) == (config.plan_ngpus, 16, config.zero_stage)


@pytest.mark.slow
def test_a_selective_point_sets_the_recompute_knob_and_a_knob_turned_next_keeps_it(explorer):
    frame = explorer.space.frame
    full = next(i for i in range(len(frame)) if frame.recompute[i] == "full")
    selective = next(i for i in range(len(frame)) if frame.recompute[i] == "selective" and frame.pp[i] == 2)
    knobs = explorer.controls
    explorer.space.pick(full)                      # the knob reads each row loaded, not the one before
    assert explorer.error is None and knobs.recompute.value == "full"
    explorer.space.pick(selective)
    assert explorer.error is None, explorer.error
    config = explorer.plan.config
    assert config.pas_config["recompute"] == "selective" and "recompute_modules" not in config.pas_config
    assert knobs.recompute.value == "selective" and knobs.knobs().recompute == "selective"
    assert knobs.knobs().compute_config().pas_config == config.pas_config
    assert "<th style='text-align:left'>recompute</th><td>selective</td>" in knobs.as_table()
    regions = {n.meta.get("recompute") for n in explorer.plan.graph.nodes} - {None}
    assert regions and all(r.split("#")[0].endswith(":core") for r in regions), regions   # attention cores only
    explorer.set(scheduler="gpipe")                # a re-placement from the knobs keeps selective
    again = explorer.plan.config
    assert explorer.error is None and again.scheduler == "gpipe" and again.pas_config["recompute"] == "selective"
    assert "recompute_modules" not in again.pas_config and knobs.recompute.value == "selective"
    explorer.set(recompute="none")                 # and the knob turned re-places without it
    assert explorer.error is None and knobs.recompute.value == "none"
    assert not {"recompute", "recompute_modules"} & set(explorer.plan.config.pas_config)
    assert all(n.meta.get("recompute") is None for n in explorer.plan.graph.nodes)


@pytest.mark.parametrize("precision, master", [("bf16, fp32 master", torch.float32), ("bf16, no master copy", None)])
def test_the_timeline_of_a_loaded_point_prices_the_spaces_master_copies(explorer, precision, master):
    explorer.space.set(precision=precision)
    frame, space = explorer.space.frame, explorer.space.space
    explorer.space.pick(0)
    assert explorer.error is None and space.master_dtype is master
    timeline, memory = explorer.panes.views[ViewName.TIMELINE], explorer.panes.views[ViewName.MEMORY]
    assert timeline.recipe.master_dtype is master and timeline.hardware is space.hardware
    assert timeline.recipe == memory.recipe == space.recipe
    expected = explorer.plan.summary(explorer.optimizer_fn, hardware=space.hardware, master_dtype=master)
    pd.testing.assert_frame_equal(timeline.target, expected)
    assert timeline.target.step_time_s.max() == pytest.approx(frame.step_time_s[0], rel=1e-9)   # the space's row
    assert memory.predicted.peak_bytes.max() == pytest.approx(frame.peak_bytes[0], rel=1e-9)


def swept_and_picked(ex: Explorer, column: str, group: str, colour: str) -> pd.Series:
    """Sweep ``ex``'s space, whose ``column`` takes 1 and 2, check that the layout at 2 (``group``)
    is a legend entry of ``colour`` of its own, its points that colour too, and click its first
    point; returns that row."""
    ex.sweep()
    assert ex.error is None, ex.error
    frame = ex.space.frame
    assert set(frame[column]) == {1, 2} and group in ex.space.chart.svg
    legend, points = layout_colours(ex.space.chart.svg)
    assert legend[group] == colour != legend["tp 1 x pp 1"]
    assert all(points[g] == {legend[g]} for g in legend)
    row = next(i for i in range(len(frame)) if frame[column].iloc[i] == 2)
    chosen = frame.iloc[row]
    assert describe(chosen) in ex.space.chart.svg
    ex.space.pick(row)
    assert ex.error is None, ex.error
    return chosen


@pytest.mark.slow       # seconds: a sweep with context parallelism and the plan of one of its rows
def test_a_context_parallel_point_has_its_own_group_and_loads_a_context_parallel_plan():
    ex = Explorer(sweep_ranges={**RANGES, "tp": (1,), "cp": (1, 2), "context_parallel_kind": ("ring",)},
                  optimizer_fn=torch.optim.AdamW)
    try:
        ex.space.set(global_batch=8)
        chosen = swept_and_picked(ex, "cp", "tp 1 x cp 2 x pp 1", layout_colour(1, 1, 2))
        assert "x cp 2 (ring) x pp" in describe(chosen)
        config = ex.plan.config
        assert config.pas_config["context_parallel"] == 2 and config.pas_config["context_parallel_kind"] == "ring"
        assert config.plan_ngpus == 2 * chosen.pp
        assert ex.controls.context_parallel.value == 2 and ex.controls.context_parallel_kind.value == "ring"
        memory = ex.panes.views[ViewName.MEMORY]
        assert memory.predicted.peak_bytes.max() == pytest.approx(chosen.peak_bytes, rel=1e-9)
    finally:
        ex.close()


def test_a_legend_of_many_layouts_wraps_inside_the_chart_and_pushes_the_plot_down(kept_explorer):
    frame, hardware = pd.DataFrame(kept_explorer.space.frame), kept_explorer.space.space.hardware
    frame.attrs = {}                    # the sweep's record of how it priced: not the chart's business
    many = pd.concat([frame.assign(cp=cp) for cp in (1, 2, 4)], ignore_index=True)   # 12 tp x cp x pp groups
    (one_row,) = charts(space_svg(frame, hardware))
    (wrapped,) = charts(space_svg(many, hardware))
    legend = [r for r in marks(wrapped, "rect") if re.fullmatch(GROUP, hint(r))]
    assert len(legend) == 12 and len({r.get("fill") for r in legend}) == 12
    rows = sorted({float(r.get("y")) for r in legend})
    assert len(rows) > 1 and max(float(r.get("x")) for r in legend) < WIDTH - RIGHT
    extra = float(wrapped.get("height")) - float(one_row.get("height"))
    assert extra >= rows[-1] - rows[0]              # the plot is drawn that much lower, under the legend


def test_fp8_and_compiled_rows_are_marked_keyed_and_described(kept_explorer):
    frame, hardware = pd.DataFrame(kept_explorer.space.frame), kept_explorer.space.space.hardware
    frame.attrs = {}
    assert set(frame.float8) == {"none"} and set(frame.compiled) == {False}
    (plain,) = charts(space_svg(frame, hardware))
    assert not {"fp8 products", "compiled"} & set(texts(plain))            # keyed only where such rows are
    both = pd.concat([frame, frame.assign(float8="tensorwise", compiled=True)], ignore_index=True)
    (chart,) = charts(space_svg(both, hardware))
    assert {"fp8 products", "compiled"} <= set(texts(chart))
    points = [g for g in marks(chart, "g") if "nbs-point" in (g.get("class") or "")]
    dot = lambda g: any(c.get("r") == "1.8" for c in g.iter(f"{NS}circle"))
    bar = lambda g: any(True for _ in g.iter(f"{NS}line"))
    fp8 = [g for g in points if ", fp8 tensorwise, compiled:" in hint(g)]
    assert len(fp8) == len(frame) and all(dot(g) and bar(g) for g in fp8)
    assert not any(dot(g) or bar(g) for g in points if g not in fp8)


@pytest.mark.slow       # seconds: a sweep of a mixture of experts over ep and the plan of one of its rows
def test_an_expert_parallel_point_has_its_own_group_and_loads_an_expert_parallel_plan():
    # the shipped MoE Llama taking one batch and returning its loss, so the knobs may pipeline it
    ex = Explorer(build("moe_e2e"), batch("moe_e2e", 0), optimizer_fn=torch.optim.AdamW,
                  sweep_ranges={**RANGES, "tp": (1,), "ep": (1, 2), "micro_batch": (2,)})
    try:
        ex.space.set(global_batch=16)       # dp 8 x micro-batches of 2 at tp 1 x pp 1
        chosen = swept_and_picked(ex, "ep", "tp 1 x ep 2 x pp 1", layout_colour(1, 1, 1, 2))
        assert "tp 1 x ep 2 x pp" in describe(chosen)
        config = ex.plan.config
        assert config.pas_config["expert_parallel"] == 2 and config.plan_ngpus == 2 * chosen.pp
        memory = ex.panes.views[ViewName.MEMORY]
        assert memory.predicted.peak_bytes.max() == pytest.approx(chosen.peak_bytes, rel=1e-9)
        assert ex.controls.expert_parallel.value == 2          # the knobs read the row, ep included
        frame = ex.space.frame
        piped = next(i for i in range(len(frame)) if frame.ep.iloc[i] == 2 and frame.pp.iloc[i] == 2)
        ex.space.pick(piped)
        other = next(g for g in ("none", "selective") if g != frame.recompute.iloc[piped])
        ex.set(recompute=other)                                # a knob turned next keeps the experts split
        assert ex.error is None and ex.plan.config.pas_config["expert_parallel"] == 2
        assert ex.plan.config.plan_ngpus == 4 and ex.plan.config.pipeline_nstages == 2
    finally:
        ex.close()


@pytest.mark.slow       # seconds: two compiles of a mixture of experts
def test_the_expert_groups_knob_cuts_the_experts_two_ways_and_is_off_without_expert_parallel():
    ex = Explorer(build("moe_e2e"), batch("moe_e2e", 0), optimizer_fn=torch.optim.AdamW)
    try:
        assert ex.controls.expert_tensor_parallel.disabled                  # expert parallel 1: nothing to group
        ex.set(policy="tp", plan_ngpus=4, runtime_ngpus=4, expert_parallel=2, expert_tensor_parallel=2)
        ex.compile()
        assert ex.error is None and not ex.controls.expert_tensor_parallel.disabled
        assert ex.plan.config.pas_config["expert_tensor_parallel"] == 2
        assert "hidden_parts=2)" in ex.plan.sources[3]
        assert ex.runs["expert_tensor_parallel"].tolist()[-1] == 2
        ex.set(expert_parallel=1)
        assert ex.controls.expert_tensor_parallel.disabled and "expert_tensor_parallel" not in ex.plan.config.pas_config
    finally:
        ex.close()
