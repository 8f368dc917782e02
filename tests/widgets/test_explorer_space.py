"""The Explorer's space tab, without a browser: the sweep drawn with its front, knobs that re-price
without tracing, a click that loads the configuration's plan into the panes, bad knobs as messages."""

from __future__ import annotations

import re

import pytest
import torch

from nbscaler.planning.pareto import pareto_front
from nbscaler.widgets import Explorer
from nbscaler.widgets.explorer.app import SPACE_TAB
from nbscaler.widgets.explorer.panes import ViewName
from nbscaler.widgets.space import describe

RANGES = dict(tp=(1, 2), pp=(1, 2), micro_batch=(1, 2), zero_stage=(1,))


@pytest.fixture
def explorer():
    ex = Explorer(sweep_ranges=RANGES, optimizer_fn=torch.optim.AdamW)
    ex.space.set(global_batch=8)
    ex.sweep()
    assert ex.error is None, ex.error
    yield ex
    ex.close()


def test_the_sweep_is_drawn_every_configuration_a_mark_and_the_front_ringed(explorer):
    frame, svg = explorer.space.frame, explorer.space.chart.svg
    assert explorer.tabs.titles[explorer.tabs.selected_index] == SPACE_TAB
    # tp x pp x micro x recompute on 8 GPUs (14), and the 8 of tp 2 again with sequence parallelism
    assert svg.count('class="nbs-point') == len(frame) == 22
    front = pareto_front(frame)
    assert svg.count("nbs-front-point") == front.sum() == len(explorer.space.front) >= 2
    assert explorer.space.front == [i for i in range(len(frame)) if front.iloc[i]]
    assert "on the Pareto front" in svg and "H100-SXM-80GB capacity 74.5 GiB" in svg
    assert "Swept 22 configurations" in explorer.status.value


def test_a_knob_change_reprices_without_tracing_and_says_how_long(explorer):
    space = explorer.space.space
    traces, before = space.traces, explorer.space.frame
    explorer.space.set(hardware="A100-SXM-40GB", nodes=2, global_batch=16, precision="bf16, no master copy")
    assert explorer.error is None and space.traces == traces
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
def test_a_bad_knob_is_a_message_and_the_space_stays(explorer, knobs, message):
    before = explorer.space.frame
    explorer.space.set(**knobs)
    assert "Could not re-price the space" in explorer.status.value and message in explorer.error
    assert explorer.space.frame is before
    explorer.space.set(**{"nodes": 1, "global_batch": 8, "sequence": 32, "hardware": "H100-SXM-80GB"})
    assert explorer.error is None and len(explorer.space.frame) == len(before)


def test_an_unknown_knob_says_which_knobs_there_are(explorer):
    with pytest.raises(ValueError, match="no knob stages; its knobs are hardware"):
        explorer.space.set(stages=2)
