"""Plan tables carry a timing-free fingerprint: the same code gives the same one, a changed plan
names its changed rows, and an IPython kernel puts it beside a displayed table's HTML."""

import copy
import re
from types import SimpleNamespace

import pandas as pd
import pytest

from IPython.core.interactiveshell import InteractiveShell

from nbscaler import ComputeConfig
from nbscaler.models.gpt import GPTConfig
from nbscaler.planning.fingerprint import (ATTR, FINGERPRINT_MIME, Fingerprint, Table, chosen_by_time, differences,
                                           of_frames)
from tests.conftest import gpt_plan

MODEL = GPTConfig(vocab_size=64, seq_len=16, n_layer=1, d_model=32, n_head=2)
TOUR = ComputeConfig(plan_ngpus=4, runtime_ngpus=4, use_end2end=True, use_pipeline=True, pipeline_nstages=2,
                     pipeline_nmicros=2, pipeline_scheduler="1f1b")


PLAN = dict(policy="hybrid", config=TOUR, model=MODEL)


def hybrid():
    return gpt_plan(**PLAN)


@pytest.mark.slow
def test_every_plan_table_carries_its_rows_without_seconds_or_source_paths(plan):
    summary = plan.summary()
    assert "step_time_s" in summary.columns
    fp = of_frames(summary)
    assert list(fp.tables) == ["summary"] and "step_time_s" not in fp.tables["summary"]["columns"]
    assert fp.tables["summary"]["rows"][0][:2] == ["0", f"{summary.flops[0]:.0f}"]
    ops = of_frames(plan.ops).tables["ops"]
    assert len(ops["rows"]) == len(plan.ops) and {"source_file", "source_line"}.isdisjoint(ops["columns"])
    assert list(of_frames(plan.memory()).tables) == ["memory"]
    assert list(of_frames(plan.collectives).tables) == ["collectives"]
    # A slice or a derived table shows rows of the same plan table, and keeps its fingerprint.
    assert plan.ops[["name", "split"]].attrs[ATTR] is plan.ops.attrs[ATTR]
    assert of_frames(summary.set_index("rank") / 2**20) is fp


def test_the_same_code_gives_the_same_fingerprint(plan):
    again = hybrid()
    for a, b in [(plan.ops, again.ops), (plan.collectives, again.collectives), (plan.summary(), again.summary())]:
        assert of_frames(a) == of_frames(b) and not differences(of_frames(a), of_frames(b))


def test_a_changed_plan_names_its_changed_rows(plan):
    now = of_frames(plan.ops, plan.collectives)
    # What the saved tour showed: attention replicated where today's hybrid splits it by heads.
    saved = copy.deepcopy(now.to_json())
    ops = saved["tables"]["ops"]
    split, name = ops["columns"].index("split"), ops["columns"].index("name")
    attention = next(r for r in ops["rows"] if r[split] == "h")
    attention[split] = ""
    gone = saved["tables"]["collectives"]["rows"].pop(0)
    found = differences(Fingerprint.from_json(saved), now)
    assert len(found) == 2, found
    assert found[0].startswith("collectives differ (") and "now only: " in found[0] and gone[0] in found[0]
    assert found[1].startswith("ops differ (") and f"{attention[name]}: split '-' -> 'h'" in found[1]
    assert differences(Fingerprint.from_json(now.to_json()), now) == []


def test_another_policy_differs_in_placement_and_collectives(plan):
    tp = plan.replan("tp", ComputeConfig(plan_ngpus=4, runtime_ngpus=4))
    found = differences(of_frames(plan.ops, plan.collectives), of_frames(tp.ops, tp.collectives))
    assert [line.split(" differ")[0] for line in found] == ["collectives", "ops"]
    assert differences(of_frames(plan.memory()), of_frames(tp.memory()))[0].startswith("memory differ")


def test_a_placement_chosen_by_time_is_compared_where_the_choice_leaves_it_alone(plan):
    now = of_frames(plan.ops, plan.collectives)
    timed = Fingerprint(now.plan, now.tables, chosen_by_time=True)
    other = copy.deepcopy(timed.to_json())
    ops = other["tables"]["ops"]
    for column in ("split", "devices", "local_out_shapes"):
        ops["rows"][3][ops["columns"].index(column)] = "elsewhere"
    other["tables"]["collectives"]["rows"].pop()
    assert differences(Fingerprint.from_json(other), timed) == []
    ops["rows"][3][ops["columns"].index("out_shapes")] = "[(1,)]"
    found = differences(Fingerprint.from_json(other), timed)
    assert len(found) == 1 and "out_shapes '[(1,)]' -> '[(" in found[0]
    assert chosen_by_time(SimpleNamespace(graph=SimpleNamespace(meta={"autodist": {}})))
    assert not chosen_by_time(plan)


def test_a_kernel_shows_the_fingerprint_beside_the_html():
    shell = InteractiveShell.instance()
    try:
        plan = hybrid()             # made in the kernel: its tables register the display hook
        for shown, tables in [(plan.ops[["name", "split"]], [Table.OPS]), (plan.summary(), [Table.SUMMARY]),
                              (plan, [Table.OPS, Table.COLLECTIVES])]:
            data, _ = shell.display_formatter.format(shown)
            assert "text/html" in data and "text/plain" in data
            assert sorted(data[FINGERPRINT_MIME]["tables"]) == sorted(map(str, tables))
        untagged, _ = shell.display_formatter.format(plan.ops.groupby("split").size().to_frame())
        assert FINGERPRINT_MIME not in untagged and "text/html" in untagged
    finally:
        InteractiveShell.clear_instance()


def test_a_kernel_shows_a_summary_with_units_and_no_raw_numbers():
    """``plan.summary()`` and a slice of it show FLOPs, bytes and seconds with their units, never a
    float of many digits (``82862208.0``); the frame keeps its numbers, and a column rescaled since
    keeps pandas's writing rather than a unit that would mislabel it."""
    shell = InteractiveShell.instance()
    try:
        plan = hybrid()
        summary = plan.summary()
        raw = re.compile(r"\d{5,}(\.\d+)?|\d+\.\d{4,}")       # 82862208.0, 125312, 0.123387
        for shown in (summary, summary[["rank", "flops", "bytes_sent", "peak_bytes", "step_time_s"]],
                      summary.set_index("rank")):
            data, _ = shell.display_formatter.format(shown)
            for mime in ("text/html", "text/plain"):
                text = re.sub(r"<style.*?</style>", "", data[mime], flags=re.S)
                assert not raw.search(text), (mime, raw.search(text).group(0), text)
            assert "FLOP" in data["text/html"] and "KiB" in data["text/plain"] and " ms" in data["text/plain"]
            assert FINGERPRINT_MIME in data
        assert summary.flops.dtype.kind == "f" and summary.peak_bytes.dtype.kind in "iu"
        assert f"{summary.flops[0]:.1f}" not in shell.display_formatter.format(summary)[0]["text/html"]
        rescaled = summary[["rank", "param_bytes", "peak_bytes"]].assign(param_bytes=summary.param_bytes / 2**20)
        data, _ = shell.display_formatter.format(rescaled)
        assert "iB" in data["text/plain"] and f"{rescaled.param_bytes[0]:.6f}" in data["text/plain"]
        untagged, _ = shell.display_formatter.format(pd.DataFrame({"flops": [82862208.0]}))
        assert "82862208.0" in untagged["text/plain"]
    finally:
        InteractiveShell.clear_instance()
