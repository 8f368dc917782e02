"""GraphView's state without a browser: what each pane shows after a compile, an expansion, a
selection, a search and an update with another policy, and that its bytes are the plan's."""

import html
import inspect
import re

import pytest
import torch

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.glossary import GLOSSARY_URL
from nbscaler.models import gpt
from nbscaler.models.gpt import GPTConfig
from nbscaler.widgets import GraphView
from nbscaler.widgets.graph import layout as layout_module
from nbscaler.widgets.graph.facts import INPUTS, OUTPUTS
from nbscaler.widgets.graph.tree import is_op_key, node_of
from tests.models import batch, build

N_LAYER = 24


# A 24-layer GPT (small widths: tracing is the slow part) under tp on 2 devices, 2 units.
PLAN = dict(policy="tp", config=ComputeConfig(2, 4),
            model=GPTConfig(n_layer=N_LAYER, d_model=32, n_head=2, seq_len=16, vocab_size=64))


@pytest.fixture(scope="module")
def pipeline_plan(plan):
    cfg = ComputeConfig(2, 2, use_end2end=True, use_pipeline=True, pipeline_nmicros=2, pipeline_nstages=2)
    return plan.replan("pp", cfg)


def device_bytes(plan, rank):
    rows = plan.collectives
    device = plan.config.device_of(rank)
    return rows[rows.devices.map(lambda g: device in g)].bytes_per_device.sum()


def test_opens_collapsed_by_module(plan):
    view = GraphView(plan)
    assert view.expanded == {"blocks"}                      # the list of layers opens, nothing else
    scene = view.scene()
    modules = [k for k in scene.boxes if not is_op_key(k) and not k.startswith("@")]
    assert modules == ["tok", "pos"] + [f"blocks.{i}" for i in range(N_LAYER)] + ["ln_f", "head"]
    assert scene.frames == {"blocks": [f"blocks.{i}" for i in range(N_LAYER)]}
    assert len(scene.boxes) < 40 < len(plan.graph)
    assert {INPUTS, OUTPUTS} <= set(scene.boxes)
    assert view.panes == ["logical", "rank 0", "rank 1", "rank 2", "rank 3"]
    assert set(view.widget.svgs) == set(view.panes)
    svg = view.widget.svgs["logical"]
    assert svg.count('class="nbs-box nbs-module"') == len(modules) and 'data-key="blocks.23"' in svg
    # colour by placement: every block runs on both devices, split marks name the split dims
    block = scene.boxes["blocks.0"]
    assert [d for d, _ in block.shares] == [0, 1] and abs(sum(s for _, s in block.shares) - 1) < 1e-9
    assert set(block.split.split()) <= {"n", "k+", "d2", "h"} and "n" in block.split    # h: attention by heads


def test_expand_and_collapse_one_level(plan):
    view = GraphView(plan)
    view.expand("blocks.3")
    scene = view.scene()
    assert "blocks.3" in scene.frames and "blocks.3" not in scene.boxes
    assert {"blocks.3.ln1", "blocks.3.attn", "blocks.3.ln2", "blocks.3.mlp"} <= set(scene.boxes)
    adds = [k for k in scene.frames["blocks.3"] if is_op_key(k)]
    assert [plan.graph.nodes[node_of(k)].target for k in adds] == ["Tensor.add", "Tensor.add"]
    assert 'data-key="blocks.3.attn"' in view.widget.svgs["rank 1"]
    view.expand("blocks.3.attn")
    assert len(view.scene().frames["blocks.3.attn"]) == 12
    view.collapse("blocks.3")                                # closes what was open inside it too
    assert view.expanded == {"blocks"}
    # the browser sets the traitlet directly; a module whose parent is closed is dropped
    view.widget.expanded = ["blocks", "blocks.5", "blocks.7.mlp"]
    assert view.expanded == {"blocks", "blocks.5"}
    view.reset()
    assert view.expanded == {"blocks"}
    with pytest.raises(ValueError, match="no module 'blocks.99'"):
        view.expand("blocks.99")


def test_edge_bytes_add_up_to_plan_collectives(plan):
    view = GraphView(plan)
    total = plan.collectives.bytes_per_device.sum()
    assert total > 0
    for opened in ([], ["blocks.3"], ["blocks.3", "blocks.3.attn", "blocks.3.mlp"]):
        for path in opened:
            view.expand(path)
        assert view.scene().total_bytes() == total
        for rank in range(plan.config.runtime_ngpus):
            assert view.scene(f"rank {rank}").total_bytes() == device_bytes(plan, rank)
    edges = view.scene().edges
    assert any(e.bytes > 0 for e in edges) and max(e.bytes for e in edges) < total


