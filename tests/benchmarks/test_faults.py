"""The fault benchmark runs on a small case, and its page says what its rows and samples hold."""

import pytest

from benchmarks.faults import END, START, main

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def test_the_script_writes_each_fault_s_row_and_the_soak(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"before\n{START}\nold table\n{END}\nafter\n")
    out = main(["--faults", "flipped", "truncated", "--cycles", "4", "--notebooks", "0",
                "--out", str(tmp_path / "faults.md"), "--docs", str(page)])
    text = out.read_text()
    assert "2 of 2 faults pass." in text
    for fault in ("a checkpoint with one flipped byte", "a truncated checkpoint"):
        row = next(line for line in text.splitlines() if line.startswith(f"| {fault} |"))
        assert "| yes | yes | yes | yes | pass |" in row, row
    assert "4 compile-and-train cycles" in text and "Descriptors leaked:" in text
    assert "## Notebooks side by side" not in text
    quoted = page.read_text()                  # the page quotes the table as written, nothing else
    assert "old table" not in quoted and quoted.startswith("before\n") and quoted.endswith(f"{END}\nafter\n")
    assert all(line in text for line in quoted.splitlines() if line.startswith("|"))
    assert "2 of 2 faults pass." in quoted and "| measure |" not in quoted
