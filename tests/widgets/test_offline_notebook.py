"""A saved notebook of chart views, converted to HTML by nbconvert and opened with no network in
Chromium: every chart shows, drawn as the SVG the views save (plotly.js is nowhere in the page).

The notebook is executed in a fresh kernel and kept as the walkthroughs are saved: outputs, and no
widget state (without it, nbconvert skips the live widget and takes the next type it knows, the
``text/html`` the views write). Set ``NBSCALER_SCREENSHOTS=DIR`` to keep the screenshot.
"""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbconvert import HTMLExporter

from nbscaler.columns import MEMORY_CATEGORIES
from tests.widgets.browser import REPO, chromium, screenshot, write_notebook

pytestmark = [pytest.mark.browser, pytest.mark.notebook, pytest.mark.timeout(600)]

CELLS = (
    "import pandas as pd\n"
    "from nbscaler.widgets import Explorer, Measured, MemoryView, TimelineView\n"
    "from tests.widgets.compiled import llama_pp, llama_tp\n"
    "pp, tp = llama_pp(), llama_tp()",
    "TimelineView(pp, Measured(timeline=pd.DataFrame(pp.timeline().to_rows())))",
    "MemoryView(tp, Measured(memory=tp.memory()))",
    "ex = Explorer()\nex.set(policy='pp')\nex.compile()\nex",
)
CHARTS = 4          # the timeline, the memory, and the Explorer's timeline and memory


def saved_notebook_html(folder: Path) -> str:
    """Run the cells in a fresh kernel, drop the widget state as a saved walkthrough has none, and
    convert the notebook to HTML as nbviewer does."""
    nb = nbformat.read(write_notebook(folder / "charts.ipynb", *CELLS), as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO)}}).execute()
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, folder / "charts.ipynb")
    assert (folder / "charts.ipynb").stat().st_size < 1_000_000       # no plotly.js saved
    body, _ = HTMLExporter().from_notebook_node(nb)
    return body


def test_a_saved_notebook_shows_every_chart_offline_in_chromium(tmp_path, monkeypatch):
    # the kernel imports this checkout
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    page_html = saved_notebook_html(tmp_path)
    assert "Plotly.newPlot" not in page_html
    path = tmp_path / "charts.html"
    path.write_text(page_html, encoding="utf-8")
    shots = Path(os.environ.get("NBSCALER_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    with chromium(viewport=(1200, 900)) as page:
        refused = []
        page.route("**/*", lambda route: route.continue_() if route.request.url.startswith("file:")
                   else (refused.append(route.request.url), route.abort()))
        page.goto(path.as_uri(), wait_until="load")
        charts = page.locator("svg.nbs-chart")
        sizes = [charts.nth(i).bounding_box() for i in range(charts.count())]
        visible = [charts.nth(i).is_visible() for i in range(charts.count())]
        blocks = page.locator("svg.nbs-chart rect.nbs-block")
        shown_blocks = [blocks.nth(i).bounding_box() for i in range(blocks.count())]
        bars = page.locator("svg.nbs-chart rect.nbs-bar").count()
        screenshot(page, shots / "offline-notebook.png", full_page=True)
    print(f"refused {len(refused)} requests off this machine: {refused[:5]}")
    assert len(sizes) == CHARTS and all(visible), (len(sizes), visible)
    assert all(box["width"] > 300 and box["height"] > 100 for box in sizes), sizes
    # every block drawn: 2 panels x 2 ranks x (F, B) x 4 micro-batches, and the Explorer's 2 x 2 x 4
    assert len(shown_blocks) == 32 + 16 and all(b["width"] > 0 and b["height"] > 0 for b in shown_blocks)
    # a segment per rank, side and memory kind: 4 ranks x 2 sides beside the Explorer's 2 ranks
    assert bars == (4 * 2 + 2) * len(MEMORY_CATEGORIES)
