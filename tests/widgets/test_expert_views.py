"""The views of a mixture of experts under expert parallelism (8 experts, top-2, split over 2
devices): the experts op named by what it cuts and by the experts each device holds, in the graph,
the plan table and the plan card; its all-to-alls in the timeline's collectives lanes; the experts'
weights, gradients and optimizer state in the memory view, halved per rank by expert parallelism;
a real routing's imbalance per step, per expert and per rank (a RoutingLog drawn); in Python and in
a real browser."""

import os
from pathlib import Path

import pytest
import torch

from nbscaler import Hardware
from nbscaler.glossary import experts_text, split_text
from nbscaler.ir.expert_rules import EXPERT_OPS, held_experts
from nbscaler.planning.tables import plan_html
from nbscaler.widgets import GraphView, MemoryView, PlanView, TimelineView
from nbscaler.widgets.memory import EXPERT_NOTE
from nbscaler.experts import RoutingLog
from nbscaler.models.moe import sample_batch
from nbscaler.widgets.palette import (COLLECTIVE_COLOURS, EXPERT_MEMORY_COLOURS, MEMORY_COLOURS, OTHER_COLOUR,
                                      rank_colour)
from nbscaler.widgets.routing import DROPPED, RoutingView
from nbscaler.widgets.timeline import EXPERT_ASSUMPTION
from tests.widgets.compiled import MOE_EXPERTS, MOE_TOP_K, llama_tp, moe_data_parallel, moe_expert_parallel, moe_llama
from tests.widgets.svg import charts, hint, marks, texts

DASH = "\u2013"
H100 = "H100-SXM-80GB"
LAYERS, RANKS = 2, 2
EXCHANGE, COUNTS = "expert all-to-all (expert parallel)", "expert counts (expert parallel)"
EXPERT_FILLS = {COLLECTIVE_COLOURS["expert_exchange"], COLLECTIVE_COLOURS["expert_counts"]}


def expert_ops(plan):
    return [n for n in plan.graph.nodes if n.target in EXPERT_OPS]


def test_an_expert_parallel_split_is_named_by_what_it_cuts():
    assert split_text("n", "dropless_experts", "experts") == "tokens (expert parallel, dropless; n)"
    assert split_text("n", "capacity_experts", "experts") == "tokens (expert parallel, capacity; n)"
    assert experts_text(range(8), 8, 2, "dropless") == f"experts 0{DASH}7, top-2, dropless"
    assert experts_text(range(4, 8), 8, 2, "capacity") == "experts 4..7 of 8, top-2, capacity"


def test_each_device_holds_its_share_of_the_experts_and_the_generated_code_says_so():
    plan = moe_expert_parallel()
    for node in expert_ops(plan):
        assert [held_experts(node, d) for d in (0, 1)] == [range(0, 4), range(4, 8)]
        assert held_experts(node) == range(MOE_EXPERTS)
    for rank, holds in ((0, "0..3"), (1, "4..7")):
        assert plan.sources[rank].count(f"this device holds experts {holds} of 8") == 2


def test_the_graph_names_the_experts_and_in_each_rank_pane_those_it_holds():
    plan = moe_expert_parallel()
    view = GraphView(plan)
    view.expanded = {"blocks", "blocks.0", "blocks.0.moe"}
    first = expert_ops(plan)[0]
    key = f"#{plan.graph.nodes.index(first)}"
    logical = view.scene().boxes[key]
    assert logical.subtitle == f"experts 0{DASH}7, top-2, dropless" and logical.split == "n"
    assert "tokens (expert parallel, dropless), over [0, 1]" in logical.tooltip
    for rank, held in ((0, "experts 0..3 of 8"), (1, "experts 4..7 of 8")):
        box = view.scene(f"rank {rank}").boxes[key]
        assert box.subtitle == f"{held}, top-2, dropless" and f"on device {rank}" in box.tooltip
        assert f"{held}, top-2, dropless" in view.widget.svgs[f"rank {rank}"]
    page = view.to_html()
    assert page.isascii() and "experts 0&#8211;7, top-2, dropless" in page


