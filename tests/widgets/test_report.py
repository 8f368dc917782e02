"""write_report and ``nbscaler report DIR``: every view in one file that opens offline."""

import html

import pandas as pd
import pytest
import torch

from nbscaler import ComputeConfig, Hardware, parallelize
from nbscaler.cli import main as cli_main
from nbscaler.genfiles import module_dir
from nbscaler.planning import SavedPlanError, load_plan
from nbscaler.widgets import Measured, write_report
from nbscaler.widgets import report as report_module
from tests.models import batch, build
from tests.widgets.compiled import gpt_on_meta_pp, llama_pp, llama_tp, pipeline_config
from tests.widgets.browser import chromium, lab_page, screenshot, write_notebook
from tests.widgets.offline import external_resources

SECTIONS = ("Plan", "Why this plan", "Ops and collectives", "Timeline", "Memory")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """A 2-stage pipeline compiled to disk (no module loaded): the folder ``nbscaler report`` reads."""
    root = tmp_path_factory.mktemp("gen")
    cfg = pipeline_config(2)
    parallelize(build("llama"), batch("llama", 0), "pp", cfg, gen_savedir=root, load_module=False)
    return root, module_dir(type(build("llama")), root, None)


def test_report_has_every_view_and_loads_nothing(tmp_path):
    runs = pd.DataFrame({"policy": ["tp"], "step_s": [0.01]})
    path = write_report(llama_tp(), tmp_path, runs=runs)
    page = path.read_text()
    assert path == tmp_path / "report.html" and external_resources(page) == []
    assert page.count("Plotly.newPlot") == 2 and page.count("<script type='text/javascript'>/**") == 1
    for title in SECTIONS + ("Runs",):
        assert f"<h2>{title}</h2>" in page
    assert page.count("<tr data-module=") == len(llama_tp().ops) + len(llama_tp().collectives)
    why = page.split("<h2>Why this plan</h2>", 1)[1].split("</section>", 1)[0]
    assert html.escape(llama_tp().explain().splitlines()[0], quote=False) in why     # the policy's own words


@pytest.mark.slow                      # prices the run on this CPU: profiles the GPT's ops first
def test_report_of_a_run_draws_measured_data_and_losses(tmp_path, run):
    plan, timeline, memory = run
    losses = pd.DataFrame({"step": [0, 1, 0, 1], "rank": [0, 0, 1, 1], "loss": [4.2, 4.0, 4.2, 4.0]})
    page = write_report(plan, tmp_path / "run.html", Measured(timeline, memory, losses),
                        optimizer=torch.optim.AdamW).read_text()
    assert "bubble, measured" in page and "<th>gap</th>" in page and "<h2>Losses</h2>" in page
    assert page.count("Plotly.newPlot") == 3


