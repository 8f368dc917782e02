"""The Explorer in a real browser: JupyterLab started on a free port, driven by Chromium.

The test opens a notebook whose one cell shows ``Explorer()``, clicks Compile, expands a block in
the graph, switches the policy to ``pp`` (the stages knob then reads the plan's 2 stages) and then to
``autodist`` (reading why in the why tab), and checks what the page shows after each step; it
saves a screenshot of each (set ``NBSCALER_SCREENSHOTS=DIR`` to keep them) and checks none is blank.
The space test sweeps, re-prices, loads a point into the knobs, picks recompute ``selective`` on
the left (a re-placement) and loads a selective point (the knob follows its row).
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

import pytest

from tests.widgets.browser import lab_page, write_notebook

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]

WAIT_MS = 120_000            # a compile in the kernel of a loaded 2-core machine takes a while
EXPLORER = ".nbscaler-explorer"
GRAPH = f"{EXPLORER} .nbscaler-pane-graph .nbs-graphview"


class Clock:
    """Prints how long each step of the test took (``pytest -s`` shows it)."""

    def __init__(self):
        self.start = self.last = time.monotonic()

    def __call__(self, what: str) -> None:
        now = time.monotonic()
        print(f"[browser test] {what}: {now - self.last:.1f} s (total {now - self.start:.1f} s)", flush=True)
        self.last = now


def status(page) -> str:
    return page.locator(f"{EXPLORER} .nbscaler-status").inner_text()


def test_explorer_compiles_expands_and_switches_policy_in_jupyterlab(tmp_path):
    write_notebook(tmp_path / "explorer.ipynb", "from nbscaler.widgets import Explorer\nex = Explorer()\nex")
    shots = Path(os.environ.get("NBSCALER_SCREENSHOTS") or tmp_path / "screenshots")
    clock = Clock()
    with lab_page(tmp_path, shots) as lab:
        page = lab.page
        clock("JupyterLab and Chromium started")
        lab.open_notebook("explorer.ipynb")
        clock("notebook open, kernel idle")
        page.keyboard.press("Control+b")                       # hide the file browser: room for the views
        lab.run_all_cells()
        page.wait_for_selector(f"{EXPLORER} .nbscaler-controls", timeout=WAIT_MS)
        clock("Explorer shown")
        assert "press Compile" in status(page)
        lab.screenshot("1-explorer-before-compile", EXPLORER)

        page.click(f"{EXPLORER} button.nbscaler-compile")
        page.wait_for_selector(f"{EXPLORER} .nbscaler-info:has-text('Compiled run 1')", timeout=WAIT_MS)
        page.wait_for_selector(f"{GRAPH} svg .nbs-box", timeout=WAIT_MS)
        page.wait_for_selector(f"{EXPLORER} .nbscaler-pane-timeline .js-plotly-plot", timeout=WAIT_MS)
        page.wait_for_selector(f"{EXPLORER} .nbscaler-pane-memory .js-plotly-plot", timeout=WAIT_MS)
        assert "Block times: stage 0" in page.locator(f"{EXPLORER} .nbscaler-pane-timeline").inner_text()
        assert page.locator(f"{EXPLORER} .nbscaler-runs tbody tr").count() == 1
        assert page.locator(f"{GRAPH} .nbs-box.nbs-module[data-key='blocks.0']").count() >= 1
        clock("compiled and drawn")
        lab.screenshot("2-explorer-compiled", EXPLORER)

        page.locator(f"{GRAPH} .nbs-box.nbs-module[data-key='blocks.0']").first.click()
        page.wait_for_selector(f"{GRAPH} .nbs-frame[data-key='blocks.0']", timeout=WAIT_MS)
        assert page.locator(f"{GRAPH} .nbs-box[data-key^='blocks.0.']").count() >= 2   # its children
        clock("block expanded")
        lab.screenshot("3-graph-block-expanded", f"{EXPLORER} .nbscaler-pane-graph")

        policy = page.locator(f"{EXPLORER} .widget-dropdown:has(label:text-is('policy')) select")
        policy.select_option("pp")
        page.wait_for_selector(f"{EXPLORER} .nbscaler-info:has-text('Re-placed under pp')", timeout=WAIT_MS)
        # the timeline's notes now time the blocks of the pipeline's second stage
        page.wait_for_selector(f"{EXPLORER} .nbscaler-pane-timeline :text('stage 1')", timeout=WAIT_MS)
        assert page.locator(f"{EXPLORER} .nbscaler-pane-timeline .js-plotly-plot").count() >= 1
        stages = page.locator(f"{EXPLORER} .widget-dropdown:has(label:text-is('pipeline stages')) select")
        page.wait_for_function("s => s.options[s.selectedIndex].text === '2'", arg=stages.element_handle(),
                               timeout=WAIT_MS)                  # the knob reads the plan's 2 stages
        clock("policy switched to pp, timeline redrawn")
        assert re.search(r"in \d+ ms", status(page))
        lab.screenshot("4-explorer-policy-pp", EXPLORER)

        policy.select_option("autodist")
        page.wait_for_selector(f"{EXPLORER} .nbscaler-info:has-text('Re-placed under autodist')", timeout=WAIT_MS)
        page.locator(f"{EXPLORER} .lm-TabBar-tab:has-text('why')").first.click()
        why = f"{EXPLORER} .nbscaler-pane-why .nbscaler-explanation"
        page.wait_for_selector(f"{why} :text('autodist searched in')", timeout=WAIT_MS)
        text = page.locator(why).inner_text()
        assert "predicted per device: step" in text and "against the runner-up" in text, text[:500]
        assert page.locator(f"{why} table.nbscaler-explanation-table tbody tr").count() >= 5
        clock("policy switched to autodist, its explanation shown")
        lab.screenshot("5-explorer-why-autodist", EXPLORER)
        assert not [line for line in lab.console if line.startswith("error:") and "nbscaler" in line.lower()]


LEGEND_FILLS = """sel => Object.fromEntries([...document.querySelectorAll(sel + ' svg rect')]
    .map(r => [r.querySelector('title')?.textContent ?? '', r.getAttribute('fill')])
    .filter(([name]) => /^tp \\d+ x pp \\d+$/.test(name)))"""
"""The space chart's legend as the page draws it: 'tp T x pp P' -> the swatch's colour."""


def knob_text(page, name: str) -> str:
    """What a left-hand control shows: a dropdown's chosen text, a box's value, a checkbox's tick."""
    controls = f"{EXPLORER} .nbscaler-controls"
    tick = page.locator(f"{controls} .widget-checkbox:has(span:text-is('{name}')) input")
    if tick.count():
        return str(tick.first.is_checked())
    control = page.locator(f"{controls} .widget-inline-hbox:has(label:text-is('{name}'))").first
    if control.locator("select").count():
        return control.locator("select").evaluate("s => s.options[s.selectedIndex].text")
    return control.locator("input").input_value()


