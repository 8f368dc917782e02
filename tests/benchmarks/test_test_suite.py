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


def test_a_failed_test_is_named_in_the_table_s_file(tmp_path):
    failing = tmp_path / "test_one_fails.py"
    failing.write_text("def test_fine():\n    pass\n\n\ndef test_broken():\n    assert 1 == 2, 'one is not two'\n\n\n"
                       "def test_a_rank_failed():\n    raise RuntimeError('rank 0 raised:\\nTraceback\\nValueError: the cause')\n")
    out = tmp_path / "test_suite.md"
    assert main(["--parts", "whole", "--tests", str(failing), "--out", str(out)]) == 1
    text = out.read_text()
    assert "pytest: 2 failed, 1 passed" in text and "(exit status 1)" in text
    named = text.split("What failed:")[1].split("```")[1].strip().splitlines()
    assert len(named) == 2 and all(line.startswith("FAILED ") for line in named)
    broken = next(line for line in named if "test_broken" in line)
    assert "one is not two" in broken
    rank = next(line for line in named if "test_a_rank_failed" in line)
    assert "the cause" not in rank                               # a one-line reason stops at the first line
    ended = text.split("How `test_a_rank_failed` ended")[1].split("```")[1]
    assert "ValueError: the cause" in ended                      # the end of its report keeps it
    assert "| whole suite (`make test`) | 3 |" in text
