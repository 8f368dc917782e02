"""The views of a context-parallel plan: ops named by what they cut of the sequence, the plan card's
groups and chunks, and the timeline's collectives lane with each ring attention's passes (or its
keys' all-gathers), in Python and in a real browser."""

import contextlib
import os
from pathlib import Path

import pytest

from nbscaler import Hardware
from nbscaler.glossary import split_text
from nbscaler.planning.tables import context_chunks, plan_html
from nbscaler.widgets import PlanView, TimelineView
from nbscaler.widgets.palette import COLLECTIVE_COLOURS
from tests.widgets.compiled import gpt_context
from tests.widgets.svg import charts, hint, marks, texts

H100 = "H100-SXM-80GB"
LAYERS, N = 2, 4


def test_splits_of_context_parallelism_are_named_by_what_they_cut():
    assert split_text("d1", "elementwise", "sequence") == "sequence (context parallel, mirrored chunks; d1)"
    assert split_text("t", "attention", "ring") == "queries (context parallel, ring; t)"
    assert split_text("t", "attention", "all_gather") == "queries (context parallel, all-gather; t)"
    assert split_text("n", "loss", "all_gather") == "tokens (context parallel; n)"
    assert split_text("n", "loss") == "batch-split (n)"                     # without context parallelism


def test_the_plan_table_and_card_read_as_context_parallel():
    plan = gpt_context("ring")
    view = PlanView(plan)
    page = view.to_html()
    assert "queries (context parallel, ring; t)" in page and "tokens (context parallel; n)" in page
    assert "sequence (context parallel, mirrored chunks; *1)" in page
    assert "column-parallel" not in page and "sequence-sharded" not in page
    assert "t queries (context parallel, ring)" in view.glossary.value
    card = plan_html(plan)
    assert "context parallel (ring) over [0, 1, 2, 3]" in card and "device i holds chunks i and 2n-1-i" in card
    chunks = context_chunks(plan)          # 16 tokens in 8 chunks of 2: device i holds i and 7-i
    assert list(chunks.device) == [0, 1, 2, 3]
    assert list(chunks.chunks) == ["0 and 7", "1 and 6", "2 and 5", "3 and 4"]
    assert list(chunks.positions) == ["0:2 and 14:16", "2:4 and 12:14", "4:6 and 10:12", "6:8 and 8:10"]
    assert "<td>1 and 6</td>" in card and "<td>2:4 and 12:14</td>" in card
    assert "context parallel (all_gather) over" in plan_html(gpt_context("all_gather"))


def test_a_ring_attentions_passes_are_drawn_where_it_runs_in_the_collectives_lane():
    plan, hw = gpt_context("ring"), Hardware.named(H100)
    line = plan.timeline(hardware=hw)
    ring = [c for c in line.collectives if c.kind == "ring_pass"]
    assert all(c.context and not c.sync for c in ring)
    for rank in range(N):
        mine = [c for c in ring if c.rank == rank]
        assert len([c for c in mine if c.phase == "F"]) == LAYERS * (N - 1)
        assert len([c for c in mine if c.phase == "B"]) == LAYERS * N
        forward = sorted((c for c in mine if c.phase == "F"), key=lambda c: c.t_start)
        assert [c.unit for c in forward[:N - 1]] == [        # device 1 receives the blocks of 0, 3 and 2
            f"ring step {k}/3 of blocks.0.attn: keys and values of device {(rank - k) % N}" for k in (1, 2, 3)]
        assert all(b.t_end <= a.t_start + 1e-12 for b, a in zip(forward, forward[1:]))   # one after the other
        (fwd,) = [b for b in line.blocks if b.rank == rank and b.phase == "F"]
        assert fwd.t_start < forward[0].t_start < fwd.t_end                  # the first attention, inside its forward
    homes = [c for c in ring if c.rank == 1 and c.unit.startswith(f"ring step {N}/{N} of blocks.1.attn")]
    assert len(homes) == 1 and "gradients of its own keys and values, home" in homes[0].unit
    # the passes last what the traffic table's ring_pass rows cost as the all-gathers moving their bytes
    rows = plan.collectives_on("nccl")
    assert len(rows[rows.collective == "ring_pass"]) == 2 * LAYERS * 2           # keys, values; F and B
    seconds = sum(c.t_end - c.t_start for c in ring if c.rank == 0)
    assert seconds > 0 and all(c.waited_s == 0.0 for c in ring)


