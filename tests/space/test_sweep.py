"""nbscaler.sweep: each row is what the full plan of its configuration predicts on the target."""

import dataclasses

import pandas as pd
import pytest
import torch

import nbscaler
from nbscaler.cost.software import Software
from nbscaler import Hardware
from nbscaler.columns import SweepColumn
from nbscaler.models.gpt import GPT, GPTConfig
from nbscaler.models.llama import Llama, LlamaConfig
from nbscaler.space.sweep import config_of

SEQ = 64
GPT_CFG = GPTConfig(vocab_size=512, seq_len=SEQ, n_layer=6, d_model=128, n_head=4)
# 8 GPUs, 2 to a node, slow links: collectives, sends and the all-reduce all weigh in the step
TARGET = dataclasses.replace(Hardware.named("A100-SXM-40GB", nodes=4), name="small", gpus_per_node=2,
                             memory_bytes=6e6, intra_node_bytes_per_s=5e9, inter_node_bytes_per_s=1e9)
GLOBAL_BATCH = 16


def tokens(batch: int):
    idx = torch.zeros(batch, SEQ, dtype=torch.long)
    return {"batch": {"idx": idx, "targets": idx.clone()}}


@pytest.fixture(scope="module")
def frame():
    return nbscaler.sweep(GPT(GPT_CFG), tokens(1), TARGET, global_batch=GLOBAL_BATCH, tp=(1, 2), pp=(1, 2, 4),
                          micro_batch=(1, 2), progress=False)


def full_plan_figures(module, args, row, stack, target=TARGET):
    """The figures of ``row`` from ``plan.summary`` of its configuration, planned whole."""
    plan = nbscaler.plan(module, args, "hybrid", config_of(row, target.ngpus, stack), module_dtype=torch.bfloat16)
    s = plan.summary(torch.optim.AdamW, hardware=target, master_dtype=torch.float32)
    step, peak = s.step_time_s.max(), target.peak_flops(torch.bfloat16) * len(s)
    parts = plan.step_figures(torch.optim.AdamW, hardware=target, master_dtype=torch.float32)
    return {"step_time_s": step, "peak_bytes": s.peak_bytes.max(), "mfu": s.flops.sum() / (step * peak),
            "hfu": s.hardware_flops.sum() / (step * peak), "tokens_per_s": s.tokens_per_s.iloc[0],
            "fits": bool(s.fits.all()), "bubble": parts.bubble, "tp_comm_share": parts.tp_comm_share,
            "dp_comm_share": parts.dp_comm_share, "pp_send_share": parts.pp_send_share,
            "fsdp_comm_share": parts.fsdp_comm_share}


def test_the_frame_has_the_sweep_columns_fitting_and_fastest_first(frame):
    assert list(frame.columns) == [str(c) for c in SweepColumn]
    # (tp 1, tp 2 without and with sequence parallelism) x pp x micro-batch x recompute x ZeRO
    assert len(frame) == (1 + 2) * 3 * 2 * 3 * 3
    assert not frame[frame.tp == 1].sequence_parallel.any() and frame[frame.tp == 2].sequence_parallel.sum() == 54
    assert set(frame.recompute) == {"none", "selective", "full"}
    assert (frame.tp * frame.pp * frame.dp == TARGET.ngpus).all()
    assert (frame.micro_batch * frame.micro_batches * frame.dp == GLOBAL_BATCH).all()
    assert frame.fits.any() and not frame.fits.all()
    fits = frame[frame.fits]
    assert frame.fits.iloc[:len(fits)].all() and fits.step_time_s.is_monotonic_increasing
    shares = frame[["bubble", "tp_comm_share", "dp_comm_share", "pp_send_share"]]
    assert ((shares >= 0) & (shares < 1)).all().all() and (shares.sum(axis=1) < 1).all()
    assert (frame[frame.pp == 1].bubble == 0).all() and (frame[frame.tp == 1].tp_comm_share == 0).all()
    assert frame.attrs["stack"] == "blocks" and frame.attrs["excluded"].empty


