"""The test-suite benchmark runs on a small case: its table holds the part's count, times and verdict."""

import re
import subprocess
import sys

import pytest

from benchmarks.test_suite import FAST, GOAL_S, REPO, main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
PATH = "tests/cost/test_zero_paper.py"     # a few quick tests


def test_the_script_times_a_part_and_holds_it_to_its_goal(tmp_path):
    out = tmp_path / "test_suite.md"
    assert main(["--parts", "fast", "--tests", PATH, "--out", str(out)]) == 0
    text = out.read_text()
    assert f"`python -m benchmarks.test_suite --parts fast --tests {PATH}`" in text
    row = next(line for line in text.splitlines() if line.startswith("| fast subset"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    tests, wall = int(cells[1]), float(cells[2])
    collected = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", FAST, PATH],
                               cwd=REPO, capture_output=True, text=True).stdout
    assert tests == len([line for line in collected.splitlines() if line.startswith(PATH + "::")]) > 0
    assert cells[7] == f"{GOAL_S['fast']:,.0f}" and cells[8] == ("yes" if wall <= GOAL_S["fast"] else "no")
    assert re.search(rf"pytest: {tests} passed", text)
