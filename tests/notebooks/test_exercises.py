"""Every walkthrough teaches with the same two helpers and ends with exercises a learner can check:
read from the saved notebooks, no kernel needed."""

import json

import pytest

from nbscaler.walkthroughs import checkout_root, notebook_paths

NOTEBOOKS = notebook_paths(checkout_root() / "notebooks")


def cells(path):
    return json.loads(path.read_text())["cells"]


def text(cell) -> str:
    return "".join(cell["source"])


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_walkthrough_ends_with_exercises_checked_in_cells_and_solutions_collapsed(path):
    found = cells(path)
    heads = [i for i, c in enumerate(found) if c["cell_type"] == "markdown" and text(c).startswith("## Try this")]
    assert heads, f"{path.name} has no '## Try this' section"
    after = found[heads[-1]:]
    tries = [c for c in after if c["cell_type"] == "code" and "check(" in text(c)
             and not c["metadata"].get("jupyter", {}).get("source_hidden")]
    assert len(tries) >= 2, f"{path.name}: {len(tries)} exercise cell(s) call check(); two or three wanted"
    solutions = found[-1]
    assert solutions["cell_type"] == "code" and solutions["metadata"].get("jupyter", {}).get("source_hidden"), \
        f"{path.name}: the last cell should hold the solutions, collapsed"
    assert text(solutions).count("assert check(") >= len(tries), \
        f"{path.name}: the solutions cell should assert check() of every exercise's answer"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_walkthrough_uses_the_shared_teaching_helpers(path):
    code = "\n".join(text(c) for c in cells(path) if c["cell_type"] == "code")
    assert "def states(" not in code and "def check(" not in code, \
        f"{path.name} defines its own states/check: import them from nbscaler.teaching"
    assert "states(" in code, f"{path.name} asserts none of the figures its prose states (nbscaler.teaching.states)"
