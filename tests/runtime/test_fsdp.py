"""ZeRO stage 3 (fully sharded data parallelism) against the single-process run: losses, final
parameters and the global norm over several steps, on 1, 2 and 4 ranks, under dp, tp and hybrid.

One spawn per rank count trains every case of that count (``run_cases`` bounds it with a timeout).
"""

import pytest
import torch.distributed as dist

from tests.multiprocess import (Case, check_equivalence, granular, parallel_model, pipeline, run_cases, run_ranks,
                                train_parallel, zero)

STAGE3 = zero(stage=3)
KEEP = (("zero_reshard_after_forward", False),)
CASES = {
    4: [
        Case("llama", "dp", 1, 4, optimizer="adamw", config=STAGE3, clip=0.5),
        Case("gpt", "dp", 1, 4, optimizer="adamw", config=STAGE3 + KEEP),
        Case("llama", "tp", 2, 4, optimizer="adamw", config=STAGE3, clip=0.5),
        Case("mlp", "dp", 1, 4, optimizer="momentum", config=zero(2, stage=3), clip=0.5),
        Case("gpt", "tp", 2, 4, optimizer="adamw", config=(("use_end2end", True),) + STAGE3),
        Case("gpt", "pp", 2, 4, optimizer="adamw", config=pipeline("1f1b", 2, 4) + STAGE3, clip=0.5),
        Case("gpt", "hybrid", 2, 4, optimizer="adamw", config=pipeline("1f1b", 2, 4) + STAGE3),
    ],
    2: [Case("gpt", "dp", 1, 2, optimizer="adamw", config=STAGE3, clip=0.5),
        Case("llama", "dp", 1, 2, optimizer="adamw", config=STAGE3 + KEEP)],
    1: [Case("llama", "dp", 1, 1, optimizer="adamw", config=STAGE3)],
}
# With what else a plan may do: selective recompute with sequence parallelism, named units, a model
# from transformers.
CASES[4] = CASES[4] + [
    Case("llama", "tp", 2, 4, optimizer="adamw", config=STAGE3 + granular("selective", sequence_parallel=True)),
    Case("gpt", "dp", 1, 4, optimizer="adamw", config=STAGE3 + (("zero_units", ("MLP", "CausalSelfAttention")),)),
    Case("hf_llama", "dp", 1, 4, optimizer="adamw", config=STAGE3, clip=0.5),
    Case("hf_llama", "tp", 2, 4, optimizer="adamw", config=STAGE3),
]


# Every training scheduler that can: each stage's units gathered per micro-batch, a split
# backward's W finding its units still gathered. chimera_direct is refused (``ComputeConfig``).
SCHEDULERS = [Case("gpt", "pp", 2, 2, optimizer="adamw", config=pipeline(s, n, 4) + STAGE3)
              for s, n in (("gpipe", 2), ("1f1b_plus", 2), ("1f1b_interleaved", 4), ("zb_h1", 2), ("zbv", 4))]
CASES[2] = CASES[2] + SCHEDULERS


@pytest.mark.multiprocess
@pytest.mark.parametrize("nranks", sorted(CASES))
def test_zero3_trains_like_single_process(nranks, tmp_path):
    for case, per_rank in run_cases(train_parallel, nranks, CASES[nranks], str(tmp_path)).items():
        check_equivalence(case, per_rank)


def held_after_steps(gen_dir: str) -> dict:
    """On each rank: what a ZeRO-3 Llama holds after construction and after two steps."""
    from tests.multiprocess import parallel_steps
    case = Case("llama", "dp", 1, 4, optimizer="adamw", config=STAGE3, steps=2)
    model = parallel_model(case, gen_dir)
    opt = case.make_optimizer(model)
    gathered = lambda: sum(p.untyped_storage().nbytes() for p in model.parameters())
    built = gathered()
    parallel_steps(model, opt, case, range(case.steps), model.compute_config.unit_of(dist.get_rank()))
    return {"built": built, "after": gathered(), "whole": sum(p.numel() for p in model.parameters()),
            "shards": [p.numel() for g in opt.param_groups for p in g["params"]],
            "units": {u: sum(getattr(model, a).numel() for a in attrs) for u, attrs in model.shard_units.items()}}


@pytest.mark.multiprocess
def test_a_rank_stores_a_quarter_of_each_unit_and_frees_what_it_gathered(tmp_path):
    for held in run_ranks(held_after_steps, 4, str(tmp_path)):
        assert held["built"] == 0 and held["after"] == 0        # nothing gathered between steps
        assert sorted(held["units"]) == ["(rest)", "blocks.0", "blocks.1"]
        assert sum(held["units"].values()) == held["whole"]
        # one shard per unit (one dtype each): its elements padded up to a multiple of 4, a quarter kept
        assert held["shards"] == [-(-n // 4) for n in held["units"].values()]
