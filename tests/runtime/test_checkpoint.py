"""Checkpoints: per-rank, merged and deduped; resuming in fresh processes; moving between plans;
``no_weights`` with ``broadcast_weights``.

The multi-process part runs four spawns, once for the whole module:

1. 2 ranks, Llama under tp: train ``K`` steps, save per-rank and deduped checkpoints, train ``M``
   more (the uninterrupted run);
2. 4 ranks, the same under tp on 2 units with ZeRO (and the plain-around-parallel model);
3. 2 fresh ranks: resume run 1 from each kind of checkpoint and train the same ``M`` steps;
4. 4 fresh ranks: resume run 2 likewise; load run 1's merged checkpoint under dp with ZeRO and
   continue; refuse run 1's per-rank file; build a module with ``no_weights`` and broadcast it.
"""

import copy
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nbscaler import broadcast_weights, deduped_state_dict, merge_state_dicts, parallelize
from nbscaler.runtime.checkpoint import load, local_pieces, save
from nbscaler.runtime.statecheck import CheckpointError
from tests.models import batch, build
from tests.multiprocess import (Case, assert_close, check_equivalence, context_parallel, expert_parallel,
                                load_state_of_kind, parallel_model, parallel_steps, pipeline, run_ranks, single_steps,
                                zero)

K, M = 2, 2                 # steps before the checkpoint, steps after it
TP2 = Case("llama", "tp", 2, 2, optimizer="adamw")
TP4_ZERO = Case("llama", "tp", 2, 4, optimizer="adamw", config=zero())
TRUNK_ZERO = Case("with_trunk", "tp", 2, 4, optimizer="adamw", config=zero())
PP_ZERO = Case("gpt", "pp", 2, 4, optimizer="adamw", config=pipeline("1f1b", 2, 4) + zero())
TP_END2END = Case("gpt", "tp", 2, 4, optimizer="adamw", config=(("use_end2end", True),))
DP4_ZERO = Case("llama", "dp", 1, 4, optimizer="adamw", config=zero())
TP4_ZERO3 = Case("llama", "tp", 2, 4, optimizer="adamw", config=zero(stage=3))     # parameters sharded too
DP4_ZERO3 = Case("llama", "dp", 1, 4, optimizer="adamw", config=zero(stage=3))
NO_WEIGHTS = Case("llama", "tp", 2, 4)
CONTEXT = Case("gpt", "tp", 2, 4, optimizer="adamw", config=context_parallel(2, "ring"))   # the sequence split
# ... and sharded over units x context-parallel devices
CONTEXT_ZERO3 = Case("gpt", "tp", 2, 4, optimizer="adamw", config=context_parallel(2, "ring") + zero(stage=3))
# 2 context-parallel groups of 2 tensor-parallel neighbours: each weight split inside a pair, copied across
CONTEXT_TP = Case("gpt", "tp", 4, 4, optimizer="adamw", config=context_parallel(2))
EXPERTS = Case("moe", "tp", 2, 4, optimizer="adamw", config=expert_parallel(2))   # experts split by expert
MOE_ZERO3 = Case("moe", "dp", 1, 4, optimizer="adamw", config=zero(stage=3))
# 2 expert groups of 2: each rank a quarter of every expert's weights, cut by expert and by hidden unit
EXPERT_GROUPS = Case("moe", "tp", 4, 4, optimizer="adamw", config=expert_parallel(2, hidden=2))
HF_EXPERTS = Case("hf_mixtral", "tp", 2, 4, optimizer="adamw", config=expert_parallel(2))   # Hugging Face's, by expert
HF_ZERO = Case("hf_mixtral", "dp", 1, 4, optimizer="adamw", config=zero())
HF_GROUPS = Case("hf_mixtral", "tp", 4, 4, optimizer="adamw", config=expert_parallel(2, hidden=2))   # both ways, strided
SAVED = [TP2, TP4_ZERO, TRUNK_ZERO, PP_ZERO, TP4_ZERO3, CONTEXT, CONTEXT_ZERO3, CONTEXT_TP, EXPERTS, MOE_ZERO3, HF_EXPERTS,
         EXPERT_GROUPS, HF_GROUPS]   # trained, saved, continued
