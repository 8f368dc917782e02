"""Every view that shows a plan's tables carries their fingerprint in its MIME bundle; the timeline,
which draws seconds only, carries none."""

import pytest
import torch

from nbscaler import ComputeConfig
from nbscaler.models.gpt import GPTConfig
from nbscaler.planning.fingerprint import FINGERPRINT_MIME, Fingerprint, of_frames
from nbscaler.widgets import CodeView, GraphView, MemoryView, PlanView, TimelineView


PLAN = dict(policy="tp", config=ComputeConfig(2, 2),
            model=GPTConfig(n_layer=1, d_model=32, n_head=2, seq_len=16, vocab_size=64))


def shown(view) -> Fingerprint:
    return Fingerprint.from_json(view._repr_mimebundle_()[FINGERPRINT_MIME])


@pytest.mark.slow
def test_views_carry_the_tables_they_show(plan):
    tables = of_frames(plan.ops, plan.collectives)
    assert shown(PlanView(plan)) == tables and shown(GraphView(plan)) == tables
    assert shown(MemoryView(plan, optimizer=torch.optim.AdamW)) == of_frames(plan.memory(torch.optim.AdamW))
    assert shown(MemoryView(plan, optimizer=torch.optim.SGD)) != shown(MemoryView(plan, optimizer=torch.optim.AdamW))
    code = shown(CodeView(plan, rank=1)).tables["code rank 1"]
    assert [text for _, text in code["rows"]] == plan.sources[1].splitlines()
    assert FINGERPRINT_MIME not in TimelineView(plan)._repr_mimebundle_()
