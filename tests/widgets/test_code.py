"""CodeView's state without a browser: the files, the rank selector, and following a selection."""

import html
import re

import pytest

from nbscaler import ComputeConfig
from nbscaler.models.gpt import GPTConfig
from nbscaler.widgets import CodeView, GraphView


PLAN = dict(policy="tp", config=ComputeConfig(2, 4),
            model=GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=64))


@pytest.fixture(scope="module")
def pipeline_plan(plan):
    cfg = ComputeConfig(2, 2, use_end2end=True, use_pipeline=True, pipeline_nmicros=2, pipeline_nstages=2)
    return plan.replan("pp", cfg)


def line_text(page: str, n: int) -> str:
    """The text of line ``n`` of highlighted HTML, tags and line number stripped."""
    span = re.search(rf'<span id="nbs-line-{n}">(.*?)\n</span>', page, re.S).group(1)
    return html.unescape(re.sub(r"<[^>]+>", "", re.sub(r'<span class="linenos">\s*\d+</span>', "", span)))


def test_each_rank_file_highlighted(plan):
    code = CodeView(plan)
    w = code.widget
    assert w.ranks == [0, 1, 2, 3] and code.rank == 0
    assert 'class="nbs-hl"' in w.html and '<span class="kn">import</span>' in w.html
    lines = plan.sources[0].splitlines()
    assert w.html.count('<span id="nbs-line-') == len(lines)
    assert line_text(w.html, 1).startswith('"""nbscaler generated code for rank 0')
    code.rank = 3
    assert "rank 3: plan device 1 of 2, unit 1 of 2" in line_text(w.html, 1)
    w.rank = 1                                            # as the browser's selector does
    assert "rank 1" in line_text(w.html, 1) and w.caption == "gencode1.py"
    with pytest.raises(ValueError, match="rank 7 is not in this plan"):
        code.rank = 7


def test_show_marks_the_lines_that_run_an_op(plan):
    code = CodeView(plan, rank=2)
    qkv = int(plan.ops[plan.ops.module == "blocks.1.attn.qkv"].id.iloc[0])
    code.show(qkv)
    assert code.rank == 2 and code.lines == plan.source_lines[2][qkv]
    assert line_text(code.widget.html, code.lines[-1]).strip().startswith(plan.graph.nodes[qkv].name + ': "f32[')
    assert "comm.sum_grad" in line_text(code.widget.html, code.lines[0])   # the collective its input needed
    assert plan.graph.nodes[qkv].name in code.widget.caption
    code.show(None)
    assert code.lines == [] and code.node is None


def test_show_switches_to_a_rank_that_runs_the_op(pipeline_plan):
    code = CodeView(pipeline_plan)
    last = len(pipeline_plan.graph) - 1                   # the loss: last stage only
    code.show(last)
    assert code.rank == 1 and code.lines == pipeline_plan.source_lines[1][last]
    first = pipeline_plan.rank_nodes(0)[0]
    code.show(first)
    assert code.rank == 0 and code.lines


def test_link_follows_the_graph_selection(plan):
    graph = GraphView(plan, panes=["logical"])
    code = CodeView(plan).link(graph)
    fc = int(plan.ops[plan.ops.module == "blocks.0.mlp.fc"].id.iloc[0])
    graph.select(fc)
    assert code.node == fc and code.lines == plan.source_lines[0][fc]
    graph.widget.selected = fc + 1                        # as a click in the browser does
    assert code.node == fc + 1
    shown = []
    code.show = shown.append
    code.link(graph)                                      # again: shows the selection, adds no observer
    graph.select(fc)
    assert shown == [fc + 1, fc]


def test_update_keeps_the_rank_and_redraws(plan):
    code = CodeView(plan, rank=3)
    before = code.widget.html
    other = plan.replan("data")
    code.update(other)
    assert code.rank == 3 and code.widget.html != before
    assert line_text(code.widget.html, 3).strip() == f"Module: {other.module_name}    policy: data"
    code.update(plan.replan("tp", ComputeConfig(2, 2)))
    assert code.widget.ranks == [0, 1] and code.rank == 0


def test_to_html_is_self_contained(plan):
    code = CodeView(plan)
    page = code.to_html()
    assert page.count("<details") == plan.config.plan_ngpus and "rank 2 runs the same code" in page
    assert "<style>" in page and ".nbs-codeview .nbs-hl .k" in page
    assert "<script" not in page and not re.search(r"\s(src|href)=|https?://", page)
    assert page.isascii()                                    # right under any page charset
    bundle = code._repr_mimebundle_()
    assert bundle["text/html"] == page and "application/vnd.jupyter.widget-view+json" in bundle


def test_a_view_generates_only_the_ranks_it_shows(plan):
    """A rank's file is generated when first read: opening rank 2 of a fresh plan writes that file
    alone (a 64-device plan's view would otherwise generate 64 files first)."""
    fresh = plan.replan("tp", plan.config)
    view = CodeView(fresh, rank=2)
    assert list(fresh._generated._made) == [2]
    assert 2 in fresh.sources and 9 not in fresh.sources and sorted(fresh.sources) == [0, 1, 2, 3]
    view.rank = 1
    assert sorted(fresh._generated._made) == [1, 2]


def test_the_saved_html_of_a_wide_unit_holds_the_shown_file_alone(plan):
    """Up to SAVED_RANKS devices every file of the unit is saved; beyond, the shown rank's alone."""
    from nbscaler.widgets.code import SAVED_RANKS
    assert CodeView(plan).to_html().count("<details") == plan.config.plan_ngpus <= SAVED_RANKS
    wide = plan.replan("tp", ComputeConfig(2 * SAVED_RANKS, 2 * SAVED_RANKS))
    page = CodeView(wide, rank=5).to_html()
    assert page.count("<details") == 1 and "rank 5: gencode5.py" in page
    assert list(wide._generated._made) == [5]
