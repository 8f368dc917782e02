"""ParallelModule's HTML card: who the rank is and what it holds, readable without a kernel."""

import pytest

from nbscaler import ComputeConfig, parallelize
from tests.models import batch, build


def test_card_names_the_rank_config_and_every_local_weight(tmp_path):
    pm = parallelize(build("mlp"), batch("mlp", 0), "tp", ComputeConfig(1, 1), gen_savedir=tmp_path)
    card = pm._repr_html_()
    assert "ParallelModule of tests.models.MLP: rank 0 of 1" in card and "plan_ngpus=1, runtime_ngpus=1" in card
    assert card.count("<tr>") == 1 + len(pm.weight_specs)
    assert "<td>fc1.weight</td><td>param</td><td>(32, 16)</td><td>(32, 16)</td><td>whole</td><td>2 KiB</td>" in card
    assert "<script" not in card


@pytest.mark.slow
def test_card_of_a_compiled_rank_says_so_with_its_compile_seconds(tmp_path):
    pm = parallelize(build("mlp"), batch("mlp", 0), "dp", ComputeConfig(1, 1, compile=True), gen_savedir=tmp_path)
    assert "torch.compile (inductor, 0.0 s so far)" in pm._repr_html_()
