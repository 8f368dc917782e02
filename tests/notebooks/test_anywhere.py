"""The walkthroughs where learners meet them, checked without running a kernel (the kernel runs are
``test_notebooks.py``, whose kernels start in ``notebooks/`` as ``make lab`` and Binder start them):

- run on Binder: every module a notebook imports is installed there, by ``binder/requirements.txt``
  or by ``binder/postBuild``'s install of nbscaler with its dependencies; and no notebook imports the
  test suite, which a learner's copy of the notebooks may not have beside it;
- read anywhere: GitHub, nbviewer and nbconvert's HTML run no script, so an output that only a
  script draws (a plotly figure, a live widget) is blank there. Every such output carries a static
  image beside it, in the same cell: an SVG or PNG, or HTML that draws an ``<svg>`` or ``<img>``.
  ``test_saved_charts_show_in_chromium_offline`` opens the HTML and looks.
"""

from __future__ import annotations

import ast
import os
import re
import sys
from pathlib import Path
from typing import Dict, List, Set

import nbformat
import pytest

from nbscaler.walkthroughs import NOTEBOOK_PATTERN

ROOT = Path(__file__).parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob(NOTEBOOK_PATTERN))
BINDER = ROOT / "binder"

DISTRIBUTIONS = {"IPython": "ipython", "PIL": "pillow", "yaml": "pyyaml", "sklearn": "scikit-learn",
                 "google": "protobuf", "mpl_toolkits": "matplotlib"}
"""Import names that differ from the name pip installs them by (the others are the same)."""
THE_KERNEL = {"ipython", "ipykernel"}
"""Installed wherever a notebook runs at all: the kernel itself (repo2docker's Jupyter)."""
REPOSITORY_FOLDERS = {"benchmarks"}
"""Folders of this repository a walkthrough imports from its parent folder (``sys.path.insert(0, "..")``):
Binder's image holds the whole checkout, so they are there with the notebooks."""

INTERACTIVE = ("application/vnd.plotly.v1+json", "application/vnd.jupyter.widget-view+json",
               "application/vnd.vegalite", "application/vnd.bokehjs", "application/javascript")
STATIC_IMAGES = ("image/svg+xml", "image/png", "image/jpeg", "image/gif")


def code_cells(path: Path) -> List[str]:
    return [c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]


def imported(source: str) -> Set[str]:
    """The top-level packages a cell imports, IPython magics and shell lines left out."""
    code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def notebook_imports(path: Path) -> Set[str]:
    """What ``path`` imports from outside the standard library and outside the modules it writes
    itself (notebook 07 writes ``my_ops.py`` and imports it)."""
    cells = code_cells(path)
    written = {m.group(1) for src in cells for m in re.finditer(r"[\"']([A-Za-z_]\w*)\.py[\"']", src)}
    return {name for src in cells for name in imported(src)} - set(sys.stdlib_module_names) - written


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(line: str) -> str:
    """The distribution a requirements line names ('' for a comment, an option or a blank)."""
    line = line.split("#")[0].strip()
    found = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", line) if line and not line.startswith("-") else None
    return normalized(found.group(0)) if found else ""


def project_dependencies() -> Set[str]:
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {normalized(project["name"])} | {requirement_name(d) for d in project["dependencies"]}


def binder_installs() -> Set[str]:
    """The distributions a Binder image of this repository has."""
    named = {requirement_name(line) for line in (BINDER / "requirements.txt").read_text().splitlines()} - {""}
    post = (BINDER / "postBuild").read_text()
    assert re.search(r"pip install .*-e \.(\s|$)", post), "binder/postBuild no longer installs nbscaler from the checkout"
    return named | project_dependencies() | THE_KERNEL | REPOSITORY_FOLDERS


def test_no_walkthrough_imports_the_test_suite():
    found = {p.name: sorted(n for n in notebook_imports(p) if n == "tests") for p in NOTEBOOKS}
    assert not any(found.values()), {k: v for k, v in found.items() if v}


def test_binder_installs_everything_the_walkthroughs_import():
    installed = binder_installs()
    missing: Dict[str, List[str]] = {}
    for path in NOTEBOOKS:
        for name in sorted(notebook_imports(path)):
            if normalized(DISTRIBUTIONS.get(name, name)) not in installed:
                missing.setdefault(DISTRIBUTIONS.get(name, name), []).append(path.stem)
    assert not missing, f"add these to binder/requirements.txt (pinned as pyproject's extras have them): {missing}"


def test_the_import_check_sees_what_a_cell_imports():
    assert imported("%matplotlib inline\nimport os, torch.nn as nn\nfrom transformers.models import x\n"
                    "from . import y\n!pip list\ndef f():\n    import safetensors") == {"os", "torch", "transformers",
                                                                                      "safetensors"}
    assert requirement_name("torch==2.13.0  # CPU") == "torch" and requirement_name("--extra-index-url x") == ""
    assert requirement_name("mkdocstrings[python]>=0.26") == "mkdocstrings"


# -- read anywhere ------------------------------------------------------------------------------------
def is_static(data: dict) -> bool:
    """Whether an output's bundle draws a picture without a script."""
    html = data.get("text/html", "")
    html = "".join(html) if isinstance(html, list) else html
    return any(m in data for m in STATIC_IMAGES) or bool(re.search(r"<(svg|img)\b", html))