def test_the_plan_table_and_card_show_the_experts_split_over_the_expert_group():
    plan = moe_expert_parallel()
    view = PlanView(plan)
    assert list(view.table.options) == ["ops", "collectives", "experts"]
    rows = view.experts
    assert list(rows.op) == ["dropless_experts_0"] * 2 + ["dropless_experts_1"] * 2
    assert list(rows.experts) == [f"experts {h} of 8, top-2, dropless" for h in ("0..3", "4..7")] * 2
    assert set(rows.layout) == {"experts split over the expert group [0, 1]: split on dim 0 (S(0))"}
    whole = sum(plan.graph.weights[f"blocks.0.moe.experts.{w}"].nbytes for w in ("w1", "w3", "w2"))
    assert list(rows.held_bytes) == [whole // 2] * 4
    view.table.value = "experts"
    assert view.shown.equals(rows) and "nbs-experts" in view.html.value
    ops = view.ops.set_index("name")
    assert split_text(ops.split["dropless_experts_0"], "dropless_experts", view.contexts["dropless_experts_0"]) \
        == "tokens (expert parallel, dropless; n)"
    page = view.to_html()
    assert "tokens (expert parallel, dropless; n)" in page and "<h4>experts (4" in page
    card = plan_html(plan)
    assert "<b>Experts</b>: expert parallel" in card and "<td>experts 4..7 of 8, top-2, dropless</td>" in card
    assert "tokens (expert parallel, dropless; n)" in card



def expert_calls(line, rank):
    return [c for c in line.collectives if c.rank == rank and c.kind in ("expert_exchange", "expert_counts")]


def test_each_expert_ops_all_to_alls_are_drawn_where_it_runs_them():
    plan = moe_expert_parallel()
    line = plan.timeline(hardware=Hardware.named(H100))
    for rank in range(RANKS):
        calls = expert_calls(line, rank)
        assert len(calls) == LAYERS * 3 + LAYERS * 2            # counts, out, back; the rows' gradients both ways
        assert all(not c.context and not c.sync and c.t_end > c.t_start for c in calls)
        assert all(c.waited_s == pytest.approx(c.t_end - c.t_start) for c in calls)     # the block waits for each
        (fwd,) = [b for b in line.blocks if b.rank == rank and b.phase == "F"]
        (bwd,) = [b for b in line.blocks if b.rank == rank and b.phase == "B"]
        forward = sorted((c for c in calls if c.phase == "F"), key=lambda c: c.t_start)
        assert [c.unit for c in forward[:3]] == ["blocks.0.moe: pairs per expert, to every device",
                                                 "blocks.0.moe: rows out to their experts",
                                                 "blocks.0.moe: rows back from the experts"]
        counts, out, back = forward[:3]
        assert counts.t_end == pytest.approx(out.t_start) and out.t_end < back.t_start      # the products between
        assert all(fwd.t_start <= c.t_start and c.t_end <= fwd.t_end for c in forward)
        backward = sorted((c for c in calls if c.phase == "B"), key=lambda c: c.t_start)
        assert [c.unit for c in backward[:2]] == ["blocks.1.moe: rows' gradients out to the experts",
                                                  "blocks.1.moe: rows' gradients back home"]
        assert all(bwd.t_start <= c.t_start and c.t_end <= bwd.t_end for c in backward)
    # the same all-to-alls as the traffic table's rows: two exchanges each way and one count per op
    rows = plan.collectives_on("nccl")
    counted = rows.collective.value_counts()
    assert (counted["expert_exchange"], counted["expert_counts"]) == (4 * LAYERS, LAYERS)


def test_capacity_routing_exchanges_no_counts():
    line = moe_expert_parallel("capacity").timeline(hardware=Hardware.named(H100))
    calls = expert_calls(line, 0)
    assert {c.kind for c in calls} == {"expert_exchange"} and len(calls) == LAYERS * 4


def test_the_timeline_view_draws_the_all_to_alls_in_figure_and_svg():
    view = TimelineView(moe_expert_parallel(), hardware=Hardware.named(H100))
    per_rank = {"expert_exchange": LAYERS * 4, "expert_counts": LAYERS}
    for kind, name in (("expert_exchange", EXCHANGE), ("expert_counts", COUNTS)):
        (trace,) = [t for t in view.figure.data if t.name == name]
        assert len(trace.x) == RANKS * per_rank[kind] and trace.marker.color == COLLECTIVE_COLOURS[kind]
    (chart,) = charts(view.notebook_html())
    drawn = [b for b in marks(chart, "rect", "nbs-block") if ".moe: " in hint(b)]
    assert len(drawn) == RANKS * sum(per_rank.values())
    assert {b.get("fill") for b in drawn} == EXPERT_FILLS
    assert any(hint(b).startswith("predicted rank 1 · collectives: blocks.0.moe: rows out to their experts in the "
                                  "forward of micro-batch 0") for b in drawn)
    assert all("the compute waits" in hint(b) for b in drawn)
    assert EXCHANGE in texts(chart) and COUNTS in texts(chart)
    assert EXPERT_ASSUMPTION in view.assumptions and "ZeRO stage 3" not in view.assumptions


def expert_weight_bytes(plan, device):
    """The bytes of the expert weights plan ``device`` stores, read off its weight table."""
    return sum(w.nbytes for w in plan.programs.weights(device) if ".experts." in w.name)


def test_the_memory_view_draws_the_experts_part_split_by_expert_parallelism():
    split, whole = (MemoryView(p, optimizer=torch.optim.AdamW) for p in (moe_expert_parallel(), moe_data_parallel()))
    per_layer = 3 * MOE_EXPERTS * 32 * 16 * 4                   # w1, w3, w2 of 8 experts, fp32
    assert list(whole.experts.param_bytes) == [LAYERS * per_layer] * RANKS
    assert list(split.experts.param_bytes) == [LAYERS * per_layer // 2] * RANKS          # half the experts each
    assert list(split.experts.param_bytes) == [expert_weight_bytes(split.plan, d) for d in range(RANKS)]
    assert list(split.experts.grad_bytes) == list(split.experts.param_bytes)             # every gradient held
    adam = split.experts.optimizer_bytes / split.experts.param_bytes                      # two moments, and steps
    assert all(2.0 <= r < 2.01 for r in adam)
    kinds = ("param_bytes", "grad_bytes", "optimizer_bytes")
    assert (split.experts[list(kinds)].to_numpy() <= split.predicted[list(kinds)].to_numpy()).all()
    shown = {t.name: list(t.y) for t in split.figure.data}
    assert shown["expert weights"] == list(split.experts.param_bytes)
    assert [a + b for a, b in zip(shown["expert weights"], shown["parameters"])] == list(split.predicted.param_bytes)
    (chart,) = charts(split.notebook_html())
    parts = [r for r in marks(chart, "rect") if r.get("fill") == EXPERT_MEMORY_COLOURS["param_bytes"]]
    assert any(hint(r) == "rank 1, expert weights (predicted): 48 KiB" for r in parts)
    assert {"expert weights", "expert gradients", "expert optimizer state"} <= set(texts(chart))
    assert EXPERT_NOTE in split.table_html().replace("&#x27;", "'")
    dense = MemoryView(llama_tp())                               # no experts: nothing drawn of them
    assert dense.experts is None and "expert weights" not in {t.name for t in dense.figure.data}
    assert MEMORY_COLOURS["param_bytes"] != EXPERT_MEMORY_COLOURS["param_bytes"]


STEPS = 3


def routed_steps(routing="dropless"):
    """A RoutingLog of 3 real training steps of ``moe_llama`` (another batch each, SGD between)."""
    torch.manual_seed(0)
    model, _ = moe_llama(routing)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with RoutingLog() as log:
        for step in range(STEPS):
            model(**sample_batch(model.config, 2, seed=step)).backward()
            optimizer.step()
            optimizer.zero_grad()
            log.next_step()
    return log


def test_the_routing_view_counts_pairs_per_expert_and_per_rank_each_step():
    log = routed_steps()
    frame = log.frame()
    assert sorted(set(frame.step)) == list(range(STEPS)) and frame.groupby("step").call.nunique().eq(LAYERS).all()
    view = RoutingView(log, moe_expert_parallel())
    assert view.holders == [("rank 0", range(0, 4)), ("rank 1", range(4, 8))]
    pairs = 2 * 16 * MOE_TOP_K * LAYERS                          # tokens x top-k, in each MoE layer
    assert list(view.per_step.pairs) == [pairs] * STEPS
    assert view.per_rank.groupby("step").routed.sum().eq(pairs).all()
    for step, rows in frame.groupby("step"):                   # the busiest rank, worked out again
        per_call = rows.assign(rank=rows.expert // 4).groupby(["call", "rank"]).routed.sum().unstack()
        expected = per_call.max(axis=1).sum() / per_call.mean(axis=1).sum()
        got = view.per_step.set_index("step").loc[step]
        assert got.rank_imbalance == pytest.approx(expected) and got.rank_imbalance >= 1.0
        assert got.busiest_rank == f"rank {per_call.sum().idxmax()}"
        assert got.busiest_expert == rows.groupby("expert").routed.sum().idxmax()
    assert list(view.per_step.expert_imbalance) == [pytest.approx(x) for x in expert_imbalance(frame)]
    ranks, experts = charts(view.notebook_html())
    rank_bars = [r for r in marks(ranks, "rect", "nbs-bar")]
    assert len(rank_bars) == STEPS * 2 and {r.get("fill") for r in rank_bars} == {rank_colour(0), rank_colour(1)}
    assert len(marks(experts, "rect", "nbs-bar")) == STEPS * MOE_EXPERTS
    assert any(hint(r).startswith("step 2, expert 5 (rank 1): ") for r in marks(experts, "rect", "nbs-bar"))
    first = view.per_step.rank_imbalance.iloc[0]
    assert f"step 0: {first:.2f}x" in texts(ranks) and f"balanced: {pairs // 2:g} pairs each" in texts(ranks)
    assert f"balanced: {pairs // MOE_EXPERTS:g} pairs each" in texts(experts)
    assert "rank 1: experts 4..7" in texts(ranks) and f"{first:.2f}x" in view.table_html()


def expert_imbalance(frame):
    """Per step: the sum over its calls of the busiest expert's pairs over the sum of the mean."""
    calls = frame.groupby(["step", "call"]).routed
    return list((calls.max().groupby("step").sum() / calls.mean().groupby("step").sum()))


def test_without_a_plan_the_ranks_are_given_or_every_rank_holds_every_expert():
    log = routed_steps()
    four = RoutingView(log, expert_parallel=4)
    assert [held for _, held in four.holders] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert four.per_rank.groupby("step").routed.sum().eq(list(RoutingView(log).per_step.pairs)).all()
    assert RoutingView(log).holders == [("every rank", range(MOE_EXPERTS))]
    assert RoutingView(log, moe_data_parallel()).holders == [("every rank", range(MOE_EXPERTS))]
    with pytest.raises(ValueError, match="recorded no call"):
        RoutingView(RoutingLog())


def test_capacity_routing_draws_the_dropped_pairs():
    view = RoutingView(routed_steps("capacity"), moe_expert_parallel("capacity"))
    assert view.per_expert.dropped.sum() > 0
    assert (view.per_expert.served + view.per_expert.dropped).equals(view.per_expert.routed)
    _, experts = charts(view.notebook_html())
    grey = [r for r in marks(experts, "rect", "nbs-bar") if r.get("fill") == OTHER_COLOUR]
    assert len(grey) == (view.per_expert.dropped > 0).sum() and all(" dropped" in hint(r) for r in grey)
    assert DROPPED in texts(experts)

PLAN_SOURCE = (
    "import nbscaler\n"
    "from IPython.display import HTML\n"
    "from nbscaler import ComputeConfig\n"
    "from nbscaler.models.moe import MoEConfig, MoELlama, sample_batch\n"
    "from nbscaler.widgets import GraphView, PlanView, TimelineView\n"
    "cfg = MoEConfig(vocab_size=64, seq_len=16, n_layer=2, d_model=32, n_head=4, n_kv_head=2, n_experts=8, top_k=2,\n"
    "                expert_hidden=16)\n"
    "plan = nbscaler.plan(MoELlama(cfg), sample_batch(cfg, 2), 'tp',\n"
    "                     ComputeConfig(2, 2, pas_config={'expert_parallel': 2}))\n"
)
"""The notebook's first lines: the plan ``moe_expert_parallel`` makes."""
PLAN_CELL = PLAN_SOURCE + "graph = GraphView(plan)\ngraph.expanded = {'blocks', 'blocks.0', 'blocks.0.moe'}\ngraph"
TABLE_CELL = "HTML(PlanView(plan).to_html())"


def browser_lab(tmp_path):
    """JupyterLab in Chromium, its screenshots where ``NBSCALER_SCREENSHOTS`` says (else under ``tmp_path``)."""
    from tests.widgets.browser import lab_page
    return lab_page(tmp_path, Path(os.environ.get("NBSCALER_SCREENSHOTS") or tmp_path / "screenshots"))


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_experts_in_the_graph_and_the_plan_table_in_the_browser(tmp_path):
    """The live graph of the expert-parallel plan with its first MoE layer open: the experts op's box
    in each of the three panes names the experts that pane holds; the saved plan table lists the
    experts by device, their weights split over the expert group."""
    from tests.widgets.browser import write_notebook

    write_notebook(tmp_path / "experts.ipynb", PLAN_CELL, TABLE_CELL)
    with browser_lab(tmp_path) as lab:
        lab.open_notebook("experts.ipynb")
        lab.run_all_cells()
        page = lab.page
        view = page.locator(".nbs-graphview").first
        view.wait_for(timeout=120_000)
        panes = view.locator(".nbs-pane")
        panes.nth(2).locator("svg").wait_for()
        key = f"#{moe_expert_parallel().graph.nodes.index(expert_ops(moe_expert_parallel())[0])}"
        boxes = view.locator(f'.nbs-box[data-key="{key}"]')
        assert boxes.count() == 3
        texts = [boxes.nth(i).text_content() for i in range(3)]
        assert f"experts 0{DASH}7, top-2, dropless" in texts[0]
        assert "experts 0..3 of 8, top-2, dropless" in texts[1] and "experts 4..7 of 8, top-2, dropless" in texts[2]
        for i in range(3):
            boxes.nth(i).scroll_into_view_if_needed()
        boxes.first.click()                                   # selected in every pane, its details below
        view.locator(".nbs-details table").wait_for()
        assert "tokens (expert parallel, dropless)" in view.locator(".nbs-details").inner_text()
        lab.screenshot("experts-graph", ".nbs-graphview")
        table = page.locator(".nbs-plan table.nbs-experts")
        table.wait_for(timeout=60_000)
        rows = table.locator("tbody tr")
        assert rows.count() == 4
        assert "experts 4..7 of 8, top-2, dropless" in rows.nth(1).inner_text()
        assert "experts split over the expert group [0, 1]" in rows.nth(1).inner_text()
        assert "tokens (expert parallel, dropless; n)" in page.locator(".nbs-plan table.nbs-ops").inner_text()
        table.scroll_into_view_if_needed()
        lab.screenshot("experts-plan-table", ".nbs-plan table.nbs-experts")
        assert not [line for line in lab.console if line.startswith("error")], lab.console


TIMELINE_CELL = "HTML(TimelineView(plan, hardware=nbscaler.Hardware.named('H100-SXM-80GB')).notebook_html())"
EXPERT_RECTS = """() => [...document.querySelectorAll('.nbs-timeline svg rect.nbs-block')]
    .filter(r => (r.querySelector('title')?.textContent ?? '').includes('.moe: '))
    .map(r => { const b = r.getBoundingClientRect();
                return {w: b.width, h: b.height, fill: r.getAttribute('fill'),
                        shown: getComputedStyle(r).visibility !== 'hidden'
                               && getComputedStyle(r).display !== 'none'}; })"""


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_the_all_to_alls_in_the_browser(tmp_path):
    """The timeline's saved form (the SVG nbviewer shows) of the expert-parallel plan on an H100:
    every all-to-all is a visible block of its rank's collectives lane, in its own colour, named in the legend."""
    from tests.widgets.browser import write_notebook

    write_notebook(tmp_path / "timeline.ipynb", PLAN_SOURCE, TIMELINE_CELL)
    with browser_lab(tmp_path) as lab:
        lab.open_notebook("timeline.ipynb")
        lab.run_all_cells()
        page = lab.page
        page.locator(".nbs-timeline svg rect.nbs-block").first.wait_for(timeout=120_000)
        rects = page.evaluate(EXPERT_RECTS)
        assert len(rects) == RANKS * LAYERS * 5
        assert all(r["shown"] and r["w"] >= 1 and r["h"] > 10 for r in rects), rects[:3]
        assert {r["fill"] for r in rects} == EXPERT_FILLS
        legend = page.locator(".nbs-timeline").inner_text()
        assert EXCHANGE in legend and COUNTS in legend
        lab.screenshot("experts-timeline", ".nbs-timeline")
        assert not [line for line in lab.console if line.startswith("error")], lab.console


MEMORY_CELL = ("import torch\nfrom nbscaler.widgets import MemoryView\n"
               "HTML(MemoryView(plan, optimizer=torch.optim.AdamW).notebook_html())")
EXPERT_PARTS = """(fills) => [...document.querySelectorAll('.nbs-memory svg rect')]
    .filter(r => fills.includes(r.getAttribute('fill'))
                 && (r.querySelector('title')?.textContent ?? '').startsWith('rank'))
    .map(r => { const b = r.getBoundingClientRect(); return {w: b.width, h: b.height,
                                                             hint: r.querySelector('title').textContent}; })"""


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_the_experts_memory_in_the_browser(tmp_path):
    """The memory view's saved SVG of the expert-parallel plan: on each rank's bar the experts' part of
    the parameters, gradients and optimizer state is a visible segment of its own shade, named in the legend."""
    from tests.widgets.browser import write_notebook

    write_notebook(tmp_path / "memory.ipynb", PLAN_SOURCE, MEMORY_CELL)
    with browser_lab(tmp_path) as lab:
        lab.open_notebook("memory.ipynb")
        lab.run_all_cells()
        page = lab.page
        page.locator(".nbs-memory svg rect").first.wait_for(timeout=120_000)
        parts = page.evaluate(EXPERT_PARTS, list(EXPERT_MEMORY_COLOURS.values()))
        assert len(parts) == RANKS * 3 and all(p["w"] > 20 and p["h"] > 3 for p in parts), parts
        assert {p["hint"].split(" (")[0].split(", ")[1] for p in parts} == {
            "expert weights", "expert gradients", "expert optimizer state"}
        text = page.locator(".nbs-memory").inner_text()
        assert "expert optimizer state" in text and "Routed experts" in text
        lab.screenshot("experts-memory", ".nbs-memory")
        assert not [line for line in lab.console if line.startswith("error")], lab.console


ROUTING_CELL = (
    "import torch\n"
    "from nbscaler.experts import RoutingLog\n"
    "from nbscaler.widgets import RoutingView\n"
    "torch.manual_seed(0)\n"
    "model = MoELlama(cfg)\n"
    "optimizer = torch.optim.SGD(model.parameters(), lr=0.5)\n"
    "with RoutingLog() as log:\n"
    "    for step in range(3):\n"
    "        model(**sample_batch(cfg, 2, seed=step)).backward()\n"
    "        optimizer.step(); optimizer.zero_grad()\n"
    "        log.next_step()\n"
    "from nbscaler.widgets import RoutingView\n"
    "RoutingView(log, plan)"
)


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_the_routing_imbalance_in_the_browser(tmp_path):
    """A notebook trains the MoE Llama 3 steps under a RoutingLog and shows ``RoutingView(log, plan)``: per
    step a bar per rank and per expert, each visible in its rank's colour, the busiest over the mean
    under each step, the balanced share as a line."""
    from tests.widgets.browser import write_notebook

    write_notebook(tmp_path / "routing.ipynb", PLAN_SOURCE, ROUTING_CELL)
    with browser_lab(tmp_path) as lab:
        lab.open_notebook("routing.ipynb")
        lab.run_all_cells()
        page = lab.page
        view = page.locator(".nbs-routing").first
        view.wait_for(timeout=120_000)
        bars = page.evaluate("""() => [...document.querySelectorAll('.nbs-routing svg rect.nbs-bar')].map(r => {
            const b = r.getBoundingClientRect(); return {w: b.width, h: b.height, fill: r.getAttribute('fill')}; })""")
        assert len(bars) == STEPS * (2 + MOE_EXPERTS) and all(b["w"] > 20 and b["h"] > 3 for b in bars), bars[:3]
        assert {b["fill"] for b in bars} == {rank_colour(0), rank_colour(1)}
        text = view.inner_text()
        assert "balanced: 64 pairs each" in text and "step 2: " in text and "rank_imbalance" in text
        lab.screenshot("experts-routing", ".nbs-routing")
        assert not [line for line in lab.console if line.startswith("error")], lab.console


GROUPS_SOURCE = PLAN_SOURCE.replace("sample_batch(cfg, 2)", "sample_batch(cfg, 4)").replace(
    "ComputeConfig(2, 2, pas_config={'expert_parallel': 2})",
    "ComputeConfig(4, 4, pas_config={'expert_parallel': 2, 'expert_tensor_parallel': 2})")
"""A notebook's plan of ``moe_llama`` over 2 expert groups of 2 devices, each cutting its experts by hidden unit."""


def expert_groups_plan():
    scope = {}
    exec(GROUPS_SOURCE, scope)
    return scope["plan"]


def test_experts_cut_two_ways_name_the_groups_and_each_devices_hidden_units():
    """The plan table and card say which experts and hidden units each of the 4 devices holds, a
    quarter of the experts' bytes each, and the graph's rank panes name them on the op's box."""
    plan = expert_groups_plan()
    rows = PlanView(plan).experts
    first = rows[rows.op == "dropless_experts_0"]
    assert list(first.experts) == [f"experts {e} of 8, top-2, dropless, hidden units {h} of 16"
                                   for e in ("0..3", "4..7") for h in ("0..7", "8..15")]
    assert set(first.layout) == {"experts split over 2 expert groups [[0, 1], [2, 3]], each group's experts cut by "
                                 "hidden unit over its devices: split on dim 0, each part split on dim 1 (S(0)xS(1)), "
                                 "split on dim 0, each part split on dim 2 (S(0)xS(2))"}
    whole = sum(plan.graph.weights[f"blocks.0.moe.experts.{w}"].nbytes for w in ("w1", "w3", "w2"))
    assert list(first.held_bytes) == [whole // 4] * 4
    view = GraphView(plan)
    view.expanded = {"blocks", "blocks.0", "blocks.0.moe"}
    key = f"#{plan.graph.nodes.index(expert_ops(plan)[0])}"
    assert view.scene("rank 3").boxes[key].subtitle == "experts 4..7 of 8, top-2, dropless, hidden units 8..15 of 16"
    assert "<td>experts 4..7 of 8, top-2, dropless, hidden units 0..7 of 16</td>" in plan_html(plan)


@pytest.mark.browser
@pytest.mark.timeout(300)
def test_experts_cut_two_ways_in_the_browser(tmp_path):
    """The saved plan table of the 2 x 2 expert grid in JupyterLab: a row per device, each naming its
    experts and hidden units and the two cuts of their weights."""
    from tests.widgets.browser import write_notebook

    write_notebook(tmp_path / "groups.ipynb", GROUPS_SOURCE + TABLE_CELL)
    with browser_lab(tmp_path) as lab:
        lab.open_notebook("groups.ipynb")
        lab.run_all_cells()
        table = lab.page.locator(".nbs-plan table.nbs-experts")
        table.wait_for(timeout=120_000)
        rows = table.locator("tbody tr")
        assert rows.count() == 8
        assert "experts 4..7 of 8, top-2, dropless, hidden units 8..15 of 16" in rows.nth(3).inner_text()
        assert "2 expert groups [[0, 1], [2, 3]]" in rows.nth(3).inner_text()
        table.scroll_into_view_if_needed()
        lab.screenshot("experts-groups-table", ".nbs-plan table.nbs-experts")
        assert not [line for line in lab.console if line.startswith("error")], lab.console