def test_a_failing_view_leaves_the_old_report(tmp_path, monkeypatch):
    path = write_report(llama_tp(), tmp_path / "r.html")
    before = path.read_bytes()

    def broken(*args, **kwargs):
        raise RuntimeError("view failed")

    monkeypatch.setattr(report_module, "MemoryView", broken)
    with pytest.raises(RuntimeError, match="view failed"):
        write_report(llama_tp(), path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["r.html"]


def test_saved_plan_is_the_compiled_one(compiled):
    root, folder = compiled
    import nbscaler
    fresh = nbscaler.plan(build("llama"), batch("llama", 0), "pp", pipeline_config(2))
    saved = load_plan(root)                          # the only module under root
    assert saved.policy_name == "pp" and saved.module_name == fresh.module_name
    pd.testing.assert_frame_equal(saved.ops.drop(columns=["source_file"]), fresh.ops.drop(columns=["source_file"]))
    pd.testing.assert_frame_equal(saved.memory(), fresh.memory())
    assert saved.sources == fresh.sources
    assert saved.replan("dp", ComputeConfig(1, 2)).policy_name == "dp"


@pytest.mark.slow
def test_cli_writes_the_report(compiled, tmp_path, capsys):
    _, folder = compiled
    Measured(memory=load_plan(folder).memory()).save(folder / "measured")
    out = tmp_path / "cli.html"
    assert cli_main(["report", str(folder), "-o", str(out), "--optimizer", "adamw"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    page = out.read_text()
    assert "Memory per rank: pp, AdamW (predicted | measured)" in page and external_resources(page) == []


def test_cli_names_the_problem(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli_main(["report", str(tmp_path)]) == 2
    assert "holds no compiled module" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "graph.pkl").write_bytes(b"not a pickle")
    with pytest.raises(SavedPlanError, match="compile again"):
        load_plan(tmp_path)
    assert list(p.name for p in tmp_path.iterdir() if p.suffix == ".html") == []


@pytest.mark.browser
def test_report_renders_offline_in_chromium(tmp_path, run):
    """Open the report of a measured run from disk; every chart draws, nothing is fetched, the module
    filter works, and the screenshot (kept next to the report) is not blank."""
    plan, timeline, memory = run
    path = write_report(plan, tmp_path / "report.html", Measured(timeline=timeline, memory=memory),
                        optimizer=torch.optim.AdamW)
    with chromium(viewport=(1300, 900)) as page:
        fetched, errors = [], []
        page.on("request", lambda r: fetched.append(r.url))
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(path.as_uri())
        page.wait_for_function("document.querySelectorAll('.nbs-plot .main-svg').length >= 4", timeout=60_000)
        bars = page.eval_on_selector_all(".nbs-timeline .bars path", "ps => ps.length")
        page.select_option("select.nbs-module", "gpt.blocks.0")
        visible = page.eval_on_selector_all(
            "table.nbs-ops tbody tr", "rs => rs.filter(r => r.style.display != 'none').length")
        screenshot(page, tmp_path / "report.png")
    assert [u for u in fetched if not u.startswith("file:")] == [] and errors == []
    assert bars == 2 * 2 * 2                     # predicted and measured: F and B of 2 micro-batches
    ops = plan.ops
    assert visible == ((ops.module == "gpt.blocks.0") | ops.module.str.startswith("gpt.blocks.0.")).sum() > 0


LIVE_CELLS = (
    "import pandas as pd, torch\n"
    "from nbscaler.widgets import Measured, MemoryView, PlanView, TimelineView\n"
    "from tests.widgets.compiled import llama_pp\n"
    "plan = llama_pp()",
    "timeline = TimelineView(plan)\ntimeline",
    "MemoryView(plan, optimizer=torch.optim.AdamW)",
    "PlanView(plan)",
    "timeline.update(measured=Measured(timeline=pd.DataFrame(plan.timeline().to_rows())))",
)


@pytest.mark.browser
def test_live_views_in_jupyterlab(tmp_path):
    """The views as live widgets in JupyterLab: plotly FigureWidgets draw, the table shows, and an
    update redraws the timeline in place (predicted and measured bars in the same output)."""
    write_notebook(tmp_path / "views.ipynb", *LIVE_CELLS)
    with lab_page(tmp_path, tmp_path / "shots") as lab:
        lab.open_notebook("views.ipynb")
        lab.run_all_cells()
        lab.page.wait_for_function("document.querySelectorAll('.js-plotly-plot').length >= 2", timeout=180_000)
        lab.page.wait_for_selector("table.nbs-ops", timeout=60_000)
        # 2 ranks x (F, B) x 4 micro-batches, predicted then measured, in the first output
        bars = "document.querySelector('.js-plotly-plot').querySelectorAll('.bars path').length"
        try:
            lab.page.wait_for_function(f"{bars} === 32", timeout=180_000)
        finally:
            lab.page.screenshot(path=str(tmp_path / "shots" / "live-views-full.png"), full_page=True)
        rows = lab.page.eval_on_selector_all("table.nbs-ops tbody tr", "rs => rs.length")
        saved_forms = lab.page.locator("svg.nbs-chart").count()     # the live widget wins over the SVG
        lab.screenshot("live-views")
    assert rows == len(llama_pp().ops) and saved_forms == 0


@pytest.mark.slow
def test_report_on_a_target_shows_its_summary_timeline_and_what_does_not_fit(tmp_path):
    t4 = Hardware.named("T4")
    page = write_report(gpt_on_meta_pp(), tmp_path / "t4.html", optimizer=torch.optim.AdamW, hardware=t4).read_text()
    assert "under pp on T4 x 8" in page and external_resources(page) == []
    assert "Timeline of one training step: pp on T4 x 8:<br>step" in page           # the figure's title, in lines
    assert "1 of 2 ranks fit in" in page and "exceeds it by" in page
    summary = page.split("<h2>Plan</h2>", 1)[1].split("</section>", 1)[0]
    assert "<th>fits</th>" in summary and "<td>no</td>" in summary and "<td>yes</td>" in summary


def test_cli_draws_the_report_on_named_hardware(compiled, tmp_path, capsys):
    _, folder = compiled
    out = tmp_path / "h100.html"
    assert cli_main(["report", str(folder), "-o", str(out), "--hardware", "H100-SXM-80GB", "--nodes", "2"]) == 0
    assert "under pp on H100-SXM-80GB x 16" in out.read_text()
    capsys.readouterr()
    assert cli_main(["report", str(folder), "-o", str(tmp_path / "no.html"), "--hardware", "H1OO"]) == 2
    assert "no hardware named 'H1OO'" in capsys.readouterr().err and not (tmp_path / "no.html").exists()


@pytest.mark.slow
def test_numbers_print_with_their_units():
    """FLOPs, bytes and seconds are written with units in the summary, the plan card and
    ``explain()``; the frames keep their numbers."""
    from nbscaler.widgets.report import styled_summary, summary_html
    from tests.widgets.compiled import llama_tp

    plan = llama_tp()
    summary = summary_html(plan)
    assert "FLOP</td>" in summary and "iB</td>" in summary and (" ms</td>" in summary or " s</td>" in summary)
    assert plan.summary().flops.dtype.kind == "f"
    assert "FLOP" in styled_summary(plan.summary()).to_html()
    why = plan.explain()
    assert "kFLOP" in why and "e+0" not in why and "(column-parallel)" in why
    assert "FLOP" in why._repr_html_() and "ops by split" in plan._repr_html_()
    assert "column-parallel (n)" in plan._repr_html_()
