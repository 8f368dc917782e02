"""ZeRO stage 3 (fully sharded data parallelism) against the single-process run: losses, final
parameters and the global norm over several steps, on 1, 2 and 4 ranks, under dp, tp and hybrid.

One spawn per rank count trains every case of that count (``run_cases`` bounds it with a timeout).
"""

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

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


class NewStorageBytes(TorchDispatchMode):
    """Counts the bytes of the storages ops make inside the block (an output whose storage no input
    shares): what a piece of the runtime allocates, besides what it resizes itself."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.nbytes += t.untyped_storage().nbytes()
        return out


def watch_gathers_and_reductions(units) -> dict:
    """Wrap ``units`` (a ``ShardedUnits``) to record the bytes ops allocate while each unit's
    all-gather is started, and the bytes of the unit's gathered parameters still held each time its
    gradients are reduce-scattered; returns the two lists, filled as the steps run."""
    seen = {"gathers": [], "held_at_reduce": []}
    start, reduce_bucket, reduce = units._start_gather, units._reduce_bucket, units._reduce
    reducing = []

    def counted_start(unit):
        with NewStorageBytes() as counter:
            start(unit)
        seen["gathers"].append(counter.nbytes)

    def noted_bucket(index):
        reducing.append(units.unit_of_bucket[index])
        try:
            reduce_bucket(index)
        finally:
            reducing.pop()

    def noted_reduce(flat):
        held = sum(units.flats[i].untyped_storage().nbytes() for i in units.unit_buckets[reducing[-1]])
        seen["held_at_reduce"].append(held)
        return reduce(flat)
    units._start_gather, units._reduce_bucket, units._reduce = counted_start, noted_bucket, noted_reduce
    return seen


def gathers_and_reductions(cases, gen_dir: str) -> list:
    """On each rank, for each case: what ``watch_gathers_and_reductions`` saw during two steps."""
    from tests.multiprocess import parallel_steps
    out = []
    for case in cases:
        model = parallel_model(case, gen_dir)
        opt = case.make_optimizer(model)
        seen = watch_gathers_and_reductions(model.shards)
        parallel_steps(model, opt, case, range(case.steps), model.compute_config.unit_of(dist.get_rank()))
        out.append(seen)
    return out


@pytest.mark.multiprocess
def test_a_gather_copies_no_shard_and_a_unit_is_freed_before_its_gradients_are_reduced(tmp_path):
    """The memory FSDP2 does not spend either (benchmarks/results/native_fsdp.md): the all-gather
    reads this rank's shard from its own slice of the gathered tensor (no send copy, in fp32 or
    cast to bf16), and a unit's gathered parameters are freed before its gradients are
    reduce-scattered, not after (the reduction's buffers would otherwise come on top of them)."""
    cases = [Case("gpt", "dp", 1, 2, optimizer="adamw", config=STAGE3, steps=2),
             Case("gpt", "dp", 1, 2, optimizer="adamw", config=STAGE3 + KEEP, steps=2,
                  module_dtype=torch.bfloat16, master_dtype=torch.float32, grad_reduce_dtype=torch.float32)]
    for case, per_rank in run_cases(gathers_and_reductions, 2, cases, str(tmp_path)).items():
        for seen in per_rank:
            assert seen["gathers"] and seen["held_at_reduce"], case
            assert seen["gathers"] == [0] * len(seen["gathers"]), case
            assert seen["held_at_reduce"] == [0] * len(seen["held_at_reduce"]), case
