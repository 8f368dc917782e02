"""The GPU context-attention check on its small case: on this CPU every block kind and each kind of
context parallelism are within tolerance of the CPU's fp32, and each timing row is computed from
its own figures."""

from benchmarks.gpu_context import CHECKED, STEPS, main


def test_the_small_case_checks_every_block_and_times_each_call(tmp_path):
    out = tmp_path / "gpu_context.md"
    assert main(["--small", "--out", str(out)]) == 0             # 0: every row within its tolerance
    text = out.read_text()
    checked = [line for line in text.splitlines() if line.startswith("| cpu_flash |")]
    assert len(checked) == len(CHECKED) * (len(STEPS) + 2)      # each step kind, and ring and all_gather end to end
    assert all(line.rstrip().endswith("| within |") for line in checked)
    assert f"{len(checked)} of {len(checked)} rows within their tolerance." in text
    timed = [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
             if line.startswith(("| 128 |", "| 256 |"))]
    assert [row[1] for row in timed] == ["F.scaled_dot_product_attention", "ring, fused blocks",
                                         "ring, written-out blocks"] * 2
    for length in ("128", "256"):
        rows = [row for row in timed if row[0] == length]
        sdpa = float(rows[0][2])
        for row in rows:         # over SDPA's time, within what the rounding of the milliseconds (0.1) allows
            ms = float(row[2])
            assert (ms - 0.05) / (sdpa + 0.05) - 0.005 <= float(row[4]) <= (ms + 0.05) / (sdpa - 0.05) + 0.005, row