@contextlib.contextmanager
def swept_space(tmp_path, ranges: str, configurations: int, model: str = ""):
    """JupyterLab showing an Explorer of ``sweep_ranges=ranges`` (its source) whose space tab has
    swept its ``configurations``: the lab, open on it. ``model``: source that sets ``model`` and
    ``args``, the Explorer's model and its inputs (none: the Explorer's own)."""
    given = "model, args, " if model else ""
    write_notebook(tmp_path / "space.ipynb", f"from nbscaler.widgets import Explorer\n{model}\n"
                                             f"ex = Explorer({given}sweep_ranges={ranges})\nex")
    shots = Path(os.environ.get("NBSCALER_SCREENSHOTS") or tmp_path / "screenshots")
    space = f"{EXPLORER} .nbscaler-space"
    with lab_page(tmp_path, shots) as lab:
        page = lab.page
        lab.open_notebook("space.ipynb")
        page.keyboard.press("Control+b")
        lab.run_all_cells()
        page.wait_for_selector(f"{EXPLORER} .nbscaler-controls", timeout=WAIT_MS)
        page.locator(f"{EXPLORER} .lm-TabBar-tab:has-text('space')").first.click()
        page.click(f"{space} button.nbscaler-sweep")
        page.wait_for_selector(f"{EXPLORER} .nbscaler-info:has-text('Swept {configurations} configurations')",
                               timeout=WAIT_MS)
        page.wait_for_selector(f"{space} .nbs-spaceview svg .nbs-point", timeout=WAIT_MS)
        yield lab


