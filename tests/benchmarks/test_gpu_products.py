"""The GPU products benchmark on its small case: each distinct linear layer is priced for the named
GPU and measured here, and every figure of its table is computed from those two."""

import re

import pytest

from benchmarks.gpu_products import SMALL, linear_calls, main, mkn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_small_case_writes_one_row_per_distinct_linear_layer(tmp_path):
    out = tmp_path / "gpu_products.md"
    assert main(["--small", "--repeats", "1", "--out", str(out)]) == 0
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith(("| GPT |", "| Llama |"))]
    expected = [(case.name, mkn(op)) for case in SMALL for op in linear_calls(case)]
    assert [(r.split("|")[1].strip(), r.split("|")[3].strip()) for r in rows] == \
        [(name, " x ".join(f"{s:,}" for s in shape)) for name, shape in expected]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        predicted, measured, ratio = float(cells[3]), float(cells[4]), float(cells[5])
        assert predicted > 0 and measured > 0 and abs(ratio - measured / predicted) <= 0.002 * ratio + 0.01
    assert "**another machine**" in text      # predicted for an H200, measured on this CPU
    assert re.search(r"- bf16: \d+ layers, measured / predicted median", text)
