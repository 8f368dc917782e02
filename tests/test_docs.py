"""The documentation: the site builds strictly, every public name is in the API reference with a
docstring, and the README's links lead somewhere.

``mkdocs build --strict`` (``make docs``) fails on a broken link or anchor, a page left out of the
nav, or an object mkdocstrings cannot find; it cannot know that a public name was never put on a
reference page, which ``test_every_public_name_is_documented`` checks.
"""

import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import nbscaler

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"

# `::: nbscaler.NAME`, mkdocstrings' directive for one object.
_DIRECTIVE = re.compile(r"^:::\s+([\w.]+)\s*$", re.MULTILINE)
# A relative Markdown link or image: ](path) or ](path#anchor), not a URL or an anchor alone.
_RELATIVE_LINK = re.compile(r"\]\((?![a-z]+:|#)([^)\s#]+)(?:#[^)\s]*)?\)")


def _documented() -> set:
    return {name for page in REFERENCE.glob("*.md") for name in _DIRECTIVE.findall(page.read_text())}


def test_every_public_name_is_documented():
    documented = _documented()
    missing = [name for name in nbscaler.__all__ if f"nbscaler.{name}" not in documented]
    assert not missing, (f"public names on no page of docs/reference/: {missing}; add "
                         f"'::: nbscaler.NAME' for each to docs/reference/api.md")
    undocumented = [name for name in nbscaler.__all__ if not _docstring(getattr(nbscaler, name))]
    assert not undocumented, f"public names without a docstring: {undocumented}"


def _docstring(obj) -> str:
    """What was written for ``obj``: a class's own docstring, not one it inherits (from object, an
    Enum) nor the signature a dataclass gets in place of one."""
    if not inspect.isclass(obj):
        return (obj.__doc__ or "").strip()
    doc = (vars(obj).get("__doc__") or "").strip()
    return "" if doc.startswith(f"{obj.__name__}(") else doc


def test_the_readme_links_lead_somewhere():
    readme = (ROOT / "README.md").read_text()
    broken = [target for target in _RELATIVE_LINK.findall(readme) if not (ROOT / target).exists()]
    assert not broken, f"README.md links to files that are not there: {broken}"
    # .ci/run runs `make test`, and the README says how to serve these pages.
    assert "make test" in readme and "make docs-serve" in readme


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                           cwd=ROOT, capture_output=True, text=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    problems = [line for line in built.stderr.splitlines() if line.startswith(("WARNING", "ERROR"))]
    assert built.returncode == 0 and not problems, "\n".join(problems) or built.stderr[-4000:]
    api = (tmp_path / "reference" / "api" / "index.html").read_text()
    assert [name for name in nbscaler.__all__ if f'id="nbscaler.{name}"' not in api] == []
    # Each walkthrough is a page that shows every output it was saved with.
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        page = tmp_path / "notebooks" / notebook.stem / "index.html"
        assert page.exists(), f"{notebook.name} is not a page of the site"
        saved = sum(len(cell.get("outputs", ())) for cell in json.loads(notebook.read_text())["cells"])
        assert page.read_text().count('<div class="jp-OutputArea-child') == saved > 0, notebook.name