def test_the_space_tab_sweeps_reprices_on_a_knob_and_loads_a_clicked_point(tmp_path):
    clock = Clock()
    space = f"{EXPLORER} .nbscaler-space"
    with swept_space(tmp_path, "dict(tp=(1, 2), pp=(1, 2), micro_batch=(1, 2), zero_stage=(1,))", 33) as lab:
        page = lab.page
        # tp x pp x micro-batch x recompute (none, selective, full): 21, and tp 2's 12 again with sequence parallelism
        assert page.locator(f"{space} .nbs-point").count() == 33
        assert page.locator(f"{space} .nbs-front-point").count() >= 2
        assert page.locator(f"{space} .nbs-capacity").count() == 0      # a tiny GPT: the capacity is far off
        clock("swept and drawn")
        lab.screenshot("6-space-swept", EXPLORER)
        swept = page.evaluate(LEGEND_FILLS, space)
        assert len(swept) == 4 and len(set(swept.values())) == 4, swept

        nodes = page.locator(f"{space} .widget-inline-hbox:has(label:text-is('nodes')) input")
        nodes.fill("2")
        nodes.press("Enter")
        page.wait_for_selector(f"{EXPLORER} .nbscaler-info:has-text('2 node(s) of 8 GPUs')", timeout=WAIT_MS)
        assert re.search(r"Re-priced \d+ configurations .* in \d+ ms \(from cached costs, nothing traced\)",
                         status(page)), status(page)
        page.wait_for_selector(f"{space} svg:has-text('x 2 node(s)')", timeout=WAIT_MS)
        clock("nodes 2: re-priced")
        repriced = page.evaluate(LEGEND_FILLS, space)       # tp 1 x pp 1 drops out; the rest keep their colours
        assert repriced == {k: v for k, v in swept.items() if k != "tp 1 x pp 1"}, (swept, repriced)

        page.locator(f"{space} .nbs-front-point").last.click()
        page.wait_for_selector(f"{EXPLORER} .nbscaler-info:has-text('Loaded tp')", timeout=WAIT_MS)
        page.wait_for_selector(f"{space} .nbs-selected", timeout=WAIT_MS)
        memory = f"{EXPLORER} .nbscaler-pane-memory"
        page.wait_for_selector(f"{memory} :text('of 16 ranks fit')", timeout=WAIT_MS)       # 2 nodes of 8, on H100
        assert "hybrid, SGD on H100-SXM-80GB" in page.locator(memory).inner_text()
        page.wait_for_selector(f"{EXPLORER} .nbscaler-pane-timeline .js-plotly-plot", timeout=WAIT_MS)
        # the knobs read the loaded plan (tp 2 x pp 2 x dp 4 on 16 GPUs), not the tp plan they started at
        assert (knob_text(page, "policy"), knob_text(page, "runtime devices")) == ("hybrid", "16")
        assert (knob_text(page, "plan devices"), knob_text(page, "pipeline stages")) == ("4", "2")
        assert knob_text(page, "ZeRO") == "True" and knob_text(page, "recompute") == "full"
        assert "from the space tab: tp 2 x pp 2" in page.locator(f"{EXPLORER} .nbscaler-controls").inner_text()
        # the timeline's title wraps inside its pane; the memory axis ticks in GiB, as its capacity line
        timeline = f"{EXPLORER} .nbscaler-pane-timeline"
        pane, title = page.locator(timeline).bounding_box(), page.locator(f"{timeline} .gtitle").bounding_box()
        assert title["x"] >= pane["x"] and title["x"] + title["width"] <= pane["x"] + pane["width"], (title, pane)
        ticks = page.locator(f"{memory} .ytick text").evaluate_all("ts => ts.map(t => t.textContent)")
        assert ticks and all(t.endswith(" GiB") for t in ticks[1:]) and not any("GB" in t for t in ticks), ticks
        assert page.locator(f"{memory} :text('capacity 74.5 GiB')").count() == 1
        lab.screenshot("7a-timeline-loaded", timeline)
        lab.screenshot("7b-memory-loaded", memory)
        page.locator(f"{EXPLORER} .lm-TabBar-tab:has-text('graph')").first.click()
        page.wait_for_selector(f"{GRAPH} svg .nbs-box", timeout=WAIT_MS)
        assert page.locator(f"{GRAPH} .nbs-pane-toggles input").count() == 1 + 16    # logical + each rank
        clock("a point clicked: its plan in the panes")
        lab.screenshot("7-space-point-loaded", EXPLORER)
        page.locator(f"{EXPLORER} .lm-TabBar-tab:has-text('space')").first.click()
        lab.screenshot("8-space-selected", space)

        # the recompute knob is a granularity, both ways: picked on the left, it re-places the loaded
        # plan; a point of the space tab sets it to its row's
        recompute = page.locator(f"{EXPLORER} .nbscaler-controls .widget-dropdown:has(label:text-is('recompute')) select")
        assert recompute.evaluate("s => [...s.options].map(o => o.text)") == ["none", "selective", "full"]
        recompute.select_option("selective")
        page.wait_for_selector(f"{EXPLORER} .nbscaler-info:has-text('Re-placed under hybrid')", timeout=WAIT_MS)
        assert knob_text(page, "recompute") == "selective" and knob_text(page, "runtime devices") == "16"
        assert "from the space tab" not in page.locator(f"{EXPLORER} .nbscaler-controls").inner_text()
        clock("recompute selective picked: re-placed")
        lab.screenshot("9-recompute-selective-picked", f"{EXPLORER} .nbscaler-controls")
        for granularity in ("none", "selective"):      # 'none' first: the knob must move to the row's
            point = page.locator(f"{space} .nbs-point:has(title:has-text('recompute {granularity}'))")
            point.first.dispatch_event("click")         # marks overlap: the click goes to this one
            page.wait_for_selector(f"{EXPLORER} .nbscaler-info:has-text('Loaded tp'):has-text('recompute "
                                   f"{granularity}')", timeout=WAIT_MS)
            assert knob_text(page, "recompute") == granularity
        clock("a selective point clicked: the knob reads selective")
        lab.screenshot("10-space-selective-loaded", EXPLORER)
        assert not [line for line in lab.console if line.startswith("error:") and "nbscaler" in line.lower()]