@pytest.mark.parametrize("tp, pp, micro_batch, recompute, zero_stage, sequence_parallel", [
    (2, 4, 2, "full", 2, False),     # tp x pp, one unit: ZeRO over one rank
    (1, 4, 1, "none", 1, False),     # a deep pipeline over 2 units
    (2, 2, 1, "full", 0, False),     # stages of 3 layers, 2 units across nodes
    (1, 1, 2, "none", 2, False),     # gradient accumulation on 8 units
    # sequence parallel: each stage all-gathers the slice it sends; under ZeRO 2 the norms'
    # weights, each device's gradient partial over its slice, are summed in the backward
    (2, 4, 2, "full", 2, True),
    (2, 2, 1, "none", 0, True),
    (2, 1, 2, "none", 1, True),
    # selective: each attention core runs again in its layer's backward
    (2, 4, 2, "selective", 2, True),
    (1, 2, 2, "selective", 1, False),
    (2, 2, 1, "selective", 0, False),
])
def test_a_row_is_the_full_plans_prediction(frame, tp, pp, micro_batch, recompute, zero_stage, sequence_parallel):
    row = frame[(frame.tp == tp) & (frame.pp == pp) & (frame.micro_batch == micro_batch)
                & (frame.recompute == recompute) & (frame.zero_stage == zero_stage)
                & (frame.sequence_parallel == sequence_parallel)].iloc[0]
    expected = full_plan_figures(GPT(GPT_CFG), tokens(micro_batch), row, frame.attrs["stack"])
    for column, value in expected.items():
        assert row[column] == pytest.approx(value, rel=1e-9), column


@pytest.fixture(scope="module")
def fsdp_frame():
    return nbscaler.sweep(GPT(GPT_CFG), tokens(1), TARGET, global_batch=GLOBAL_BATCH, tp=(1, 2), pp=(1, 2),
                          micro_batch=(1, 2), zero_stage=(3,), zero_reshard_after_forward=(True, False), progress=False)


@pytest.mark.slow       # a sweep and a full plan per row: seconds
@pytest.mark.parametrize("tp, pp, micro_batch, recompute, sequence_parallel, reshard", [
    (1, 1, 2, "none", False, True),      # FSDP over the 8 GPUs, 2 to a node: its group crosses the nodes
    (1, 1, 1, "full", False, False),     # each layer kept gathered from its forward to its backward
    (2, 2, 1, "none", True, True),       # within tp x pp: 2 units, the first stage's rest gathered once
    (2, 1, 2, "selective", False, False),
    (2, 2, 2, "full", True, False),
])
def test_a_zero3_row_is_the_full_plans_prediction(fsdp_frame, tp, pp, micro_batch, recompute, sequence_parallel,
                                                  reshard):
    """Each stage's ops laid out as its section's instructions, the units gathered where the
    lowering puts them: the sweep's ZeRO-3 row is what the full plan predicts, waits included."""
    frame = fsdp_frame
    row = frame[(frame.tp == tp) & (frame.pp == pp) & (frame.micro_batch == micro_batch)
                & (frame.recompute == recompute) & (frame.sequence_parallel == sequence_parallel)
                & (frame.zero_reshard_after_forward == reshard)].iloc[0]
    expected = full_plan_figures(GPT(GPT_CFG), tokens(micro_batch), row, frame.attrs["stack"])
    assert expected["fsdp_comm_share"] > 0 and row.dp_comm_share == 0
    for column, value in expected.items():
        assert row[column] == pytest.approx(value, rel=1e-9), column


def test_zero3_is_swept_beside_the_other_stages_with_its_reshard_choice_alone():
    frame = nbscaler.sweep(GPT(GPT_CFG), tokens(1), TARGET, global_batch=8, tp=(1,), pp=(1,), micro_batch=(1,),
                           recompute=("none",), zero_stage=(2, 3), zero_reshard_after_forward=(True, False),
                           progress=False)
    assert sorted(zip(frame.zero_stage, frame.zero_reshard_after_forward)) == [(2, True), (3, False), (3, True)]
    rows = frame.set_index(["zero_stage", "zero_reshard_after_forward"])
    assert rows.fsdp_comm_share[(2, True)] == 0 and rows.dp_comm_share[(2, True)] > 0
    assert rows.fsdp_comm_share[(3, True)] > rows.fsdp_comm_share[(3, False)] > 0    # kept: no gathers in the backward
    assert rows.dp_comm_share[(3, True)] == 0
    stage2 = frame[frame.zero_stage == 2].iloc[0]
    cfg = config_of(stage2, TARGET.ngpus, frame.attrs["stack"])
    assert cfg.use_zero and cfg.zero_stage == 2 and cfg.zero_reshard_after_forward
    kept = frame[(frame.zero_stage == 3) & ~frame.zero_reshard_after_forward].iloc[0]
    assert not config_of(kept, TARGET.ngpus, frame.attrs["stack"]).zero_reshard_after_forward
    expected = full_plan_figures(GPT(GPT_CFG), tokens(1), kept, frame.attrs["stack"])
    for column, value in expected.items():
        assert kept[column] == pytest.approx(value, rel=1e-9), column


