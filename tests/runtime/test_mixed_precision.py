"""Mixed precision trains like one process with the same recipe, on 1, 2 and 4 ranks.

The recipe: the module in bf16 (``parallelize(..., module_dtype=torch.bfloat16)``), an fp32 master
copy of each rank's parameters with fp32 AdamW state (``build_optimizer(..., master_dtype=
torch.float32)``), gradients summed across ranks in ``grad_reduce_dtype``. The reference is that
recipe written out plainly in one process (``reference`` below). The cases cover dp, tp with
recompute, data, autodist, pipelines (gpipe, 1f1b, 1f1b_plus; hybrid: stages with tp inside),
ZeRO 1 to 3 (stage 3 also over a context-parallel group), a bf16 reduction, and clipping; then checkpoints, and fp16 loss scaling across ranks.

Tolerances. bf16 keeps 8 significant bits: its unit roundoff is ``u = 2**-8`` and one ulp is at
most ``2u`` relative. A parallel run computes the same values as the reference, but partitioned
matmuls, pipeline stages and collectives add partial sums in another order, so a value may round
the other way and end one ulp apart:

- losses, themselves bf16 numbers: relative ``LOSS_RTOL = 4 * 2u = 2**-5``, four ulps, at every
  step (the runs here end at most one ulp apart; data parallelism with an fp32 sum on 1 and 2
  ranks gives the same bits);
- master weights after the last step. Adam moves each element by at most about ``lr`` per step
  (``|m / sqrt(v)| <= 1``), whatever the gradient's size, so gradients that differ by ``O(u)``
  change an update much only where the gradient itself is at the level of rounding noise, and
  two runs can never be more than ``2 * lr * steps`` apart in an element. The test allows an RMS
  difference of ``MASTER_SHARE = 1/16`` of Adam's reach ``lr * steps`` (the runs here stay
  within 1/40 of it). The bf16 parameters must equal the masters rounded to bf16, bit for bit;
- the clipped gradient norm, computed from the fp32 gradients: relative ``NORM_RTOL = 2u``, one
  ulp, as the gradients it sums differ by rounding only.

The fp32 oracle (``tests/runtime/test_equivalence.py``) holds parallel runs to 1e-5; this test
holds the bf16 ones to what bf16 can promise, and checks what is held in which dtype.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist

from nbscaler import broadcast_weights, build_optimizer, deduped_state_dict, merge_state_dicts
from nbscaler.runtime.checkpoint import load, load_master_weights, save
from nbscaler.runtime.scaler import LossScaler
from tests.models import build
from tests.multiprocess import (OPTIMIZERS, Case, assert_close, buckets, context_parallel, expert_parallel,
                                load_state_of_kind, parallel_model, parallel_steps, pipeline, recompute, run_ranks,
                                samples, zero)

BF16, FP32 = torch.bfloat16, torch.float32
U = 2.0 ** -8                        # bf16's unit roundoff
LOSS_RTOL = 4 * 2 * U
MASTER_SHARE = 1 / 16
NORM_RTOL = 2 * U
STEPS = 5


def mixed(model: str, policy: str, plan: int, runtime: int, config: tuple = (), reduce=FP32, clip=None) -> Case:
    return Case(model, policy, plan, runtime, steps=STEPS, config=config, optimizer="adamw", clip=clip,
                module_dtype=BF16, master_dtype=FP32, grad_reduce_dtype=reduce)


CASES = {
    1: [mixed("llama", "dp", 1, 1), mixed("llama", "dp", 1, 1, zero()), mixed("llama", "dp", 1, 1, zero(stage=3))],
    2: [mixed("llama", "dp", 1, 2), mixed("llama", "tp", 2, 2, recompute("blocks.0"), clip=0.5),
        mixed("llama", "data", 2, 2), mixed("llama", "autodist", 2, 2), mixed("llama", "dp", 1, 2, zero(stage=2)),
        mixed("gpt", "pp", 2, 2, pipeline("gpipe", 2, 2)), mixed("llama", "dp", 1, 2, buckets(16 * 1024)),
        mixed("llama", "dp", 1, 2, zero(stage=2) + buckets(16 * 1024), clip=0.5),
        mixed("llama", "dp", 1, 2, zero(stage=3), clip=0.5),
        mixed("gpt", "tp", 2, 2, context_parallel(2, "ring")), mixed("llama", "tp", 2, 2, context_parallel(2)),
        mixed("moe", "dp", 1, 2), mixed("moe_capacity", "dp", 1, 2, zero(stage=2)),
        mixed("moe", "tp", 2, 2, expert_parallel(2)), mixed("moe_capacity", "tp", 2, 2, expert_parallel(2))],
    4: [mixed("llama", "dp", 1, 4, reduce=BF16), mixed("llama", "tp", 2, 4, zero(), clip=0.5),
        mixed("gpt", "pp", 2, 4, pipeline("1f1b", 2, 2) + zero(stage=2)),
        mixed("gpt", "hybrid", 4, 4, pipeline("1f1b_plus", 2, 2)),
        mixed("llama", "dp", 1, 4, zero() + buckets(16 * 1024)), mixed("llama", "tp", 2, 4, zero(stage=3)),
        mixed("gpt", "tp", 4, 4, context_parallel(4, "ring")), mixed("llama", "tp", 4, 4, context_parallel(2)),
        mixed("hf_llama", "tp", 2, 4, context_parallel(2, "ring") + zero(stage=3), clip=0.5),
        mixed("moe", "tp", 4, 4, expert_parallel(2, hidden=2)),
        mixed("moe_capacity", "tp", 4, 4, expert_parallel(2, around="tp", hidden=2), clip=0.5)],
}


def train_mixed(cases: List[Case], gen_dir: str) -> List[Dict[str, Any]]:
    """On every rank: train each case; return its losses, what dtypes it holds, and its state."""
    rank = dist.get_rank()
    results = []
    for case in cases:
        model = parallel_model(case, gen_dir)
        opt = case.make_optimizer(model)
        params = {str(p.dtype) for p in model.parameters()}
        out = parallel_steps(model, opt, case, range(case.steps), rank // case.unit_ngpus)
        state = {str(v.dtype) for s in opt.state.values() for k, v in s.items() if k != "step"}
        results.append({"losses": out["losses"], "norms": out["norms"], "params": params, "state_dtypes": state,
                        "optimizer": {str(p.dtype) for g in opt.param_groups for p in g["params"]},
                        "module_state": model.state_dict(), "optimizer_state": opt.state_dict()})
    return results


def reference(case: Case) -> Dict[str, Any]:
    """The recipe in one process: the model in bf16; each unit's loss backward on its own (its
    micro-batches accumulated in bf16, as on a rank); the units' gradients summed in the reduction
    dtype into fp32 master gradients, clipped by their norm; AdamW on the fp32 masters, copied back
    into the model."""
    model = build(case.model).to(case.module_dtype)
    params = list(model.parameters())
    masters = [p.detach().to(case.master_dtype).requires_grad_() for p in params]
    cls, kwargs = OPTIMIZERS[case.optimizer]
    opt = cls(masters, **kwargs)
    losses, norms = [], []
    for step in range(case.steps):
        sums = [torch.zeros_like(p, dtype=case.grad_reduce_dtype) for p in params]
        per_unit = []
        for unit in range(case.units):
            unit_losses = [model(**args) for args in samples(case, step, unit)]
            sum(unit_losses).backward()
            per_unit.append([loss.item() for loss in unit_losses])
            for total, p in zip(sums, params):
                total += p.grad
                p.grad = None
        for master, total in zip(masters, sums):
            master.grad = total.to(case.master_dtype)
        if case.clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(masters, case.clip).item())
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, master in zip(params, masters):
                p.copy_(master)
        losses.append(per_unit)
    names = [name for name, _ in model.named_parameters()]
    return {"losses": losses, "norms": norms, "masters": dict(zip(names, masters)), "names": names}


@pytest.mark.multiprocess
@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_mixed_precision_trains_like_one_process(nranks, tmp_path):
    check_like_one_process(CASES[nranks], run_ranks(train_mixed, nranks, CASES[nranks], str(tmp_path)))


# The pipeline schedulers not in CASES: zero bubble's split backward (B then W), several stages per
# device, and chimera's two copies of each stage, whose gradients are summed before the masters get them.
SCHEDULER_CASES = {
    2: [mixed("gpt", "pp", 2, 2, pipeline("zb_h1", 2, 4)), mixed("gpt", "pp", 2, 2, pipeline("1f1b_interleaved", 4, 4)),
        mixed("gpt", "pp", 2, 2, pipeline("zbv", 4, 4))],
    4: [mixed("gpt", "pp", 4, 4, pipeline("chimera_direct", 4, 4))],
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("nranks", [2, 4])
def test_every_pipeline_scheduler_trains_mixed_like_one_process(nranks, tmp_path):
    cases = SCHEDULER_CASES[nranks]
    check_like_one_process(cases, run_ranks(train_mixed, nranks, cases, str(tmp_path)))


def check_like_one_process(cases: List[Case], per_rank: List[List[Dict[str, Any]]]) -> None:
    """Each case's losses, dtypes and merged master weights against ``reference``, within the
    tolerances derived above."""
    for i, case in enumerate(cases):
        results = [res[i] for res in per_rank]
        ref = reference(case)
        for rank, res in enumerate(results):
            assert res["params"] == {"torch.bfloat16"}, f"{case} rank {rank} holds parameters in {res['params']}"
            assert res["optimizer"] == {"torch.float32"}, f"{case} rank {rank} steps on {res['optimizer']}"
            assert res["state_dtypes"] == {"torch.float32"}, f"{case} rank {rank} keeps state in {res['state_dtypes']}"
            for step in range(case.steps):
                expected = torch.tensor(ref["losses"][step][rank // case.unit_ngpus])
                assert_close(torch.tensor(res["losses"][step]), expected, f"{case} step {step} rank {rank} loss",
                             rtol=LOSS_RTOL)
            if case.clip is not None:        # the norm of the fp32 gradients, equal to the reference's
                assert_close(torch.tensor(res["norms"]), torch.tensor(ref["norms"]), f"{case} rank {rank} norms",
                             rtol=NORM_RTOL)
        params, merged = merge_state_dicts([r["module_state"] for r in results],
                                           [r["optimizer_state"] for r in results])
        reach = OPTIMIZERS[case.optimizer][1]["lr"] * case.steps
        for index, name in enumerate(ref["names"]):
            master = merged["state"][index]["master"]
            assert master.dtype == FP32 and torch.equal(params[name], master.to(BF16)), f"{case}: {name}"
            rms = (master - ref["masters"][name].detach()).pow(2).mean().sqrt().item()
            assert rms <= MASTER_SHARE * reach, f"{case} master {name}: RMS difference {rms:.2e} > 1/16 of {reach}"


# -- checkpoints -------------------------------------------------------------------------------------
K, M = 2, 2                              # steps before the checkpoint, steps after it
SAVED = mixed("llama", "tp", 2, 2)
MOVED = mixed("llama", "dp", 1, 2, zero())                                # another plan, with masters
FP32_PLAN = Case("llama", "dp", 1, 2, optimizer="adamw")                  # another plan, without


def ckpt(ckpt_dir: str, kind: str, rank: Optional[int] = None) -> str:
    return f"{ckpt_dir}/{kind}{'' if rank is None else f'.{rank}'}.pt"


def train_and_save(gen_dir: str, ckpt_dir: str) -> List[list]:
    """``K`` steps, a per-rank and a deduped checkpoint, ``M`` more steps: their losses."""
    rank = dist.get_rank()
    model = parallel_model(SAVED, gen_dir)
    opt = SAVED.make_optimizer(model)
    parallel_steps(model, opt, SAVED, range(K), rank // SAVED.unit_ngpus)
    save((model.state_dict(), opt.state_dict()), ckpt(ckpt_dir, "full", rank))
    save(deduped_state_dict(model, opt), ckpt(ckpt_dir, "deduped", rank))
    return parallel_steps(model, opt, SAVED, range(K, K + M), rank // SAVED.unit_ngpus)["losses"]


def resume_and_move(gen_dir: str, ckpt_dir: str) -> Dict[str, Any]:
    """Fresh ranks: resume ``SAVED`` from each kind of checkpoint and train ``M`` steps; load the
    merged checkpoint into two other plans and return what they hold."""
    rank = dist.get_rank()
    out: Dict[str, Any] = {}
    for kind in ("full", "deduped", "merged"):
        model = parallel_model(SAVED, gen_dir)
        opt = SAVED.make_optimizer(model)
        load_state_of_kind(model, opt, kind, *load(ckpt(ckpt_dir, kind, None if kind == "merged" else rank)))
        out[kind] = parallel_steps(model, opt, SAVED, range(K, K + M), rank // SAVED.unit_ngpus)["losses"]
    for case in (MOVED, FP32_PLAN):
        model = parallel_model(case, gen_dir)
        opt = case.make_optimizer(model)
        load_state_of_kind(model, opt, "merged", *load(ckpt(ckpt_dir, "merged")))
        out[case] = (model.state_dict(), opt.state_dict())
    return out


@pytest.mark.multiprocess
def test_checkpoints_keep_fp32_masters_exact_and_resume_the_same_run(tmp_path):
    """Per-rank, deduped and merged checkpoints hold the fp32 masters and state; resuming from each
    gives the losses of the run that did not stop, bit for bit; the merged masters load exactly
    into the plain fp32 module, into a ZeRO plan with masters, and into an fp32 plan as its
    parameters."""
    gen_dir, ckpt_dir = str(tmp_path / "gen"), str(tmp_path / "ckpt")
    Path(ckpt_dir).mkdir()
    uninterrupted = run_ranks(train_and_save, 2, gen_dir, ckpt_dir)
    merged = {kind: merge_state_dicts(*map(list, zip(*(load(ckpt(ckpt_dir, kind, r)) for r in range(2)))))
              for kind in ("full", "deduped")}
    sd, osd = merged["full"]
    names = [name for name, _ in build(SAVED.model).named_parameters()]
    for index, name in enumerate(names):
        master = osd["state"][index]["master"]
        assert master.dtype == FP32 and osd["state"][index]["exp_avg"].dtype == FP32, name
        assert sd[name].dtype == BF16 and torch.equal(sd[name], master.to(BF16)), name
        assert not torch.equal(master, master.to(BF16).to(FP32)), f"{name}: the master holds no more than bf16"
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(merged["deduped"][1]["state"][index][key], osd["state"][index][key]), (name, key)
    plain = build(SAVED.model)                       # the original module, in fp32
    plain.load_state_dict(sd)
    assert load_master_weights(plain, osd) == len(names)
    torch.optim.AdamW(plain.parameters()).load_state_dict(osd)
    for index, (name, p) in enumerate(plain.named_parameters()):
        assert torch.equal(p, osd["state"][index]["master"]), f"{name} in the plain module"
    save(merged["full"], ckpt(ckpt_dir, "merged"))
    fresh = run_ranks(resume_and_move, 2, gen_dir, ckpt_dir)
    for rank, res in enumerate(fresh):
        for kind in ("full", "deduped", "merged"):
            assert res[kind] == uninterrupted[rank], f"resumed from the {kind} checkpoint, rank {rank}"
    moved_sd, moved_osd = merge_state_dicts(*map(list, zip(*(res[MOVED] for res in fresh))))
    fp32_sd, _ = merge_state_dicts([res[FP32_PLAN][0] for res in fresh])
    for index, name in enumerate(names):
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(moved_osd["state"][index][key], osd["state"][index][key]), (name, key)
        assert torch.equal(moved_sd[name], sd[name]), name
        assert torch.equal(fp32_sd[name], osd["state"][index]["master"]), f"{name} in the fp32 plan"


# -- loss scaling across ranks ------------------------------------------------------------------------
FP16_ZERO = Case("mlp", "dp", 1, 2, steps=3, config=zero(), optimizer="adamw", module_dtype=torch.float16,
                 master_dtype=FP32)


def overflow_on_one_rank(gen_dir: str) -> Dict[str, Any]:
    """fp16 with ZeRO on 2 ranks; at step 1 rank 1 puts an inf into the first gradient element it
    sends, which the reduce-scatter delivers to rank 0's shard only: both ranks must skip."""
    rank = dist.get_rank()
    model = parallel_model(FP16_ZERO, gen_dir)
    scaler = LossScaler(init_scale=2.0 ** 8, growth_interval=100)
    opt = build_optimizer(model, torch.optim.AdamW, master_dtype=FP32, scaler=scaler, lr=0.01)
    step_of = {"now": 0}
    opt.register_reducer_pre_hook(lambda reducer, flat: flat[0].fill_(float("inf"))
                                  if rank == 1 and step_of["now"] == 1 else None)
    skipped = []
    for step in range(FP16_ZERO.steps):
        step_of["now"] = step
        scaler.scale(model(**samples(FP16_ZERO, step, rank)[0])).backward()
        opt.step()
        opt.zero_grad()
        skipped.append(scaler.skipped)
    return {"skipped": skipped, "scale": scaler.value, "params": [p.detach().clone() for p in model.parameters()]}


@pytest.mark.multiprocess
def test_an_overflow_seen_by_one_rank_skips_the_step_on_every_rank(tmp_path):
    per_rank = run_ranks(overflow_on_one_rank, 2, str(tmp_path))
    for res in per_rank:
        assert res["skipped"] == [0, 1, 1] and res["scale"] == 2.0 ** 7, res
    assert all(torch.equal(a, b) for a, b in zip(per_rank[0]["params"], per_rank[1]["params"]))


def weights_broadcast_after_the_optimizer(gen_dir: str) -> List[torch.Tensor]:
    """Rank 1 holds no weights (zeros) when the optimizer is built, then receives rank 0's."""
    case = mixed("mlp", "dp", 1, 2)
    model = parallel_model(case, gen_dir)
    if dist.get_rank() == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    opt = case.make_optimizer(model)
    broadcast_weights(model, 1)
    model(**samples(case, 0, 0)[0]).backward()
    opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.multiprocess
def test_broadcast_weights_reach_the_master_copies(tmp_path):
    first, second = run_ranks(weights_broadcast_after_the_optimizer, 2, str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(first, second))
