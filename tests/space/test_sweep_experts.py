"""Expert parallelism (``ep``) as a dimension of ``nbscaler.sweep`` and ``PlanSpace``: each row's
experts split over its stage's devices, priced as the full plan of its configuration predicts,
and a combination the policy refuses left out with the policy's reason."""

import pytest
import torch

import nbscaler
from nbscaler import ComputeConfig, Hardware
from nbscaler.models.llama import Llama, LlamaConfig
from nbscaler.models.moe import MoEConfig, MoELlama
from nbscaler.planning.stack import one_sequence
from nbscaler.space.autodist import runners_up
from nbscaler.space.plan_space import PlanSpace
from nbscaler.space.sweep import config_of
from tests.space.test_sweep import SEQ, TARGET, full_plan_figures

MOE_CFG = MoEConfig(vocab_size=512, seq_len=SEQ, n_layer=4, d_model=128, n_head=4, n_kv_head=2, n_experts=4,
                    top_k=2, expert_hidden=128)
GLOBAL_BATCH = 16
MICRO = 4          # sequences per micro-batch: a multiple of every ep tried, so each device gets its share


def args():
    idx = torch.zeros(1, SEQ, dtype=torch.long)
    return {"idx": idx, "targets": idx.clone()}


def moe_sweep(target=TARGET, **ranges):
    ranges = {"tp": (1,), "pp": (1,), "micro_batch": (MICRO,), "recompute": ("none",), "zero_stage": (1,), **ranges}
    return nbscaler.sweep(MoELlama(MOE_CFG), args(), target, global_batch=GLOBAL_BATCH, progress=False, **ranges)


@pytest.fixture(scope="module")
def ep_frame():
    return moe_sweep(tp=(1, 2), ep=(1, 2, 4), pp=(1, 2), recompute=("none", "full"), zero_stage=(1, 3))


def test_ep_is_a_dimension_of_the_sweep_and_never_shares_a_stage_with_tp(ep_frame):
    frame = ep_frame
    assert set(frame.ep) == {1, 2, 4}
    assert (frame.tp * frame.cp * frame.ep * frame.pp * frame.dp == TARGET.ngpus).all()
    assert (frame.micro_batch * frame.micro_batches * frame.dp == GLOBAL_BATCH).all()
    experts = frame[frame.ep > 1]
    assert (experts.tp == 1).all() and not experts.sequence_parallel.any()
    # (tp 1 x ep 1, 2, 4 | tp 2 without and with sequence parallelism) x pp x recompute x ZeRO, less
    # tp 1 x ep 1 x pp 1 (x recompute x ZeRO): dp 8 of micro-batches of 4 is more than the batch of 16
    assert len(frame) == (3 + 2) * 2 * 2 * 2 - 2 * 2
    excluded = frame.attrs["excluded"]
    # tp 2 beside ep 2: the policy's words, for each sequence parallelism; tp 2 x ep 4 x pp 2 is 16 GPUs
    beside = excluded[(excluded.tp == 2) & (excluded.ep == 2)]
    assert set(beside.sequence_parallel) == {False, True}
    without = beside[~beside.sequence_parallel]
    assert without.reason.str.contains("expert_parallel=2, but each stage has 4 devices").all()
    assert beside[beside.sequence_parallel].reason.str.contains("'expert_parallel' and 'sequence_parallel'").all()
    assert excluded[(excluded.ep == 4) & (excluded.pp == 2) & (excluded.tp == 2)].reason.str.contains(
        "tp x ep x pp = 16 does not divide the 8 GPUs").all()
    row = experts[(experts.ep == 4) & (experts.pp == 2)].iloc[0]
    cfg = config_of(row, TARGET.ngpus, frame.attrs["stack"])
    assert cfg.plan_ngpus == 8 and cfg.pipeline_nstages == 2 and cfg.pas_config["expert_parallel"] == 4


def test_the_experts_all_to_alls_are_priced_in_the_stage_groups_collectives(ep_frame):
    frame = ep_frame[ep_frame.tp == 1]
    assert (frame[frame.ep == 1].tp_comm_share == 0).all()
    assert (frame[frame.ep > 1].tp_comm_share > 0).all()


@pytest.mark.parametrize("ep, pp, recompute, zero_stage", [
    (2, 1, "none", 1),       # the experts over 2 devices of a node, 4 units
    (4, 1, "full", 1),       # over 4 devices across 2 nodes, layers recomputed
    (4, 2, "none", 1),       # one unit of 2 stages, each over 4 devices
    (4, 1, "none", 3),       # ZeRO 3: each layer gathered over the 2 units
    (4, 2, "full", 3),       # ZeRO 3 over one unit in a pipeline
    # ZeRO 3 over 2 units in a pipeline: what the second stage's first layer adds is timed where
    # each of its ops runs among the layer's gathers and reduce-scatters
    (2, 2, "none", 3),
    (2, 2, "full", 3),
])
def test_an_ep_row_is_the_full_plans_prediction(ep_frame, ep, pp, recompute, zero_stage):
    frame = ep_frame
    row = frame[(frame.ep == ep) & (frame.pp == pp) & (frame.recompute == recompute)
                & (frame.zero_stage == zero_stage)].iloc[0]
    expected = full_plan_figures(MoELlama(MOE_CFG), one_sequence(args(), MICRO), row, frame.attrs["stack"])
    for column, value in expected.items():
        assert row[column] == pytest.approx(value, rel=1e-9), column