def test_op_edges_carry_their_own_collectives(plan):
    """With a block open down to its ops, each op-to-op edge holds exactly its rows of plan.collectives."""
    view = GraphView(plan)
    block = [p for p in view._model.tree.modules if p == "blocks.1" or p.startswith("blocks.1.")]
    view.expanded = set(view.expanded) | set(block)
    rows = plan.collectives
    checked = 0
    for e in view.scene().edges:
        if is_op_key(e.src) and is_op_key(e.dst):
            producer = plan.graph.nodes[node_of(e.src)].name
            mine = rows[(rows.producer == producer) & (rows.consumer_index == node_of(e.dst))]
            assert e.bytes == mine.bytes_per_device.sum(), (producer, e)
            assert set(e.collectives) == set(mine.collective)
            checked += bool(len(mine))
    assert checked >= 3
    svg = view.widget.svgs["logical"]
    assert re.search(r'class="nbs-edge-label"[^>]*>all_reduce · sum_grad', svg)   # the collectives named on their edge


def test_selection_reveals_and_details(plan):
    view = GraphView(plan)
    fc = int(plan.ops[plan.ops.module == "blocks.5.mlp.fc"].id.iloc[0])
    view.selected = fc                                       # no reveal: the box holding it is marked
    assert view.widget.marks["selected"] == ["blocks.5"]
    view.select(fc)                                          # reveal: the modules around it open
    assert {"blocks.5", "blocks.5.mlp", "blocks.5.mlp.fc"} <= view.expanded
    assert view.widget.marks["selected"] == [f"#{fc}"]
    details = view.widget.details
    assert "*0 *1 k+, n k+, n -&gt; *0 *1 n" in details and "split &#x27;n&#x27;" in details
    assert "(2, 16, 128)" in details and "(2, 16, 64)" in details           # global and local output shapes
    fc_line = next(i for i, text in enumerate(inspect.getsource(gpt).splitlines(), 1) if "self.fc(x)" in text)
    assert f"gpt.py:{fc_line}" in details and "self.fc(x)" in details       # the user's source line
    for rank, text in plan.sources.items():                                  # the generated line, every rank
        line = plan.source_lines[rank][fc][-1]
        assert html.escape(text.splitlines()[line - 1].strip()) in details
    view.select(None)
    assert view.widget.marks["selected"] == [] and "click an op" in view.widget.details
    with pytest.raises(ValueError, match="not in this plan's graph"):
        view.select(len(plan.graph))


def test_search_by_module_name_and_target(plan):
    view = GraphView(plan)
    view.search = "attn.qkv"
    assert view.matches == [int(i) for i in plan.ops[plan.ops.module.str.contains("attn.qkv")].id]
    assert view.widget.marks["hits"] == sorted(f"blocks.{i}" for i in range(N_LAYER))
    view.search = "scaled_dot_product"
    assert len(view.matches) == N_LAYER
    view.search = "LINEAR_3"                                 # any case, any part of the name
    names = [plan.graph.nodes[i].name for i in view.matches]
    assert "linear_3" in names and "linear_30" in names and all("linear_3" in n for n in names)
    view.search = ""
    assert view.matches == [] and view.widget.marks["hits"] == []


def test_rank_panes_show_what_each_pipeline_rank_runs(pipeline_plan):
    view = GraphView(pipeline_plan)
    assert view.panes == ["logical", "rank 0", "rank 1"]
    for rank in (0, 1):
        scene = view.scene(f"rank {rank}")
        blocks = [k for k in scene.boxes if k.startswith("blocks.")]
        ran = set(pipeline_plan.rank_nodes(rank))
        tree = view._model.tree
        assert blocks and all(set(tree.modules[b].ops) & ran for b in blocks)
        assert scene.total_bytes() == device_bytes(pipeline_plan, rank)
        crossing = [e for e in scene.edges if "send_recv" in e.collectives]
        assert crossing, rank                                # the stage boundary, named on its edge
    first = {k for k in view.scene("rank 0").boxes if k.startswith("blocks.")}
    second = {k for k in view.scene("rank 1").boxes if k.startswith("blocks.")}
    assert first and second and not first & second


@pytest.mark.slow
def test_update_with_another_policy_redraws_in_place(plan):
    view = GraphView(plan)
    widget = view.widget
    view.expand("blocks.2")
    fc = int(plan.ops[plan.ops.module == "blocks.2.mlp.fc"].id.iloc[0])
    view.select(fc)
    view.search = "gelu"
    before = widget.svgs["logical"]
    other = plan.replan("data")
    view.update(other)
    assert view.widget is widget and view.plan is other
    assert "blocks.2" in view.expanded and view.selected == fc and len(view.matches) == N_LAYER
    assert widget.svgs["logical"] != before
    assert view.scene().total_bytes() == other.collectives.bytes_per_device.sum()
    assert "split &#x27;" in widget.details or "replicated" in widget.details
    view.update(plan.replan("tp", ComputeConfig(2, 2)))      # fewer ranks: fewer panes
    assert view.panes == ["logical", "rank 0", "rank 1"] and widget.pane_names == view.panes