def test_the_timeline_view_draws_the_ring_in_figure_and_svg():
    hw = Hardware.named(H100)
    view = TimelineView(gpt_context("ring"), hardware=hw)
    per_rank = LAYERS * (N - 1) + LAYERS * N
    ring = view.collectives[view.collectives.kind == "ring_pass"]
    assert len(ring) == N * per_rank
    figure = [t for t in view.figure.data if t.name == "ring pass (context parallel)"]
    assert len(figure) == 1 and len(figure[0].x) == N * per_rank
    assert figure[0].marker.color == COLLECTIVE_COLOURS["ring_pass"]
    (chart,) = charts(view.notebook_html())
    drawn = [b for b in marks(chart, "rect", "nbs-block") if "ring step" in hint(b)]
    assert len(drawn) == N * per_rank and {b.get("fill") for b in drawn} == {COLLECTIVE_COLOURS["ring_pass"]}
    assert all("while the attention computes" in hint(b) for b in drawn)
    assert any(hint(b).startswith("predicted rank 2 · collectives: ring step 1/3 of blocks.1.attn") for b in drawn)
    assert "ring pass (context parallel)" in texts(chart)
    assert "Context parallelism" in view.assumptions and "ZeRO stage 3" not in view.assumptions


def test_all_gathered_keys_and_values_are_drawn_as_all_gathers_the_block_waits_for():
    hw = Hardware.named(H100)
    line = gpt_context("all_gather").timeline(hardware=hw)
    calls = [c for c in line.collectives if c.context and c.rank == 0]
    assert sorted({(c.kind, c.phase) for c in calls}) == [("all_gather", "F"), ("reduce_scatter", "B")]
    assert len(calls) == LAYERS * 2 * 2                                   # keys and values, F and B
    assert "keys of blocks.0.attn, all-gathered over [0, 1, 2, 3]" in {c.unit for c in calls}
    assert all(c.waited_s == pytest.approx(c.t_end - c.t_start) for c in calls)
    assert not [c for c in line.collectives if c.kind == "ring_pass"]


@pytest.mark.slow                      # prices the plan on this CPU: profiles its ops first
def test_on_this_machine_the_ring_is_drawn_too():
    line = gpt_context("ring").timeline()
    ring = [c for c in line.collectives if c.kind == "ring_pass" and c.rank == 0]
    assert len(ring) == LAYERS * (2 * N - 1) and all(c.t_end > c.t_start for c in ring)


BROWSER_CELL = (
    "import nbscaler\n"
    "from IPython.display import HTML\n"
    "from nbscaler import ComputeConfig, Hardware\n"
    "from nbscaler.models.gpt import GPT, GPTConfig, sample_batch\n"
    "from nbscaler.widgets import TimelineView\n"
    "cfg = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=64)\n"
    "plan = nbscaler.plan(GPT(cfg), {'batch': sample_batch(cfg, 1)}, 'tp',\n"
    "                     ComputeConfig(4, 4, pas_config={'context_parallel': 4, 'context_parallel_kind': 'ring'}))\n"
    "HTML(TimelineView(plan, hardware=Hardware.named('H100-SXM-80GB')).notebook_html())"
)

RING_RECTS = """() => [...document.querySelectorAll('.nbs-timeline svg rect.nbs-block')]
    .filter(r => (r.querySelector('title')?.textContent ?? '').includes('· collectives: ring step'))
    .map(r => { const b = r.getBoundingClientRect();
                return {w: b.width, h: b.height, fill: r.getAttribute('fill'),
                        shown: getComputedStyle(r).visibility !== 'hidden' && getComputedStyle(r).display !== 'none'}; })"""


