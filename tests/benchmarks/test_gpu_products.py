"""The GPU products benchmark on its small case: each distinct linear layer and attention is priced
for the named GPU and measured here, and every figure of its tables is computed from those two."""

import re

import pytest

from benchmarks.gpu_products import SMALL, linear_calls, main, mkn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_the_small_case_writes_one_row_per_distinct_linear_layer(tmp_path):
    out = tmp_path / "gpu_products.md"
    assert main(["--small", "--repeats", "1", "--out", str(out)]) == 0
    text = out.read_text()
    products, attention = text.split("## Attention")
    rows = [line for line in products.splitlines() if line.startswith(("| GPT |", "| Llama |"))]
    expected = [(case.name, mkn(op)) for case in SMALL for op in linear_calls(case)]
    assert [(r.split("|")[1].strip(), r.split("|")[3].strip()) for r in rows] == \
        [(name, " x ".join(f"{s:,}" for s in shape)) for name, shape in expected]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        predicted, measured, ratio = float(cells[3]), float(cells[4]), float(cells[5])
        assert predicted > 0 and measured > 0 and abs(ratio - measured / predicted) <= 0.002 * ratio + 0.01
    assert "**another machine**" in text      # predicted for an H200, measured on this CPU
    timed = [line for line in attention.splitlines() if line.startswith(("| GPT |", "| Llama |"))]
    assert [r.split("|")[2].strip() for r in timed] == ["(2, 4, 32, 16)", "(1, 4, 32, 16)"]   # (B, heads, T, head size)
    for row in timed:
        cells = [c.strip() for c in row.strip("|").split("|")]
        predicted, measured, ratio, implied = map(float, cells[3:7])
        assert "scaled_dot_product" in cells[7]         # the op (on a CPU) SDPA chose, named
        assert abs(ratio - measured / predicted) <= 0.002 * ratio + 0.01
        assert implied == pytest.approx(0.35 / ratio, abs=0.006)        # the H200's attention_efficiency
    assert re.search(r"- bf16: \d+ layers, measured / predicted median", text)