def test_panes_can_be_chosen(plan):
    view = GraphView(plan, panes=["rank 2", "logical"])
    assert view.panes == ["logical", "rank 2"] and set(view.widget.svgs) == {"logical", "rank 2"}
    view.widget.panes = ["rank 3"]                          # as the browser's checkboxes do
    assert set(view.widget.svgs) == {"rank 3"}
    with pytest.raises(ValueError, match="unknown pane"):
        view.panes = ["rank 9"]


@pytest.mark.parametrize("model,policy", [("branch", "tp"), ("llama", "tp"), ("cnn", "data"), ("user_op", "tp")])
def test_other_models_add_up(model, policy):
    """Train/eval graphs, GQA attention, convolutions, a registered user op: the view opens, every op
    sits in one box, and the bytes are the plan's."""
    p = nbscaler.plan(build(model), batch(model, 0), policy, ComputeConfig(2, 2))
    view = GraphView(p)
    owners = view._model.tree.owners(view.expanded)
    assert sorted(owners) == list(range(len(p.graph)))
    assert view.scene().total_bytes() == p.collectives.bytes_per_device.sum()
    for rank in (0, 1):
        assert view.scene(f"rank {rank}").total_bytes() == device_bytes(p, rank)
    first = next(i for i in range(len(p.graph)) if p.source_lines[0].get(i))
    view.select(first)
    assert "rank 1" in view.widget.details


def test_layouts_are_cached_and_never_of_the_flat_graph(plan, monkeypatch):
    sizes = []
    real = layout_module._start_dot

    def counting(text):
        sizes.append(text.count("[width="))
        return real(text)

    monkeypatch.setattr(layout_module, "_start_dot", counting)
    view = GraphView(plan)
    view.expand("blocks.4")
    view.expand("blocks.4.mlp")
    assert sizes and max(sizes) < len(plan.graph) / 5         # only the visible level is laid out
    calls = len(sizes)
    view.collapse("blocks.4")
    view.update(plan.replan("data"))                          # same model, same level: same layout
    view.expand("blocks.4")
    assert len(sizes) == calls


def test_to_html_is_self_contained(plan):
    view = GraphView(plan)
    page = view.to_html()
    assert page.count("<svg") == 1 and 'data-key="blocks.0"' in page and "<style>" in page
    # the one link is the glossary's, which the legend starts with; it fetches nothing
    link = f'<a href="{GLOSSARY_URL}" target="_blank">'
    assert page.index(link) < page.index("device 0") and "column-parallel" in page
    rest = page.replace(link, "")
    assert "<script" not in rest and not re.search(r'\s(src|href)=|https?://(?!www\.w3\.org/2000/svg)', rest)
    assert page.isascii()                                    # right under any page charset
    bundle = view._repr_mimebundle_()
    assert bundle["text/html"] == page
    assert "application/vnd.jupyter.widget-view+json" in bundle


BROWSER_CELLS = (
    "import nbscaler\n"
    "from nbscaler import ComputeConfig\n"
    "from nbscaler.models.gpt import GPT, GPTConfig, sample_batch\n"
    "from nbscaler.widgets import CodeView, GraphView\n"
    "cfg = GPTConfig(n_layer=4, d_model=32, n_head=2, seq_len=16, vocab_size=64)\n"
    "plan = nbscaler.plan(GPT(cfg), {'batch': sample_batch(cfg, 2)}, 'tp', ComputeConfig(2, 2))\n"
    "graph = GraphView(plan)\n"
    "code = CodeView(plan).link(graph)\n"
    "graph",
    "code",
)


