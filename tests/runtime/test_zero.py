"""ZeRO stage 1 and the global gradient norm, against the single-process run.

One spawn of 4 ranks trains every case (a spawn costs seconds; ``run_ranks`` bounds it with a
timeout); the tests below check parts of it.
"""

import pytest

from tests.multiprocess import Case, check_equivalence, pipeline, run_ranks, train_parallel, zero

ZERO = [
    Case("mlp", "dp", 1, 4, config=zero(2)),
    Case("llama", "dp", 1, 4, optimizer="adamw", config=zero()),
    Case("llama", "tp", 2, 4, optimizer="adamw", config=zero(), clip=0.5),
    Case("mlp", "dp", 1, 4, optimizer="adamw", config=zero(), clip=0.5),
    Case("gpt", "pp", 2, 4, optimizer="adamw", config=pipeline("1f1b", 2, 4) + zero(), clip=0.5),
]
PLAIN = [
    Case("llama", "dp", 1, 4, optimizer="adamw"),
    Case("llama", "tp", 2, 4, clip=0.5),
    Case("mlp", "dp", 1, 4, clip=0.5),
    Case("gpt", "pp", 4, 4, config=pipeline("chimera_direct", 4, 4), clip=0.5),    # stage copies on 2 devices
]
CASES = ZERO + PLAIN


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    per_rank = run_ranks(train_parallel, 4, CASES, str(tmp_path_factory.mktemp("gen")))
    return {case: [res[i] for res in per_rank] for i, case in enumerate(CASES)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=str)
def test_trains_like_single_process(trained, case):
    """Losses, final parameters and (with ``clip``) the global norm at every step."""
    check_equivalence(case, trained[case])


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [c for c in CASES if c.clip is not None], ids=str)
def test_clip_gnorm_clipped(trained, case):
    """The norms equal torch's (checked above) and are above max_norm, so the clip did scale."""
    assert max(trained[case][0]["norms"]) > case.clip


@pytest.mark.multiprocess
def test_zero_divides_optimizer_state_by_group_size(trained):
    """Llama, dp on 4 ranks, AdamW: each rank keeps a quarter of the state (plus padding)."""
    full = [res["optimizer_bytes"] for res in trained[PLAIN[0]]]
    sharded = [res["optimizer_bytes"] for res in trained[ZERO[1]]]
    assert len(set(full)) == 1 and full[0] > 0
    for nbytes in sharded:
        assert full[0] / 4 * 0.99 <= nbytes <= full[0] / 4 * 1.01, (full, sharded)
