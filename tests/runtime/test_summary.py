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


def test_card_says_which_ranks_zero_splits_the_state_over(tmp_path):
    cfg = ComputeConfig(1, 1, use_zero=True, zero_stage=2)
    pm = parallelize(build("mlp"), batch("mlp", 0), "dp", cfg, gen_savedir=tmp_path)
    assert "ZeRO stage 2: state split over ranks [0] (1 unit(s)), 1 group(s)" in pm._repr_html_()


def _zero_lines(gen_dir):
    from nbscaler.runtime.summary import zero_line
    cfg = ComputeConfig(2, 4, use_zero=True, zero_stage=3, pas_config={"context_parallel": 2})
    return zero_line(parallelize(build("gpt"), batch("gpt", 0), "tp", cfg, gen_savedir=gen_dir))


@pytest.mark.multiprocess
def test_under_context_parallelism_zero_spans_the_group_s_devices_in_every_unit(tmp_path):
    from tests.multiprocess import run_ranks
    lines = run_ranks(_zero_lines, 4, str(tmp_path))
    assert lines == ["ZeRO stage 3: state split over ranks [0, 1, 2, 3] (2 unit(s) x 2 context-parallel devices), "
                     "1 group(s)"] * 4