def test_the_all_to_alls_cost_more_when_the_expert_group_spans_nodes():
    """On one node of 8 H100s an expert group of 4 talks over NVLink; with 2 GPUs a node it spans
    two nodes' network. The group of 2 stays inside a node either way, and costs the same."""
    space = PlanSpace(MoELlama(MOE_CFG), args(), Hardware.named("H100-SXM-80GB"), global_batch=GLOBAL_BATCH,
                      tp=(1,), pp=(1,), ep=(2, 4), micro_batch=(MICRO,), recompute=("none",), zero_stage=(1,),
                      settle=False)

    def exchange_seconds(frame):
        return {int(r.ep): r.tp_comm_share * r.step_time_s for _, r in frame.iterrows()}
    inside = exchange_seconds(space.frame)
    across = exchange_seconds(space.set(nodes=4, gpus_per_node=2))
    assert across[2] == pytest.approx(inside[2], rel=1e-9)
    assert across[4] > 2 * inside[4]


@pytest.mark.parametrize("module, ranges, words", [
    (Llama(LlamaConfig(vocab_size=512, seq_len=SEQ, n_layer=4, d_model=128, n_head=4, n_kv_head=2)), {},
     "the model calls none"),
    (MoELlama(MOE_CFG), {"ep": (1, 8), "micro_batch": (8,)}, "has 4 experts, which do not split over 8 expert groups"),
    (MoELlama(MOE_CFG), {"micro_batch": (1,)}, "no input's first dimension divides by 2 (batch size 1)"),
    (MoELlama(MOE_CFG), {"cp": (1, 2)}, "'expert_parallel' and 'context_parallel'"),
])
def test_a_combination_the_policy_refuses_is_left_out_with_its_reason(module, ranges, words):
    ranges = {"ep": (1, 2), "micro_batch": (MICRO,), **ranges}
    # a batch of 64: dp 8 x micro-batches of up to 8, so every row at ep 1 runs
    frame = nbscaler.sweep(module, args(), TARGET, global_batch=64, progress=False, tp=(1,), pp=(1,),
                           recompute=("none",), zero_stage=(1,), **ranges)
    refused = frame.attrs["excluded"]
    assert (frame[frame.ep > 1].cp == 1).all() and (refused.ep > 1).all()
    assert len(refused) >= 1 and refused.reason.str.contains(words, regex=False).all()


@pytest.mark.parametrize("ranges, message", [
    ({"ep": (3,)}, "sweep's ep values [3] do not divide the 8 GPUs"),
    ({"ep": (0,)}, "sweep's ep=[0]: give whole numbers >= 1"),
])
def test_an_ep_value_that_cannot_work_is_refused(ranges, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        moe_sweep(**ranges)


@pytest.mark.slow       # a sweep over ep and the chosen plan placed whole: seconds
def test_autodist_searches_expert_parallelism_when_its_space_asks_and_explain_names_the_ep_chosen():
    space = {"tp": (1,), "pp": (1, 2), "micro_batch": (MICRO,), "ep": (2, 4), "zero_stage": (1,),
             "recompute": ("none", "full")}
    cfg = ComputeConfig(8, 8, pas_config={"hardware": TARGET, "global_batch": GLOBAL_BATCH, "autodist_space": space})
    chosen = nbscaler.plan(MoELlama(MOE_CFG), args(), "autodist", cfg, module_dtype=torch.bfloat16)
    frame = moe_sweep(**space)
    best = frame[frame.fits].iloc[0]
    claimed = chosen.graph.meta["autodist"]["target"]["chosen"]
    assert best.ep > 1 and claimed["ep"] == best.ep and claimed["step_time_s"] == best.step_time_s
    assert chosen.config.pas_config["expert_parallel"] == best.ep
    assert chosen.config.plan_ngpus == best.ep * best.pp
    text = str(chosen.explain())
    assert f"chose tp 1 x ep {best.ep} x pp {best.pp} x dp {best.dp}" in text
    # each ep x pp layout's fastest fitting row is a runner-up (the pruned search's: those within 1.25 x)
    others = runners_up(frame, best)
    assert set(zip(others.ep, others.pp)) == set(zip(frame.ep, frame.pp)) - {(best.ep, best.pp)}
    s = chosen.summary(torch.optim.AdamW, hardware=TARGET, master_dtype=torch.float32)
    assert s.step_time_s.max() == pytest.approx(best.step_time_s, rel=1e-9)