def test_the_space_tab_marks_fp8_and_compiled_rows_and_keys_them(tmp_path):
    space = f"{EXPLORER} .nbscaler-space"
    ranges = ("dict(tp=(1, 2), pp=(1,), micro_batch=(1,), zero_stage=(1,), recompute=('full',), "
              "sequence_parallel=(False,), float8=('none', 'tensorwise'), compiled=(False, True))")
    with swept_space(tmp_path, ranges, 8) as lab:
        page = lab.page
        points = page.locator(f"{space} .nbs-point")
        assert points.count() == 8       # tp 1 and 2, each eager and compiled, each in bf16 and fp8
        fp8 = page.locator(f"{space} .nbs-point:has(title:has-text('fp8 tensorwise'))")
        assert fp8.count() == 4 and fp8.first.locator("circle[r='1.8']").count() == 1
        compiled = page.locator(f"{space} .nbs-point:has(title:has-text('compiled:'))")
        assert compiled.count() == 4 and compiled.first.locator("line").count() == 1
        keys = page.locator(f"{space} svg text").evaluate_all("ts => ts.map(t => t.textContent)")
        assert "fp8 products" in keys and "compiled" in keys, keys
        lab.screenshot("11-space-fp8-compiled", space)
        assert not [line for line in lab.console if line.startswith("error:") and "nbscaler" in line.lower()]


def test_the_space_tab_names_and_colours_expert_parallel_layouts_and_loads_one(tmp_path):
    space = f"{EXPLORER} .nbscaler-space"
    model = ("from nbscaler.models.moe import MoEConfig, MoELlama, sample_batch\n"
             "model = MoELlama(MoEConfig(vocab_size=256, seq_len=32, n_layer=2, d_model=64, n_head=4, n_kv_head=2))\n"
             "args = sample_batch(model.config, batch_size=2)")
    ranges = "dict(tp=(1,), pp=(1, 2), ep=(1, 2), micro_batch=(2,), zero_stage=(1,))"
    # a global batch of 8 on 8 GPUs: ep 1 x pp 2, ep 2 x pp 1 and ep 2 x pp 2, each recomputing none,
    # the attention cores or the layers (ep 1 x pp 1 would need dp 8 x 2 sequences)
    with swept_space(tmp_path, ranges, 9, model) as lab:
        page = lab.page
        legend = page.evaluate(LEGEND_FILLS.replace("x pp", "(x ep \\d+ )?x pp"), space)
        assert set(legend) == {"tp 1 x pp 2", "tp 1 x ep 2 x pp 1", "tp 1 x ep 2 x pp 2"}, legend
        assert len(set(legend.values())) == 3
        experts = page.locator(f"{space} .nbs-point:has(title:has-text('tp 1 x ep 2 x pp'))")
        assert experts.count() == 6
        lab.screenshot("12-space-expert-parallel", space)
        experts.first.dispatch_event("click")
        page.wait_for_selector(f"{EXPLORER} .nbscaler-info:has-text('Loaded tp 1 x ep 2 x pp')", timeout=WAIT_MS)
        assert not [line for line in lab.console if line.startswith("error:") and "nbscaler" in line.lower()]
