"""notebooks/README.md, the learners' "start here", lists every walkthrough once, and nothing else:
a notebook added without a line there, or a line left behind by a renamed one, fails here."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
NOTEBOOKS = ROOT / "notebooks"
# A relative Markdown link to a notebook of this folder: ](15_collectives.ipynb).
_LINK = re.compile(r"\]\(([^)\s/#]+\.ipynb)\)")


def _listed() -> list:
    return _LINK.findall((NOTEBOOKS / "README.md").read_text())


def test_every_notebook_is_listed_exactly_once():
    listed = _listed()
    counts = {path.name: listed.count(path.name) for path in sorted(NOTEBOOKS.glob("*.ipynb"))}
    wrong = {name: n for name, n in counts.items() if n != 1}
    assert not wrong, f"notebooks/README.md should link each notebook once; times linked: {wrong}"


def test_every_listed_notebook_exists():
    missing = [name for name in _listed() if not (NOTEBOOKS / name).exists()]
    assert not missing, f"notebooks/README.md links notebooks that are not in notebooks/: {missing}"


def test_its_other_links_lead_somewhere():
    readme = (NOTEBOOKS / "README.md").read_text()
    targets = re.findall(r"\]\((?![a-z]+:|#)([^)\s#]+)(?:#[^)\s]*)?\)", readme)
    broken = [target for target in targets if not (NOTEBOOKS / target).exists() and not target.endswith(".ipynb")]
    assert not broken, f"notebooks/README.md links to files that are not there: {broken}"