@contextlib.contextmanager
def _ring_in_lab(tmp_path, name: str, cell: str):
    """JupyterLab in Chromium running a notebook of ``cell``, once its timeline is drawn: the lab and
    the ring steps' blocks, each checked visible; afterwards, no error on the console."""
    from tests.widgets.browser import lab_page, write_notebook

    write_notebook(tmp_path / f"{name}.ipynb", cell)
    shots = Path(os.environ.get("NBSCALER_SCREENSHOTS") or tmp_path / "screenshots")
    with lab_page(tmp_path, shots) as lab:
        lab.open_notebook(f"{name}.ipynb")
        lab.run_all_cells()
        lab.page.locator(".nbs-timeline svg rect.nbs-block").first.wait_for(timeout=120_000)
        rects = lab.page.evaluate(RING_RECTS)
        assert all(r["shown"] and r["w"] >= 1 and r["h"] > 10 for r in rects), rects[:3]
        yield lab, rects
        assert not [line for line in lab.console if line.startswith("error")], lab.console


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_the_ring_in_the_browser(tmp_path):
    """JupyterLab in Chromium: a cell shows the timeline's saved form (the SVG nbviewer shows) of a ring
    plan on 4 devices; every ring step is a visible block of the collectives lanes."""
    with _ring_in_lab(tmp_path, "ring", BROWSER_CELL) as (lab, rects):
        assert len(rects) == N * (LAYERS * (N - 1) + LAYERS * N)
        assert {r["fill"] for r in rects} == {COLLECTIVE_COLOURS["ring_pass"]}
        assert "ring pass (context parallel)" in lab.page.locator(".nbs-timeline").inner_text()
        lab.screenshot("context-ring-timeline", ".nbs-timeline")


def test_tensor_parallelism_inside_context_parallelism_shows_both_groups():
    """tp 2 inside cp 2 on 4 devices: the card names the two context-parallel groups (the devices at
    the same place in each pair) and the two tensor-parallel pairs; each op's second cut is in the
    ops table and the graph's hover text; a ring runs over its context-parallel group only."""
    from nbscaler.widgets.graph.facts import PlanFacts
    plan = gpt_context("ring", 4, cp=2)
    text = str(plan.explain())
    assert "context parallel (ring) over [0, 2]" in text and "context parallel (ring) over [1, 3]" in text
    assert "tensor parallel inside context parallelism: [0, 1], [2, 3]" in text
    chunks = context_chunks(plan)           # 16 tokens in 4 chunks of 4: places 0 and 1 of each group
    assert dict(zip(chunks.device, chunks.chunks)) == {0: "0 and 3", 2: "1 and 2", 1: "0 and 3", 3: "1 and 2"}
    (fc,) = [i for i, m in enumerate(plan.ops.module) if m == "blocks.0.mlp.fc"]
    assert plan.ops.inner_split[fc] == "n in groups of 2" and plan.ops.split[fc] == "*1"
    assert "over [0, 1, 2, 3], n in groups of 2" in PlanFacts(plan)._op_box(fc, None).tooltip
    line = plan.timeline(hardware=Hardware.named(H100))
    for rank, partner in ((0, 2), (1, 3), (2, 0), (3, 1)):
        ring = [c for c in line.collectives if c.kind == "ring_pass" and c.rank == rank]
        assert len(ring) == LAYERS * 1 + LAYERS * 2           # one pass forward, two backward, per layer
        assert f"ring step 1/1 of blocks.0.attn: keys and values of device {partner}" in {c.unit for c in ring}


TP_CP_CELL = BROWSER_CELL.replace("'context_parallel': 4", "'context_parallel': 2").replace(
    "HTML(TimelineView(", "HTML(plan._repr_html_() + TimelineView(")


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_tp_inside_cp_in_the_browser(tmp_path):
    """JupyterLab in Chromium: the card of a tp 2 x cp 2 plan names both kinds of group, and the
    timeline draws each rank's ring steps (one forward and two backward a layer)."""
    with _ring_in_lab(tmp_path, "tp_cp", TP_CP_CELL) as (lab, rects):
        card = lab.page.locator(".nbs-plan-card").inner_text()
        assert "context parallel (ring) over [0, 2]" in card and "[0, 1], [2, 3]" in card
        assert len(rects) == N * (LAYERS * 1 + LAYERS * 2)
        lab.screenshot("tp-inside-cp-card", ".nbs-plan-card")
        lab.screenshot("tp-inside-cp-timeline", ".nbs-timeline")
