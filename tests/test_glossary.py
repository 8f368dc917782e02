"""The glossary: one table in ``nbscaler.glossary``, written out as ``docs/glossary.md``, naming every
split label the shipped op rules write and every layout word of ``nbscaler.layouts``."""

from pathlib import Path

import pytest

from nbscaler import glossary
from nbscaler.glossary import LAYOUTS, SPLITS, layout_name, layout_text, split_name, split_text
from nbscaler.layouts import LayoutKind

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "glossary.md"


def test_the_page_is_the_table_written_out():
    assert PAGE.read_text() == glossary.markdown(), \
        "docs/glossary.md is not nbscaler/glossary.py's table: python -m nbscaler.glossary > docs/glossary.md"


def test_every_label_is_on_the_page_with_its_names():
    page = PAGE.read_text()
    for term in SPLITS + LAYOUTS:
        rows = [line for line in page.splitlines() if line.startswith(f"| `{term.label}`")]
        assert any(f"| {term.name} | {term.meaning} | {term.megatron} | {term.pytorch} |" in row for row in rows), term


def test_every_layout_word_has_an_entry():
    words = {t.label for t in LAYOUTS}
    assert {k.value for k in LayoutKind if k is not LayoutKind.SPLIT} <= words and "S(d)" in words


@pytest.mark.parametrize("label, op, text", [
    ("n", "linear", "column-parallel (n)"),
    ("k", "linear", "row-parallel, partial sums (k)"),
    ("v", "embedding", "vocabulary-parallel (v)"),
    ("c", "loss", "vocabulary-parallel loss (c)"),
    ("h", "attention", "head-split (h)"),
    ("*0", "linear", "batch-split (*0)"),
    ("*1", "norm", "sequence-sharded (*1)"),
    ("d0", "elementwise", "batch-split (d0)"),
    ("d2", "transpose", "dim 2 (d2)"),
    ("g2", "reshape", "group 2 (g2)"),
    ("n", "conv", "batch-split (n)"),
    (None, "linear", "replicated"),
    ("zz", None, "zz"),
])
def test_split_text(label, op, text):
    assert split_text(label, op) == text


def test_layout_names():
    assert [layout_name(x) for x in ("R", "R*", "P", "V", "S(1)", "S(0, 3 blocks)")] == [
        "replicated", "sum-gradient", "partial sums", "first-only", "split on dim 1", "split on dim 0 (3 blocks)"]
    assert layout_text("R*") == "sum-gradient (R*)" and layout_text("?") == "?"


def test_every_split_of_the_shipped_models_has_a_name():
    """No label a tensor-parallel or data-parallel plan of the test models writes falls through to itself."""
    import nbscaler
    from nbscaler import ComputeConfig
    from tests.models import batch, build

    for name in ("gpt", "llama"):
        for policy, cfg in (("tp", ComputeConfig(2, 2, pas_config={"sequence_parallel": True})),
                            ("data", ComputeConfig(2, 2))):
            ops = nbscaler.plan(build(name), batch(name, 0), policy, cfg).ops
            for label, op in zip(ops.split, ops.op):
                if isinstance(label, str):
                    assert split_name(label, op) != label, (name, policy, label, op)
