"""ZeRO stages 1 and 2 (stage 3: ``test_fsdp.py``) and the global gradient norm, against the single-process run; what ZeRO holds
per rank; and the checks of ``zero_stage``.

One spawn of 4 ranks trains most cases (a spawn costs seconds; ``run_ranks`` bounds it with a
timeout); the tests below check parts of it. ZeRO-2 also runs on one and two ranks.
"""

import pytest
import torch
import torch.distributed as dist

from nbscaler import ComputeConfig
from nbscaler.runtime.memory import static_memory
from tests.multiprocess import (Case, buckets, check_equivalence, parallel_model, pipeline, run_cases, run_ranks,
                                samples, step_losses, train_parallel, zero)

SMALL_BUCKETS = buckets(16 * 1024)      # Llama's fp32 gradients in 7 buckets, GPT's in 22: reduced one at a time
ZERO = [
    Case("mlp", "dp", 1, 4, config=zero(2)),
    Case("llama", "dp", 1, 4, optimizer="adamw", config=zero()),
    Case("llama", "tp", 2, 4, optimizer="adamw", config=zero(), clip=0.5),
    Case("mlp", "dp", 1, 4, optimizer="adamw", config=zero(), clip=0.5),
    Case("gpt", "pp", 2, 4, optimizer="adamw", config=pipeline("1f1b", 2, 4) + zero(), clip=0.5),
    Case("llama", "dp", 1, 4, optimizer="adamw", config=zero() + SMALL_BUCKETS, clip=0.5),
]
ZERO2 = [
    Case("llama", "dp", 1, 4, optimizer="adamw", config=zero(stage=2)),
    Case("mlp", "dp", 1, 4, optimizer="momentum", config=zero(2, stage=2), clip=0.5),
    Case("llama", "tp", 2, 4, optimizer="adamw", config=zero(stage=2), clip=0.5),
    Case("gpt", "pp", 2, 4, optimizer="adamw", config=pipeline("1f1b", 2, 4) + zero(stage=2), clip=0.5),
    Case("gpt", "tp", 2, 4, optimizer="adamw", config=(("use_end2end", True),) + zero(stage=2)),
    Case("llama", "dp", 1, 4, optimizer="adamw", config=zero(stage=2) + SMALL_BUCKETS, clip=0.5),
    Case("gpt", "pp", 2, 4, optimizer="adamw", config=pipeline("1f1b", 2, 4) + zero(stage=2) + SMALL_BUCKETS),
]
PLAIN = [
    Case("llama", "dp", 1, 4, optimizer="adamw"),
    Case("llama", "tp", 2, 4, clip=0.5),
    Case("mlp", "dp", 1, 4, clip=0.5),
    Case("gpt", "pp", 4, 4, config=pipeline("chimera_direct", 4, 4), clip=0.5),    # stage copies on 2 devices
    Case("llama", "dp", 1, 4, optimizer="adamw", config=SMALL_BUCKETS),
]
CASES = ZERO + ZERO2 + PLAIN
SMALLER = {1: [Case("llama", "dp", 1, 1, optimizer="adamw", config=zero(stage=2))],
           2: [Case("llama", "dp", 1, 2, optimizer="adamw", config=zero(stage=2)),
               Case("gpt", "pp", 2, 2, optimizer="adamw", config=pipeline("gpipe", 2, 4) + zero(stage=2), clip=0.5)]}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return run_cases(train_parallel, 4, CASES, str(tmp_path_factory.mktemp("gen")))


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES, ids=str)
def test_trains_like_single_process(trained, case):
    """Losses, final parameters and (with ``clip``) the global norm at every step."""
    check_equivalence(case, trained[case])


@pytest.mark.multiprocess
@pytest.mark.parametrize("nranks", sorted(SMALLER))
def test_zero2_trains_like_single_process_on_fewer_ranks(nranks, tmp_path):
    for case, per_rank in run_cases(train_parallel, nranks, SMALLER[nranks], str(tmp_path)).items():
        check_equivalence(case, per_rank)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [c for c in CASES if c.clip is not None], ids=str)
def test_clip_gnorm_clipped(trained, case):
    """The norms equal torch's (checked above) and are above max_norm, so the clip did scale."""
    assert max(trained[case][0]["norms"]) > case.clip


@pytest.mark.multiprocess
def test_zero_divides_optimizer_state_by_group_size(trained):
    """Llama, dp on 4 ranks, AdamW: each rank keeps a quarter of the state (plus padding)."""
    full = [res["optimizer_bytes"] for res in trained[PLAIN[0]]]
    for case in (ZERO[1], ZERO2[0]):
        sharded = [res["optimizer_bytes"] for res in trained[case]]
        assert len(set(full)) == 1 and full[0] > 0
        for nbytes in sharded:
            assert full[0] / 4 * 0.99 <= nbytes <= full[0] / 4 * 1.01, (case, full, sharded)