def test_a_row_on_a_target_without_overlap_or_flash_attention_is_the_full_plans_prediction():
    """The target's software (scores materialised, the reduction after the backward) prices the sweep
    as it prices the full plan."""
    target = TARGET.running(Software(attention="materialized", overlap_grad_reduce=False))
    frame = nbscaler.sweep(GPT(GPT_CFG), tokens(1), target, global_batch=GLOBAL_BATCH, tp=(2,), pp=(2,),
                           micro_batch=(1,), recompute=(True,), zero_stage=(0,), progress=False)
    row = frame.iloc[0]
    expected = full_plan_figures(GPT(GPT_CFG), tokens(1), row, frame.attrs["stack"], target)
    assert row.dp_comm_share > 0
    for column, value in expected.items():
        assert row[column] == pytest.approx(value, rel=1e-9), column


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel, recompute", [(False, "full"), (True, "selective")])
def test_a_llama_row_with_rotary_tables_and_grouped_heads_is_the_full_plans_prediction(sequence_parallel, recompute):
    cfg = LlamaConfig(vocab_size=512, seq_len=SEQ, n_layer=5, d_model=128, n_head=4, n_kv_head=2)
    idx = torch.zeros(1, SEQ, dtype=torch.long)
    frame = nbscaler.sweep(Llama(cfg), {"idx": idx, "targets": idx}, TARGET, global_batch=8, tp=(2,), pp=(2,),
                           micro_batch=(2,), recompute=(recompute,), sequence_parallel=(sequence_parallel,),
                           zero_stage=(1,), progress=False)
    row = frame.iloc[0]
    assert row.sequence_parallel == sequence_parallel and row.recompute == recompute
    idx2 = torch.zeros(2, SEQ, dtype=torch.long)
    expected = full_plan_figures(Llama(cfg), {"idx": idx2, "targets": idx2}, row, frame.attrs["stack"])
    for column, value in expected.items():
        assert row[column] == pytest.approx(value, rel=1e-9), column


def test_combinations_that_cannot_run_are_left_out_with_their_reason():
    frame = nbscaler.sweep(GPT(GPT_CFG), tokens(1), TARGET, global_batch=4, tp=(1, 2), pp=(1, 2),
                           micro_batch=(1,), recompute=(False,), sequence_parallel=(False,), zero_stage=(0,),
                           progress=False)
    assert sorted(zip(frame.tp, frame.pp)) == [(1, 2), (2, 1), (2, 2)]
    excluded = frame.attrs["excluded"]
    assert list(zip(excluded.tp, excluded.pp)) == [(1, 1)]
    assert "global batch 4 is not a multiple of dp x micro_batch = 8 x 1" in excluded.reason.iloc[0]


