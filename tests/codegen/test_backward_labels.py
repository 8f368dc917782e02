"""Under a zero-bubble schedule the generated code says which backward block computes each op's
gradient, as the IR pass ``ir.backward_split`` labels it; other schedules print no label."""

import re

import pytest
import torch

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.ir.backward_split import KEY
from nbscaler.models.gpt import GPT, GPTConfig


def pipeline_plan(scheduler: str, nstages: int = 2):
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, n_layer=4, d_model=32, n_head=2))
    idx = torch.zeros(4, 8, dtype=torch.long)
    cfg = ComputeConfig(2, 2, use_end2end=True, use_pipeline=True, pipeline_nstages=nstages, pipeline_nmicros=4,
                        pipeline_scheduler=scheduler)
    return nbscaler.plan(model, {"batch": {"idx": idx, "targets": idx}}, "pp", cfg)


@pytest.mark.slow       # a second or so: make test runs it, the edit-test loop does not
def test_each_op_line_carries_the_block_the_ir_gives_it():
    plan = pipeline_plan("zb_h1")
    for rank, text in plan.sources.items():
        lines = text.splitlines()
        assert "Its backward runs in two blocks" in text
        labelled = 0
        for index, numbers in plan.source_lines[rank].items():
            part = plan.graph.nodes[index].meta[KEY]
            call = lines[numbers[-1] - 1]
            found = re.search(r"backward (B\+W|B|W)$", call)
            assert (found.group(1) if found else "") == part, call
            labelled += bool(part)
        assert labelled > 0
        compile(text, f"rank{rank}", "exec")
    parts = {n.meta[KEY] for n in plan.graph.nodes}
    assert {"B", "B+W", "W"} <= parts


@pytest.mark.parametrize("scheduler, nstages", [("1f1b", 2), ("1f1b_interleaved", 4)])
def test_schedules_that_do_not_split_the_backward_print_no_label(scheduler, nstages):
    plan = pipeline_plan(scheduler, nstages)
    for text in plan.sources.values():
        assert "# backward" not in text and "; backward" not in text and "two blocks" not in text