def unreadable_outputs(nb) -> List[str]:
    """'cell N: MIME types' for each cell with an interactive output and no static image in it."""
    found = []
    for i, cell in enumerate(nb.cells):
        outputs = [o.get("data", {}) for o in cell.get("outputs", []) if cell.cell_type == "code"]
        live = [sorted(d) for d in outputs if any(k.startswith(INTERACTIVE) for k in d)]
        if live and not any(is_static(d) for d in outputs):
            found.append(f"cell {i}: {live}")
    return found


def chart_outputs(nb) -> int:
    """How many outputs are charts with a static drawing: an interactive chart's static sibling, or
    an image (HTML with a small ``<svg>`` in it, such as a table's, does not count)."""
    return sum(is_static(d) and (any(k.startswith(INTERACTIVE + STATIC_IMAGES) for k in d))
               for c in nb.cells if c.cell_type == "code" for d in (o.get("data", {}) for o in c.get("outputs", [])))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_every_interactive_output_has_a_static_image_beside_it(path):
    found = unreadable_outputs(nbformat.read(path, as_version=4))
    assert not found, (f"{path.name}: blank on GitHub, nbviewer and in HTML: {found}; end the cell with "
                       f"nbscaler.widgets.plotting.FigureAndSVG(fig, svg) and save it again")


def test_the_chart_check_tells_a_bare_figure_from_one_with_its_image():
    from nbformat.v4 import new_code_cell, new_notebook, new_output

    figure = {"application/vnd.plotly.v1+json": {"data": []}, "text/plain": "fig"}
    nb = new_notebook(cells=[new_code_cell("fig", outputs=[new_output("display_data", figure)]),
                             new_code_cell("both", outputs=[new_output("display_data", {**figure,
                                                                                       "image/svg+xml": "<svg/>"})]),
                             new_code_cell("view", outputs=[new_output("display_data", {**figure,
                                                                                       "text/html": "<div><svg></svg>"})])])
    assert unreadable_outputs(nb) == ["cell 0: [['application/vnd.plotly.v1+json', 'text/plain']]"]
    assert chart_outputs(nb) == 2


@pytest.mark.browser
@pytest.mark.timeout(600)
def test_saved_charts_show_in_chromium_offline(tmp_path):
    """Each saved walkthrough as nbconvert writes it to HTML (nbviewer's converter), opened with
    every request off this machine refused: each chart draws, none is blank. Set
    ``NBSCALER_NOTEBOOKS=04,14`` for some, ``NBSCALER_SCREENSHOTS=DIR`` to keep the screenshots."""
    from nbconvert import HTMLExporter

    from tests.widgets.browser import chromium

    only = [n for n in os.environ.get("NBSCALER_NOTEBOOKS", "").split(",") if n]
    paths = [p for p in NOTEBOOKS if not only or p.stem[:2] in only]
    shots = Path(os.environ.get("NBSCALER_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    with chromium(viewport=(1400, 1000)) as page:
        refused: List[str] = []
        page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(("file:", "data:"))
                   else (refused.append(route.request.url), route.abort()))
        for path in paths:
            nb = nbformat.read(path, as_version=4)
            expected = chart_outputs(nb)
            if not expected:
                continue
            page_file = tmp_path / f"{path.stem}.html"
            page_file.write_text(HTMLExporter().from_notebook_node(nb)[0], encoding="utf-8")
            page.goto(page_file.as_uri(), wait_until="load")
            charts = page.locator(".jp-OutputArea-output svg[class*='nbs-chart'], .jp-OutputArea-output img, "
                                  ".jp-RenderedSVG > svg")
            boxes = [charts.nth(i).bounding_box() for i in range(charts.count())]
            # drawn at a readable size (a memory chart of 64 ranks, 6,000 px wide, shrinks to 77 px tall)
            drawn = [b for b in boxes if b and b["width"] > 200 and b["height"] > 50]
            assert len(drawn) >= expected, f"{path.name}: {len(drawn)} of {expected} charts drawn ({boxes})"
            for i in range(charts.count()):
                box = boxes[i]
                if box in drawn:
                    charts.nth(i).scroll_into_view_if_needed()
                    _element_shot(page, charts.nth(i), shots / f"{path.stem}-chart-{i}.png")
    print(f"refused {len(refused)} requests off this machine: {refused[:5]}")


def _element_shot(page, element, path: Path) -> Path:
    """A PNG of one chart, checked not blank (``tests.widgets.browser.image_stats``)."""
    from tests.widgets.browser import image_stats

    png = element.screenshot(path=str(path))
    stats = image_stats(page, png)
    assert stats["colours"] >= 8 and stats["non_background"] > 0.01, f"{path.name} looks blank: {stats}"
    return path


def test_a_scatter_of_two_panels_draws_its_points_front_and_legend():
    from nbscaler.widgets.svgchart import Marks, ScatterPanel, log_ticks, scatter_svg

    assert log_ticks(10, 1000) == [10, 20, 50, 100, 200, 500, 1000]
    points = Marks("tp 1", "#4c78a8", [(20.0, 3.0), (50.0, 2.0), (5000.0, 1.0)], ["circle", "square", "diamond"])
    front = Marks("front", "#333333", [(20.0, 3.0), (50.0, 2.0)], line="step", markers=False)
    svg = scatter_svg("space", [ScatterPanel("8B", [points, front]), ScatterPanel("70B", [points])], "GB", "s",
                      log_x=True, x_range=(10, 1000))
    assert svg.startswith("<svg") and svg.count('class="nbs-point"') == 4       # 5,000 GB is beyond the axis
    assert "2 point(s) beyond the x axis left out" in svg and svg.count("nbs-line") == 1
    assert svg.count(">tp 1</text>") == 1 and ">front</text>" in svg          # one legend entry per label