@pytest.mark.parametrize("ranges, message", [
    ({"tp": (3,)}, "do not divide the 8 GPUs"),
    ({"pp": (8,)}, "more stages than the 6 layers of blocks"),
    ({"micro_batch": (0,)}, "whole numbers >= 1"),
    ({"zero_stage": (4,)}, "use 0 (no ZeRO), 1, 2 or 3"),
    ({"zero_reshard_after_forward": ("no",)}, "give True and/or False"),
    ({"sequence_parallel": ("yes",)}, "give True and/or False"),
    ({"sequence_parallel": ()}, "give True and/or False"),
])
def test_a_value_that_cannot_work_on_the_target_is_refused(ranges, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        nbscaler.sweep(GPT(GPT_CFG), tokens(1), TARGET, global_batch=16, progress=False, **ranges)


def test_inputs_of_more_than_one_sequence_are_refused():
    with pytest.raises(ValueError, match="hold one sequence"):
        nbscaler.sweep(GPT(GPT_CFG), tokens(2), TARGET, global_batch=16, tp=(1,), pp=(1,), progress=False)


def test_a_model_without_repeated_layers_is_refused():
    with pytest.raises(ValueError, match="no nn.ModuleList"):
        nbscaler.sweep(torch.nn.Linear(4, 4), {"x": torch.zeros(1, 4)}, TARGET, global_batch=8, progress=False)


def test_a_tp_that_does_not_divide_the_heads_is_left_out_with_its_reason():
    cfg = dataclasses.replace(GPT_CFG, d_model=120, n_head=3)
    frame = nbscaler.sweep(GPT(cfg), tokens(1), TARGET, global_batch=16, tp=(1, 2), pp=(1,), micro_batch=(1,),
                           recompute=(False,), zero_stage=(0,), progress=False)
    assert list(frame.tp) == [1]
    assert "tp=2 does not divide the 3 attention heads" in frame.attrs["excluded"].reason.iloc[0]


def test_layers_larger_than_a_bucket_keep_the_runtimes_bucket_order():
    """Each layer of this Llama fills several of the reducer's 25 MiB buckets, so how many buckets
    there are (ZeRO pays a reduce-scatter and an all-gather per bucket) depends on the weights being
    listed layer after layer, as the runtime registers them."""
    cfg = LlamaConfig(vocab_size=512, seq_len=SEQ, n_layer=5, d_model=2048, n_head=16, n_kv_head=4)
    with torch.device("meta"):
        model, whole = Llama(cfg), Llama(cfg)
    idx = torch.zeros(1, SEQ, dtype=torch.long)
    big = dataclasses.replace(TARGET, memory_bytes=80e9)
    frame = nbscaler.sweep(model, {"idx": idx, "targets": idx}, big, global_batch=8, tp=(1,), pp=(1,),
                           micro_batch=(1,), recompute=(False,), zero_stage=(1,), progress=False)
    row = frame.iloc[0]
    plan = nbscaler.plan(whole, {"idx": idx, "targets": idx}, "hybrid", config_of(row, big.ngpus, "blocks"),
                         module_dtype=torch.bfloat16)
    s = plan.summary(torch.optim.AdamW, hardware=big, master_dtype=torch.float32)
    assert row.step_time_s == pytest.approx(s.step_time_s.max(), rel=1e-9)
    assert row.peak_bytes == pytest.approx(s.peak_bytes.max(), rel=1e-9)


# Schedulers without virtual stages in make test: the 1F1B rows above already price a pipeline of one stage per device.
@pytest.mark.parametrize("scheduler, tp, virtual_stages, sequence_parallel", [
    ("1f1b_interleaved", 1, 3, False), ("zbv", 2, 2, False), ("zbv", 2, 2, True),
    # 2 pipeline devices of 3 virtual stages, each tensor-parallel over 2 GPUs (pipeline_virtual_stages)
    ("1f1b_interleaved", 2, 3, False), ("1f1b_interleaved", 2, 3, True),
    pytest.param("gpipe", 2, 1, False, marks=pytest.mark.slow), pytest.param("zb_h1", 1, 1, False, marks=pytest.mark.slow)])
def test_a_row_of_another_scheduler_is_the_full_plans_prediction(scheduler, tp, virtual_stages, sequence_parallel):
    frame = nbscaler.sweep(GPT(GPT_CFG), tokens(1), TARGET, global_batch=GLOBAL_BATCH, tp=(tp,), pp=(2,),
                           micro_batch=(1,), recompute=(True,), sequence_parallel=(sequence_parallel,),
                           zero_stage=(1,), scheduler=scheduler, virtual_stages=(3,), progress=False)
    row = frame.iloc[0]
    assert row.virtual_stages == virtual_stages and row.scheduler == scheduler
    assert row.sequence_parallel == sequence_parallel and row.tp == tp and (row.tp_comm_share > 0) == (tp > 1)
    expected = full_plan_figures(GPT(GPT_CFG), tokens(1), row, frame.attrs["stack"])
    for column, value in expected.items():
        assert row[column] == pytest.approx(value, rel=1e-9), column


@pytest.mark.slow
def test_a_pruned_sweep_finds_each_layouts_fastest_fitting_row_pricing_fewer(frame):
    """``prune`` leaves out what cannot beat a fitting row of its layout, or is too slow against the
    fastest: each tp x pp layout's fastest fitting step within the bound is the full sweep's, and
    the rows it does price are the full sweep's."""
    pruned = nbscaler.sweep(GPT(GPT_CFG), tokens(1), TARGET, global_batch=GLOBAL_BATCH, tp=(1, 2), pp=(1, 2, 4),
                            micro_batch=(1, 2), progress=False, prune=1.5)
    assert 0 < pruned.attrs["pruned"] == len(frame) - len(pruned)
    layouts = ["tp", "pp"]
    best = frame[frame.fits].groupby(layouts).step_time_s.min()
    best = best[best < 1.5 * best.min()]
    assert len(best) > 2
    found = pruned[pruned.fits].groupby(layouts).step_time_s.min()
    assert (found[best.index] == best).all() and (found[~found.index.isin(best.index)] >= 1.5 * best.min()).all()
    keys = layouts + ["micro_batch", "recompute", "sequence_parallel", "zero_stage"]
    both = pd.DataFrame(pruned.to_dict("list")).merge(pd.DataFrame(frame.to_dict("list")), on=keys,
                                                     suffixes=("", "_full"))
    assert len(both) == len(pruned) and (both.step_time_s == both.step_time_s_full).all()
    assert (both.peak_bytes == both.peak_bytes_full).all()


@pytest.mark.parametrize("prune", [0.5, True, "yes"])
def test_a_prune_factor_below_one_is_refused_with_the_fix(prune):
    with pytest.raises(ValueError, match=r"prune=.*give a factor >= 1"):
        nbscaler.sweep(GPT(GPT_CFG), tokens(1), TARGET, global_batch=GLOBAL_BATCH, tp=(1,), pp=(1,),
                       micro_batch=(1,), progress=False, prune=prune)


@pytest.mark.slow
def test_a_row_of_a_gpt_with_dropout_is_the_full_plans_prediction():
    """The two-layer copy traces the dropouts (and an eval graph apart): their passes and saved masks
    price the row as they price the full plan."""
    cfg = dataclasses.replace(GPT_CFG, dropout=0.1)
    frame = nbscaler.sweep(GPT(cfg), tokens(1), TARGET, global_batch=GLOBAL_BATCH, tp=(2,), pp=(2,),
                           micro_batch=(2,), recompute=(False,), zero_stage=(1,), progress=False)
    row = frame.iloc[0]
    expected = full_plan_figures(GPT(cfg), tokens(2), row, frame.attrs["stack"])
    for column, value in expected.items():
        assert row[column] == pytest.approx(value, rel=1e-9), column
    plain = nbscaler.sweep(GPT(GPT_CFG), tokens(1), TARGET, global_batch=GLOBAL_BATCH, tp=(2,), pp=(2,),
                           micro_batch=(2,), recompute=(False,), zero_stage=(1,), progress=False).iloc[0]
    assert row.step_time_s > plain.step_time_s and row.peak_bytes > plain.peak_bytes


def saved_by_op(plan) -> dict:
    """Op name -> the bytes it saves for the backward on device 0 (one stage, one forward)."""
    saved: dict = {}
    for op in plan.local_runs[0][0].ops:
        saved[op.node.name] = saved.get(op.node.name, 0) + op.saved_bytes
    return saved


@pytest.mark.slow       # a second or so: make test runs it, the edit-test loop does not
def test_sequence_parallelism_slices_what_the_norms_save_on_a_real_model():
    """Hugging Face's Llama at tp 2: with sequence parallelism each row needs less memory than its
    twin without, by what the ops between the linears save, halved (Korthikanti et al. 2022): those
    ops (the RMS norms; the residual adds save nothing) run on half the sequence, and no other op
    saves more or less."""
    from tests.models import hf
    model = hf.LossOf(hf.llama())
    ids = torch.zeros(1, hf.SEQ, dtype=torch.long)
    args = lambda n: {"batch": {"input_ids": ids.repeat(n, 1), "labels": ids.repeat(n, 1),
                                "attention_mask": torch.ones(n, hf.SEQ, dtype=torch.long)}}
    frame = nbscaler.sweep(model, args(1), TARGET, global_batch=8, tp=(2,), pp=(1, 2), micro_batch=(1, 2),
                           recompute=(False,), zero_stage=(1,), progress=False)
    keys = ["pp", "micro_batch"]
    sliced, whole = (frame[frame.sequence_parallel == sp].set_index(keys).sort_index() for sp in (True, False))
    assert len(sliced) == len(whole) == 4 and (sliced.peak_bytes < whole.peak_bytes).all()
    twins = frame[(frame.pp == 1) & (frame.micro_batch == 2)]
    row = {sp: twins[twins.sequence_parallel == sp].iloc[0] for sp in (False, True)}
    plans = {sp: nbscaler.plan(model, args(2), "hybrid", config_of(r, TARGET.ngpus, frame.attrs["stack"]),
                               module_dtype=torch.bfloat16) for sp, r in row.items()}
    summaries = {sp: p.summary(torch.optim.AdamW, hardware=TARGET, master_dtype=torch.float32)
                 for sp, p in plans.items()}
    for sp in (False, True):                            # the sweep's rows are the plans' predictions
        assert row[sp].peak_bytes == pytest.approx(summaries[sp].peak_bytes.max(), rel=1e-9)
    split = {sp: set(p.ops.name[p.ops.split.notna()]) for sp, p in plans.items()}
    on_slice, ops = split[True] - split[False], plans[True].ops.set_index("name")
    saved = {sp: saved_by_op(p) for sp, p in plans.items()}
    changed = {name for name in saved[False] if saved[True][name] != saved[False][name]}
    assert changed and changed == {name for name in on_slice if saved[False][name]}
    # the RMS norms' ops (pow, rsqrt, mul) save their inputs; a residual add saves nothing
    norms = {m for m in ops.module if m.endswith("norm")}
    assert {ops.module[name] for name in changed} == norms and len(norms) == 2 * 2 + 1    # 2 a layer, the last
    assert all(saved[True][name] * 2 == saved[False][name] for name in changed)
    halved = sum(saved[False][name] // 2 for name in changed)
    drop = summaries[False].activation_bytes.max() - summaries[True].activation_bytes.max()
    assert drop == halved and row[False].peak_bytes - row[True].peak_bytes == halved


@pytest.fixture(scope="module")
def cp_frame():
    """Context parallelism beside tensor parallelism: each stage's sequence over its cp devices."""
    return nbscaler.sweep(GPT(GPT_CFG), tokens(1), TARGET, global_batch=GLOBAL_BATCH, tp=(1, 2), cp=(1, 2, 4),
                          pp=(1, 2), micro_batch=(1,), recompute=("none", "full"), zero_stage=(0, 2, 3),
                          context_parallel_kind=("all_gather", "ring"), progress=False)


def test_cp_is_a_dimension_of_the_sweep_with_tp_inside_each_context_parallel_device(cp_frame):
    frame = cp_frame
    assert (frame.tp * frame.cp * frame.pp * frame.dp == TARGET.ngpus).all()
    assert not frame[(frame.cp > 1) & (frame.tp == 1)].sequence_parallel.any()     # sequence parallel needs tp
    assert set(frame[(frame.cp > 1) & (frame.tp > 1)].sequence_parallel) == {False, True}
    # at cp 1 one row, whose kind is the first given; above it, both kinds
    assert set(frame[frame.cp == 1].context_parallel_kind) == {"all_gather"}
    assert set(frame[frame.cp > 1].context_parallel_kind) == {"all_gather", "ring"}
    # (tp 1 | tp 2 without and with sequence parallelism) x pp, cp 2 and 4 x 2 kinds x pp, and with and
    # without sequence parallelism tp 2 x cp 2 x 2 kinds x pp, tp 2 x cp 4 x 2 kinds at pp 1 (at pp 2 it is
    # 16 GPUs wide): x recompute x ZeRO
    assert len(frame) == (3 * 2 + 2 * 2 * 2 + 2 * (2 * 2 + 2)) * 2 * 3
    assert sorted(set(zip(frame[(frame.tp > 1) & (frame.cp > 1)].tp, frame[(frame.tp > 1) & (frame.cp > 1)].cp))) == \
        [(2, 2), (2, 4)]
    excluded = frame.attrs["excluded"]
    assert sorted(set(zip(excluded.tp, excluded.cp, excluded.pp))) == [(2, 4, 2)]
    assert excluded.reason.str.contains("does not divide the 8 GPUs").all()
    cfg = config_of(frame[(frame.cp == 4) & (frame.pp == 2)].iloc[0], TARGET.ngpus, frame.attrs["stack"])
    assert cfg.plan_ngpus == 8 and cfg.pipeline_nstages == 2
    assert cfg.pas_config["context_parallel"] == 4
    cfg = config_of(frame[(frame.cp == 2) & (frame.tp == 2) & (frame.pp == 2)].iloc[0], TARGET.ngpus,
                    frame.attrs["stack"])
    assert cfg.plan_ngpus == 8 and cfg.pas_config["context_parallel"] == 2


def test_the_default_sweep_has_no_context_or_expert_parallelism(frame):
    assert (frame.cp == 1).all() and (frame.context_parallel_kind == "all_gather").all() and (frame.ep == 1).all()
    cfg = config_of(frame.iloc[0], TARGET.ngpus, frame.attrs["stack"])
    assert "context_parallel" not in cfg.pas_config and "expert_parallel" not in cfg.pas_config


def test_a_cp_the_sequence_does_not_cut_into_is_left_out_with_its_reason():
    idx = torch.zeros(1, 40, dtype=torch.long)
    frame = nbscaler.sweep(GPT(GPT_CFG), {"batch": {"idx": idx, "targets": idx}}, TARGET, global_batch=GLOBAL_BATCH,
                           tp=(1,), cp=(2, 8), pp=(1,), micro_batch=(1,), recompute=("none",), zero_stage=(0,),
                           progress=False)
    assert list(frame.cp) == [2]
    assert "cp=8 cuts the sequence into 2 x 8 = 16 chunks, but it has 40 tokens" in frame.attrs["excluded"].reason.iloc[0]


@pytest.mark.parametrize("ranges, message", [
    ({"cp": (3,)}, "do not divide the 8 GPUs"),
    ({"cp": (0,)}, "whole numbers >= 1"),
    ({"context_parallel_kind": ("ring", "all_to_all")}, "give some of 'all_gather', 'ring'"),
])
def test_a_cp_value_that_cannot_work_is_refused(ranges, message):
    with pytest.raises(ValueError, match=message):
        nbscaler.sweep(GPT(GPT_CFG), tokens(1), TARGET, global_batch=16, progress=False, **ranges)


@pytest.mark.parametrize("cp, pp, kind, recompute, zero_stage", [
    (2, 1, "all_gather", "none", 0),     # the sequence over 2 devices, 4 units
    (2, 2, "ring", "full", 2),           # the ring in a pipeline, layers recomputed, ZeRO 2 over 2 units
    (4, 2, "ring", "none", 0),           # one unit of 2 stages, each over 4 devices across 2 nodes
    (4, 1, "all_gather", "full", 2),
    (2, 2, "ring", "none", 3),           # ZeRO 3: each layer gathered over the 2 units
    (4, 1, "all_gather", "full", 3),
])
def test_a_cp_row_is_the_full_plans_prediction(cp_frame, cp, pp, kind, recompute, zero_stage):
    frame = cp_frame
    row = frame[(frame.cp == cp) & (frame.pp == pp) & (frame.context_parallel_kind == kind) & (frame.tp == 1)
                & (frame.recompute == recompute) & (frame.zero_stage == zero_stage)].iloc[0]
    assert row.tp == 1 and row.tp_comm_share > 0          # the context group's collectives are its own
    expected = full_plan_figures(GPT(GPT_CFG), tokens(1), row, frame.attrs["stack"])
    for column, value in expected.items():
        assert row[column] == pytest.approx(value, rel=1e-9), column


@pytest.mark.parametrize("cp, pp, kind, recompute, zero_stage", [
    (2, 2, "ring", "full", 2),           # 2 units of 2 stages, each stage 2 context-parallel pairs of tp 2
    (2, 1, "all_gather", "none", 3),     # ZeRO 3 over each slice's holders: 2 units x 2 cp places
    (4, 1, "ring", "none", 0),           # one unit: 4 context-parallel groups of 2, over 2 nodes
])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_a_tp_x_cp_row_is_the_full_plans_prediction(cp_frame, cp, pp, kind, recompute, zero_stage, sequence_parallel):
    frame = cp_frame
    row = frame[(frame.cp == cp) & (frame.pp == pp) & (frame.context_parallel_kind == kind) & (frame.tp == 2)
                & (frame.recompute == recompute) & (frame.zero_stage == zero_stage)
                & (frame.sequence_parallel == sequence_parallel)].iloc[0]
    expected = full_plan_figures(GPT(GPT_CFG), tokens(1), row, frame.attrs["stack"])
    for column, value in expected.items():
        assert row[column] == pytest.approx(value, rel=1e-9), column


@pytest.mark.slow       # a Llama sweep and its full plan: seconds
@pytest.mark.parametrize("kind, zero_stage", [
    ("all_gather", 1),
    # ZeRO 3: what the second stage's first layer adds (its rotary tables received) is timed where
    # each of its ops runs among the layer's gathers, as the full plan's script has it
    ("all_gather", 3)])
def test_a_llama_cp_row_with_rotary_tables_and_an_attention_written_out_is_the_full_plans_prediction(kind, zero_stage):
    """Llama's attention is written out (products, a mask, a softmax): its keys and values are
    all-gathered where the products read them, its rotary tables sliced to each device's chunks."""
    cfg = LlamaConfig(vocab_size=512, seq_len=SEQ, n_layer=5, d_model=128, n_head=4, n_kv_head=2)
    idx = torch.zeros(1, SEQ, dtype=torch.long)
    # targets of their own: a tensor passed as both would be chunked once in the copy (for the
    # embedding) but again for the loss in a later stage of the full plan, which the copy cannot see
    args = {"idx": idx, "targets": idx.clone()}
    frame = nbscaler.sweep(Llama(cfg), args, TARGET, global_batch=8, tp=(1,), cp=(2,),
                           pp=(2,), micro_batch=(1,), recompute=("full",), zero_stage=(zero_stage,),
                           context_parallel_kind=(kind,), progress=False)
    row = frame.iloc[0]
    assert row.cp == 2 and row.dp == 2
    expected = full_plan_figures(Llama(cfg), args, row, frame.attrs["stack"])
    for column, value in expected.items():
        assert row[column] == pytest.approx(value, rel=1e-9), column


H100_SMALL = dataclasses.replace(Hardware.named("H100-SXM-80GB", nodes=4), name="small H100", gpus_per_node=2,
                                 memory_bytes=6e6, intra_node_bytes_per_s=5e9, inter_node_bytes_per_s=1e9)


@pytest.mark.parametrize("float8, compiled", [("tensorwise", True), ("rowwise", False), ("none", True)])
def test_an_fp8_or_compiled_row_is_the_full_plans_prediction_with_that_recipe_and_software(float8, compiled):
    frame = nbscaler.sweep(GPT(GPT_CFG), tokens(1), H100_SMALL, global_batch=GLOBAL_BATCH, tp=(2,), pp=(2,),
                           micro_batch=(1,), recompute=("full",), zero_stage=(1,), float8=("none", float8),
                           compiled=(False, compiled), progress=False)
    row = frame[(frame.float8 == float8) & (frame.compiled == compiled)].iloc[0]
    cfg = config_of(row, H100_SMALL.ngpus, frame.attrs["stack"])
    plan = nbscaler.plan(GPT(GPT_CFG), tokens(1), "hybrid", cfg, module_dtype=torch.bfloat16)
    recipe = nbscaler.Recipe(torch.optim.AdamW, master_dtype=torch.float32, float8=None if float8 == "none" else float8)
    target = H100_SMALL.running(Software(compiled=compiled, compiled_modules=(frame.attrs["stack"],) if compiled else ()))
    step = plan.step_figures(recipe=recipe, hardware=target)
    assert row.step_time_s == pytest.approx(step.step_time_s, rel=1e-9)
    assert row.peak_bytes == pytest.approx(step.peak_bytes, rel=1e-12)
    pairs = {(f, c) for f in ("none", float8) for c in (False, compiled)}
    assert frame.groupby(["float8", "compiled"]).size().to_dict() == {p: 2 for p in pairs}   # sequence parallel or not


def test_fp8_rows_need_a_target_with_fp8_units_and_the_defaults_are_the_recipes_and_softwares():
    with pytest.raises(ValueError, match=r"float8=\('tensorwise',\).*no fp8 tensor cores"):
        nbscaler.sweep(GPT(GPT_CFG), tokens(1), TARGET, global_batch=GLOBAL_BATCH, tp=(2,), pp=(2,),
                       micro_batch=(1,), float8=("tensorwise",), progress=False)
    with pytest.raises(ValueError, match=r"float8=\('fp4',\): give some of 'none', 'tensorwise', 'rowwise'"):
        nbscaler.sweep(GPT(GPT_CFG), tokens(1), H100_SMALL, global_batch=GLOBAL_BATCH, float8=("fp4",), progress=False)
    frame = nbscaler.sweep(GPT(GPT_CFG), tokens(1), H100_SMALL.running(Software(compiled=True, compiled_modules="blocks")),
                           global_batch=GLOBAL_BATCH, tp=(2,), pp=(2,), micro_batch=(1,), zero_stage=(1,),
                           recompute=("full",), recipe=nbscaler.Recipe(float8="rowwise"), progress=False)
    assert set(frame.float8) == {"rowwise"} and set(frame.compiled) == {True}
    with pytest.raises(ValueError, match=r"compiles the whole model; a sweep compiles each layer of blocks"):
        nbscaler.sweep(GPT(GPT_CFG), tokens(1), H100_SMALL.running(Software(compiled=True)),
                       global_batch=GLOBAL_BATCH, tp=(2,), pp=(2,), progress=False)