def held_during_step(cases, gen_dir):
    """On every rank: the bytes held right after the backward (before the optimizer step) and after
    the step, for each case; and the bytes of the original parameters."""
    rank = dist.get_rank()
    out = []
    for case in cases:
        model = parallel_model(case, gen_dir)
        opt = case.make_optimizer(model)
        for step in range(2):
            opt.zero_grad()
            sum(step_losses(model, case, samples(case, step, rank // case.plan_ngpus))).backward()
            backward = static_memory(model, opt)
            opt.step()
        out.append({"backward": backward, "step": static_memory(model, opt),
                    "numel": sum(p.numel() for p in model.parameters())})
    return out


@pytest.mark.multiprocess
def test_zero_holds_its_theoretical_share(tmp_path):
    """Per rank, after the step: the parameters once (plus padding), a quarter of the gradients
    and nothing else but optimizer state; and under stage 2 the full gradients are gone by the end
    of the backward (a rank holds only its quarter), where stage 1 and plain DP hold them all until
    the step."""
    plain, stage1, stage2 = (Case("llama", "dp", 1, 4, optimizer="adamw", config=c) for c in ((), zero(), zero(stage=2)))
    per_rank = run_ranks(held_during_step, 4, [plain, stage1, stage2], str(tmp_path))
    for held_plain, held1, held2 in per_rank:
        full = held_plain["numel"] * 4
        pad = 4 * 4                                        # at most 3 padding floats per rank's bucket
        for held in (held1, held2):
            assert full <= held["step"]["param_bytes"] < full + pad
            assert held["step"]["grad_bytes"] * 4 == held["step"]["param_bytes"]
            assert held["step"]["optimizer_bytes"] * 4 <= held_plain["step"]["optimizer_bytes"] + 4 * (pad + 4)
        assert held_plain["backward"]["grad_bytes"] == full
        assert held1["backward"]["grad_bytes"] == held1["step"]["param_bytes"]        # all of them
        assert held2["backward"]["grad_bytes"] * 4 == held2["step"]["param_bytes"]    # a quarter


@pytest.mark.parametrize("kwargs, words", [
    (dict(zero_stage=2), ["zero_stage=2", "use_zero=True"]),
    (dict(use_zero=True, zero_stage=4), ["zero_stage=4", "use 1", "or 3"]),
    (dict(use_zero=True, zero_stage=3, **dict(pipeline("chimera_direct", 4, 4))), ["chimera_direct", "ZeRO-3"]),
    (dict(use_zero=True, zero_reshard_after_forward=False), ["zero_reshard_after_forward=False", "zero_stage=3"]),
    (dict(use_zero=True, zero_stage=3, zero_reshard_after_forward=0), ["give True or False"]),
    (dict(use_zero=True, zero_units=("blocks",)), ["zero_units=('blocks',)", "zero_stage=3"]),
    (dict(use_zero=True, zero_stage=3, zero_units="blocks"), ["zero_units='blocks'", "module paths or class names"]),
    (dict(use_zero=True, zero_stage=True), ["zero_stage=True"]),
    (dict(use_zero=True, zero_stage=2, **dict(pipeline("chimera_direct", 4, 4))),
     ["chimera_direct", "zero_stage=1"]),
])
def test_zero_stage_is_validated(kwargs, words):
    with pytest.raises(ValueError) as err:
        ComputeConfig(4, 4, **kwargs)
    for word in words:
        assert word in str(err.value)


def test_zero_stage_defaults_to_one():
    assert ComputeConfig(1, 2, use_zero=True).zero_stage == 1
    assert ComputeConfig.from_dict({"plan_ngpus": 1, "runtime_ngpus": 2, "use_zero": True}).zero_stage == 1


def test_zero_shards_are_views_of_the_parameters(tmp_path):
    """One rank: the optimizer's shard is the flat parameters themselves, so a step changes the
    module without a gather and no second copy exists."""
    case = Case("mlp", "dp", 1, 1, optimizer="adamw", config=zero(stage=2))
    model = parallel_model(case, str(tmp_path))
    opt = case.make_optimizer(model)
    (shard,) = [p for g in opt.param_groups for p in g["params"]]
    assert shard.untyped_storage().data_ptr() == next(model.parameters()).untyped_storage().data_ptr()
    before = [p.detach().clone() for p in model.parameters()]
    sum(step_losses(model, case, samples(case, 0, 0))).backward()
    assert all(p.grad is None for p in model.parameters()) and shard.grad is not None
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_zero_refuses_parameters_moved_after_construction(tmp_path):
    case = Case("mlp", "dp", 1, 1, optimizer="adamw", config=zero())
    model = parallel_model(case, str(tmp_path))
    opt = case.make_optimizer(model)
    model.double()
    with pytest.raises(RuntimeError, match="new storage after it was built.*module_dtype"):
        opt.step()