@pytest.mark.browser
def test_graph_in_the_browser(tmp_path):
    """JupyterLab in Chromium: the graph opens collapsed in three panes; clicking a block expands it
    in every pane, clicking an op selects it everywhere and scrolls the code to it, the search box
    marks hits, clicking the frame's label collapses the block again."""
    from tests.widgets.browser import lab_page, write_notebook

    namespace = {}
    exec(BROWSER_CELLS[0].rsplit("\n", 1)[0], namespace)     # the notebook's plan, to know its node ids
    ops = namespace["plan"].ops
    block_op = int(ops[ops.module == "blocks.1"].id.iloc[0])
    write_notebook(tmp_path / "graph.ipynb", *BROWSER_CELLS)
    with lab_page(tmp_path, tmp_path / "screenshots") as lab:
        lab.open_notebook("graph.ipynb")
        lab.run_all_cells()
        page = lab.page
        view = page.locator(".nbs-graphview").first
        view.wait_for(timeout=120_000)
        panes = view.locator(".nbs-pane")
        panes.nth(2).locator("svg").wait_for()
        assert [panes.nth(i).locator(".nbs-pane-title").inner_text() for i in range(3)] == ["logical", "rank 0",
                                                                                              "rank 1"]
        assert view.locator('.nbs-box[data-key="blocks.1"]').count() == 3
        lab.screenshot("graph-opened", ".nbs-graphview")

        panes.first.locator('.nbs-box[data-key="blocks.1"]').click()             # expand, through the kernel
        view.locator('.nbs-frame[data-key="blocks.1"]').nth(2).wait_for()
        assert view.locator('.nbs-box[data-key="blocks.1.attn"]').count() == 3

        key = f"#{block_op}"                                # the residual add that blocks.1 calls itself
        panes.first.locator(f'.nbs-box[data-key="{key}"]').click()
        view.locator(".nbs-details table").wait_for()
        assert view.locator(f'.nbs-box.nbs-selected[data-key="{key}"]').count() == 3   # synced across panes
        assert "annotation" in view.locator(".nbs-details").inner_text()
        page.locator(".nbs-codeview .nbs-code-marked").first.wait_for()
        assert "add" in page.locator(".nbs-codeview .nbs-code-caption").inner_text()

        view.locator(".nbs-search").fill("mlp")
        view.locator(".nbs-box.nbs-hit").first.wait_for()
        assert "ops found" in view.locator(".nbs-count").inner_text()
        lab.screenshot("graph-expanded-selected", ".nbs-graphview")
        lab.screenshot("code-following", ".nbs-codeview")

        lab.screenshot("graph-details", ".nbs-details-panel")

        panes.first.locator('.nbs-frame[data-key="blocks.1"] .nbs-frame-label').click()  # collapse
        view.locator('.nbs-box[data-key="blocks.1"]').nth(2).wait_for()
        assert view.locator('.nbs-frame[data-key="blocks.1"]').count() == 0
        view.locator('.nbs-pane-toggle input[data-pane="rank 1"]').uncheck()          # hide a pane
        page.wait_for_function("document.querySelectorAll('.nbs-graphview .nbs-pane').length === 2")
        panes.first.locator('.nbs-box[data-key="blocks.2"]').click()
        view.locator('.nbs-frame[data-key="blocks.2"]').nth(1).wait_for()
        view.locator(".nbs-reset").click()                                            # collapse all
        view.locator('.nbs-box[data-key="blocks.2"]').nth(1).wait_for()
        assert view.locator('.nbs-frame[data-key="blocks.2"]').count() == 0
        assert not [line for line in lab.console if line.startswith("error")], lab.console


class LongFunctional(torch.nn.Module):
    """Two hundred ops called at the top level, no submodule to collapse them into."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        for _ in range(100):
            x = torch.tanh(x @ self.w)
        return x.sum()


def test_a_long_functional_forward_opens_in_segments():
    p = nbscaler.plan(LongFunctional(), {"x": torch.randn(4, 8)}, "dp", ComputeConfig(1, 1))
    view = GraphView(p)
    scene = view.scene()
    assert len(p.graph) > 200 and len(scene.boxes) <= 12          # segments, not 200 boxes
    segments = [k for k in scene.boxes if k.startswith("ops")]
    assert segments[0] == "ops0-31"
    view.expand(segments[1])
    assert [k for k in view.scene().frames[segments[1]]] == [f"#{i}" for i in range(32, 64)]
    view.select(150)
    assert view.widget.marks["selected"] == ["#150"] and "ops128-159" in view.expanded
    assert view.scene().total_bytes() == p.collectives.bytes_per_device.sum()


def test_a_cached_layout_serves_a_scene_of_the_same_shape_with_other_keys(plan):
    # DOT names boxes by position, so two plans (two models, say) can share one cached layout; each
    # must get it under its own box keys.
    from nbscaler.widgets.graph.model import GraphModel
    from nbscaler.widgets.graph.scene import Edge, Scene
    scene = GraphModel(plan).scene("logical", frozenset())
    key = {k: f"{k}'" for k in scene.boxes}
    renamed = Scene({key[k]: b for k, b in scene.boxes.items()},
                    [Edge(key[e.src], key[e.dst], e.tensors, e.bytes, e.collectives) for e in scene.edges],
                    {}, [key.get(k, k) for k in scene.top])
    first, second = layout_module.layout_scenes([scene, renamed])
    assert set(second.boxes) == set(renamed.boxes) and set(first.boxes) == set(scene.boxes)
    assert all(second.boxes[key[k]] == first.boxes[k] for k in scene.boxes)