MOVES = [(TP2, DP4_ZERO), (PP_ZERO, TP_END2END),            # merged checkpoint of one plan -> another plan
         (TP2, DP4_ZERO3), (TP4_ZERO3, DP4_ZERO),           # into ZeRO-3, and out of it
         (CONTEXT, TP_END2END), (PP_ZERO, CONTEXT),         # out of context parallelism, and into it
         (CONTEXT_ZERO3, TP_END2END), (PP_ZERO, CONTEXT_ZERO3),   # the same, sharded over its devices
         (CONTEXT_TP, TP_END2END), (PP_ZERO, CONTEXT_TP),   # ... and with tensor parallelism inside
         (EXPERTS, MOE_ZERO3), (MOE_ZERO3, EXPERTS),        # out of expert parallelism, and into it
         (EXPERT_GROUPS, EXPERTS), (MOE_ZERO3, EXPERT_GROUPS),   # out of experts cut two ways, and into them
         (HF_EXPERTS, HF_ZERO), (HF_GROUPS, HF_ZERO), (HF_EXPERTS, HF_GROUPS)]


def path(ckpt_dir, case: Case, kind: str, rank=None) -> Path:
    return Path(ckpt_dir) / f"{case.instance_name}.{kind}{'' if rank is None else f'.{rank}'}.pt"


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# -- rank functions --------------------------------------------------------------------------------
def train_and_save(cases, gen_dir, ckpt_dir):
    rank = dist.get_rank()
    out = {}
    for case in cases:
        unit = rank // case.plan_ngpus
        model = parallel_model(case, gen_dir)
        opt = case.make_optimizer(model)
        parallel_steps(model, opt, case, range(K), unit)
        save((model.state_dict(), opt.state_dict()), path(ckpt_dir, case, "full", rank))
        save(deduped_state_dict(model, opt), path(ckpt_dir, case, "deduped", rank))
        out[case] = parallel_steps(model, opt, case, range(K, K + M), unit)["losses"]
    return out


def continue_from(case, gen_dir, kind, file):
    """A fresh model and optimizer loaded from a checkpoint of ``kind``, trained the last M steps."""
    model = parallel_model(case, gen_dir)
    opt = case.make_optimizer(model)
    load_state_of_kind(model, opt, kind, *load(file))
    return parallel_steps(model, opt, case, range(K, K + M), dist.get_rank() // case.plan_ngpus)["losses"]


def resume(case, gen_dir, ckpt_dir):
    rank = dist.get_rank()
    return {kind: continue_from(case, gen_dir, kind, path(ckpt_dir, case, kind, None if kind == "merged" else rank))
            for kind in ("full", "deduped", "merged")}


def refuse(case, gen_dir, foreign_file):
    """Try to load another plan's per-rank state; what does not fit raises and changes nothing."""
    model = parallel_model(case, gen_dir)
    opt = case.make_optimizer(model)
    before = local_pieces(model)
    sd, osd = load(foreign_file)
    errors = []
    for attempt in (lambda: model.load_state_dict(sd), lambda: opt.load_state_dict(osd)):
        try:
            attempt()
            errors.append(None)
        except CheckpointError as err:
            errors.append(str(err))
    unchanged = all(torch.equal(was, now) for (_, was), (_, now) in zip(before, local_pieces(model)))
    return {"errors": errors, "params_unchanged": unchanged, "optimizer_empty": not opt.state}


def no_weights(case, base_dir):
    """Ranks of unit 0 share a folder (one machine); every other rank has its own (other machines),
    which 'no_weights' leaves without the initial weights."""
    rank = dist.get_rank()
    gen_dir = f"{base_dir}/node{0 if rank < case.plan_ngpus else rank}"
    model = parallelize(build(case.model), batch(case.model, 12345), case.policy, case.compute_config, gen_savedir=gen_dir,
                        instance_name=case.instance_name, broadcast_strategy="no_weights",
                        init_module_params=rank < case.plan_ngpus)
    has_weights = (model.gen_dir / "weights.pt").exists()
    broadcast_weights(model, case.plan_ngpus)
    out = parallel_steps(model, case.make_optimizer(model), case, range(case.steps), rank // case.plan_ngpus)
    return {**out, "has_weights": has_weights, "state": model.state_dict()}


def two_fresh_ranks(gen_dir, ckpt_dir, foreign_file):
    return {"resume": {TP2: resume(TP2, gen_dir, ckpt_dir)}, "refuse": refuse(TP2, gen_dir, foreign_file)}


def four_fresh_ranks(gen_dir, ckpt_dir, base_dir):
    return {"resume": {case: resume(case, gen_dir, ckpt_dir) for case in (TP4_ZERO, PP_ZERO, TP4_ZERO3, CONTEXT, CONTEXT_ZERO3, CONTEXT_TP,
                                                                         EXPERTS, EXPERT_GROUPS)},
            "moved": {(source, target): continue_from(target, gen_dir, "merged", path(ckpt_dir, source, "merged"))
                      for source, target in MOVES},
            "refuse": refuse(DP4_ZERO, gen_dir, path(ckpt_dir, TP2, "full", 0)),
            "refuse_stage": refuse(TP4_ZERO3, gen_dir, path(ckpt_dir, TP4_ZERO, "full", dist.get_rank())),
            "no_weights": no_weights(NO_WEIGHTS, base_dir)}


def merge_files(ckpt_dir, case, kind):
    sds, osds = zip(*(load(path(ckpt_dir, case, kind, r)) for r in range(case.runtime_ngpus)))
    return merge_state_dicts(list(sds), list(osds))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    gen_dir, ckpt_dir = str(tmp_path_factory.mktemp("gen")), str(tmp_path_factory.mktemp("ckpt"))
    per_rank = []
    for nranks in (2, 4):
        per_rank += run_ranks(train_and_save, nranks, [c for c in SAVED if c.runtime_ngpus == nranks], gen_dir, ckpt_dir)
    uninterrupted = {case: [res[case] for res in per_rank if case in res] for case in SAVED}
    for case in SAVED:
        save(merge_files(ckpt_dir, case, "full"), path(ckpt_dir, case, "merged"))
    two = run_ranks(two_fresh_ranks, 2, gen_dir, ckpt_dir, path(ckpt_dir, TP4_ZERO, "full", 0))
    four = run_ranks(four_fresh_ranks, 4, gen_dir, ckpt_dir, str(tmp_path_factory.mktemp("nodes")))
    return {"ckpt_dir": ckpt_dir, "uninterrupted": uninterrupted, "two": two, "four": four}


def single_reference(before: Case, after: Case):
    """One process: K steps with the units and micro-batches of ``before``, then M with ``after``'s."""
    model = build(before.model)
    opt = before.make_optimizer(model)
    single_steps(model, opt, before, range(K), before.units)
    after_k = (params_of(model), copy.deepcopy(opt.state_dict()))
    losses = single_steps(model, opt, after, range(K, K + M), after.units)["losses"]
    return after_k, losses


# -- tests -----------------------------------------------------------------------------------------
@pytest.mark.multiprocess
@pytest.mark.parametrize("case, fresh", [(TP2, "two"), (TP4_ZERO, "four"), (PP_ZERO, "four"), (TP4_ZERO3, "four"),
                                         (CONTEXT, "four"), (CONTEXT_ZERO3, "four"), (CONTEXT_TP, "four"), (EXPERTS, "four"),
                                         (EXPERT_GROUPS, "four")],
                         ids=str)
def test_resume_in_fresh_processes_continues_the_same_run(runs, case, fresh):
    for rank, res in enumerate(runs[fresh]):
        expected = runs["uninterrupted"][case][rank]
        for kind, losses in res["resume"][case].items():
            assert_close(torch.tensor(losses), torch.tensor(expected), f"{case} rank {rank} from {kind}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", SAVED, ids=str)
def test_merged_checkpoint_loads_into_the_original_module_and_optimizer(runs, case):
    sd, osd = load(path(runs["ckpt_dir"], case, "merged"))
    model = build(case.model)
    opt = case.make_optimizer(model)
    model.load_state_dict(sd)
    opt.load_state_dict(osd)
    (expected_params, expected_opt), expected_losses = single_reference(case, case)
    for name, p in model.named_parameters():
        assert_close(p.detach(), expected_params[name], f"{case} {name}")
    for index, state in expected_opt["state"].items():
        for key, value in state.items():
            assert_close(opt.state_dict()["state"][index][key], value, f"{case} optimizer {index} {key}")
    losses = single_steps(model, opt, case, range(K, K + M), case.units)["losses"]
    assert_close(torch.tensor(losses), torch.tensor(expected_losses), f"{case} continued from merged")


@pytest.mark.multiprocess
@pytest.mark.parametrize("source, target", MOVES, ids=str)
def test_merged_checkpoint_moves_to_another_plan(runs, source, target):
    """E.g. tp on 2 ranks (one unit) -> dp with ZeRO on 4 ranks (four units); a 2-stage pipeline with
    ZeRO -> tp; then M more steps, as one process would take them."""
    _, expected = single_reference(source, target)
    for rank, res in enumerate(runs["four"]):
        losses = [step[rank // target.plan_ngpus] for step in expected]
        assert_close(torch.tensor(res["moved"][source, target]), torch.tensor(losses), f"rank {rank} in {target}")


@pytest.mark.multiprocess
def test_another_plans_per_rank_state_is_refused_unchanged(runs):
    tp_into_dp = runs["four"][0]["refuse"]
    assert "'embed.weight' (whole, shape (64, 32)) here" in tp_into_dp["errors"][0]      # split by vocabulary
    assert "part 0 of 2 along dim 0" in tp_into_dp["errors"][0] and "merge_state_dicts" in tp_into_dp["errors"][0]
    assert "optimizer parameter 0" in tp_into_dp["errors"][1]
    zero_into_plain = runs["two"][0]["refuse"]
    assert zero_into_plain["errors"][0] is None       # the same slices: the module state fits
    assert "optimizer parameter 0" in zero_into_plain["errors"][1]
    assert tp_into_dp["params_unchanged"] and tp_into_dp["optimizer_empty"] and zero_into_plain["optimizer_empty"]
    for rank, res in enumerate(runs["four"]):       # ZeRO-1's per-rank state into ZeRO-3: the same slices,
        stage1_into_3 = res["refuse_stage"]          # another optimizer layout (buckets against units)
        assert stage1_into_3["errors"][0] is None, (rank, stage1_into_3)
        assert "optimizer parameter 0" in stage1_into_3["errors"][1] and stage1_into_3["optimizer_empty"]


@pytest.mark.multiprocess
def test_deduped_checkpoints_keep_each_copy_once(runs):
    ckpt_dir = runs["ckpt_dir"]
    for case in (TP2, TP4_ZERO):
        full = [load(path(ckpt_dir, case, "full", r)) for r in range(case.runtime_ngpus)]
        deduped = [load(path(ckpt_dir, case, "deduped", r)) for r in range(case.runtime_ngpus)]
        module_keys = [{k for k, v in sd.items() if isinstance(v, torch.Tensor)} for sd, _ in deduped]
        assert "norm_weight" in module_keys[0] and "norm_weight" not in module_keys[1]        # replicated in a unit
        assert "blocks_0_attn_q_weight" in module_keys[0] and "blocks_0_attn_q_weight" in module_keys[1]  # split
        if case.units > 1:
            assert module_keys[2] == set() and module_keys[3] == set()                      # unit 1 = unit 0
        merged_full, _ = merge_state_dicts(*map(list, zip(*full)))
        merged_deduped, merged_deduped_opt = merge_state_dicts(*map(list, zip(*deduped)))
        assert merged_full.keys() == merged_deduped.keys() and merged_deduped_opt["state"]
        for name, t in merged_full.items():
            assert torch.equal(merged_deduped[name], t), name
    zero_state = [len(osd["state"]) for _, osd in (load(path(ckpt_dir, TP4_ZERO, "deduped", r)) for r in range(4))]
    assert zero_state[0] and zero_state[2]      # ZeRO shards differ across the zero group: all are kept


@pytest.mark.multiprocess
def test_no_weights_ranks_train_after_broadcast_weights(runs):
    per_rank = [res["no_weights"] for res in runs["four"]]
    assert [res["has_weights"] for res in per_rank] == [True, True, False, False]
    check_equivalence(NO_WEIGHTS, per_rank)
