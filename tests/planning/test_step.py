"""plan.summary(hardware=...) and plan.timeline(hardware=...): a GPT's step on a target, from the formulas."""

import dataclasses

import pytest
import torch

import nbscaler
from nbscaler.cost.roofline import masked_flops
from nbscaler.cost.software import Software
from nbscaler.planning.step import flops_per_device
from nbscaler import ComputeConfig, Hardware
from nbscaler.columns import PREDICTED_COLUMNS, TARGET_COLUMNS, SummaryColumn as C
from nbscaler.cost import timing
from nbscaler.cost.nccl import NcclModel
from nbscaler.cost.profile import OpProfiler
from nbscaler.cost.roofline import RooflineOps
from nbscaler.recipe import Recipe
from nbscaler.models.gpt import GPT, GPTConfig, sample_batch

GPT_CFG = GPTConfig(vocab_size=1024, seq_len=256, n_layer=4, d_model=512, n_head=8)
BATCH, MICROS = 4, 4
H100 = Hardware.named("H100-SXM-80GB")


def hybrid(units=2, **pas):
    """tp 2 x pp 2 in each unit, ``units`` data-parallel units."""
    return ComputeConfig(4, 4 * units, use_end2end=True, use_pipeline=True, pipeline_nmicros=MICROS,
                         pipeline_scheduler="1f1b", pipeline_nstages=2, pas_config=pas)


PLAN = dict(policy="hybrid", config=hybrid(), model=GPT_CFG, batch=BATCH, module_dtype=torch.bfloat16)


@pytest.fixture
def no_profiling(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("an op was profiled on this machine")
    monkeypatch.setattr(OpProfiler, "profile", refuse)
    monkeypatch.setattr(OpProfiler, "time", refuse)
    monkeypatch.setattr(OpProfiler, "update", refuse)


def test_the_summary_on_a_target_adds_its_columns_and_profiles_nothing(plan, no_profiling):
    s = plan.summary(torch.optim.AdamW, hardware=H100)
    assert list(s.columns) == [str(c) for c in PREDICTED_COLUMNS + TARGET_COLUMNS]
    step = s.step_time_s
    assert (s.mfu == s.flops / (step * 989.4e12)).all()
    # nothing recomputed: the kernels perform the model's FLOPs less the pairs causal flash skips
    masked = flops_per_device(plan, lambda n, phase: masked_flops(
        n.meta, n.meta["local_flops_fwd" if phase == "F" else "local_flops_bwd"]))
    assert 0 < masked[0] < s.flops.iloc[0] / 10
    assert s.hardware_flops.tolist() == pytest.approx([f - masked[plan.config.device_of(r)]
                                                       for f, r in zip(s.flops, s["rank"])], rel=1e-12)
    assert (s.hfu == s.hardware_flops / (step * 989.4e12)).all()
    assert (s.device_memory_bytes == 80e9).all() and s.fits.all()
    tokens = BATCH * GPT_CFG.seq_len * MICROS * 2                                # micro-batches x 2 units
    assert (s.tokens_per_s == tokens / step.max()).all()
    tiny = dataclasses.replace(H100, memory_bytes=float(s.peak_bytes.min()))
    assert not plan.summary(torch.optim.AdamW, hardware=tiny).fits.all()


def test_a_stage_block_is_its_ops_roofline_and_its_collectives_nccl_cost(plan, no_profiling):
    ops, nccl = RooflineOps(H100), NcclModel(H100)
    line = plan.timeline(hardware=H100)
    for device, stage in ((0, 0), (2, 1)):
        run = plan.local_runs[device][stage]
        forward = sum(ops.time(op)[0] for op in run.ops)
        forward += sum(nccl.forward(c.fn, c.in_bytes, len(c.devices), ranks=c.devices) for c in run.collectives)
        block = next(b for b in line.blocks if b.rank == device and b.phase == "F" and b.micro == 0)
        assert block.t_end - block.t_start == pytest.approx(forward, rel=1e-12)
    assert plan.summary(hardware=H100).step_time_s.min() > line.makespan


def test_recomputation_counts_in_hfu_not_in_mfu(no_profiling):
    p = nbscaler.plan(GPT(GPT_CFG), {"batch": sample_batch(GPT_CFG, BATCH)}, "hybrid",
                      hybrid(recompute_modules=["blocks"]), module_dtype=torch.bfloat16)
    s = p.summary(hardware=H100.running(Software(attention="materialized")))    # every pair computed
    again = s.hardware_flops - s.flops
    assert (again > 0).all() and (s.hfu > s.mfu).all()
    forward_blocks = sum(n.meta["local_flops_fwd"] for n in p.graph.nodes
                         if n.module_path and n.module_path.startswith("blocks") and 0 in n.placement.devices)
    assert again[0] == pytest.approx(MICROS * forward_blocks, rel=1e-9)    # each micro-batch's forward again


def test_where_the_groups_sit_changes_the_step_as_the_physics_says(plan, no_profiling):
    """8 GPUs to a node: everything on NVLink. 2 to a node: tp stays inside, pp and dp cross the
    network. 1 to a node: the tp group crosses it too, on every layer."""
    step = {n: plan.summary(hardware=dataclasses.replace(H100, gpus_per_node=n, nodes=8 // n)).step_time_s.max()
            for n in (8, 2, 1)}
    assert step[8] < step[2] < step[1]


def test_more_nodes_put_the_data_parallel_all_reduce_on_the_network(no_profiling):
    p = nbscaler.plan(GPT(GPT_CFG), {"batch": sample_batch(GPT_CFG, BATCH)}, "hybrid", hybrid(units=4),
                      module_dtype=torch.bfloat16)
    one_node = p.summary(hardware=dataclasses.replace(H100, gpus_per_node=16)).step_time_s
    two_nodes = p.summary(hardware=Hardware.named("H100-SXM-80GB", nodes=2)).step_time_s
    assert (two_nodes > one_node).all()
    with pytest.raises(ValueError, match="16 ranks but H100-SXM-80GB has 8 GPUs.*nodes=2"):
        p.summary(hardware=H100)


def test_the_data_parallel_reduction_overlaps_the_backward_but_its_first_bucket(plan, monkeypatch):
    from nbscaler.cost import timing
    args = (plan.placed, 0, NcclModel(H100), Recipe(master_dtype=None))
    (alone,) = timing.sync_buckets(*args)                 # one bucket: nothing to overlap it with
    assert alone[0] > 0 and timing.sync_time(*args, overlap_s=1.0) == timing.sync_time(*args) == alone[0]
    # buckets in parameter order: the first holds the first layers, whose gradients come last
    monkeypatch.setattr(timing, "sync_buckets", lambda *a: [(3.0, 0.5), (2.0, 0.0), (4.0, 0.0)])
    assert timing.sync_time(*args) == 9.5                                  # on a CPU: all of it, after
    assert timing.sync_time(*args, overlap_s=10.0) == 3.0 + 0.5            # hidden but the last ready, and after
    assert timing.sync_time(*args, overlap_s=5.0) == 3.0 + 1.0 + 0.5       # 6 s to hide in 5


@pytest.mark.slow                      # profiles the GPT's ops on this CPU and measures its peak
def test_this_machine_is_priced_by_its_profile_against_its_measured_peak():
    tiny = GPTConfig(vocab_size=64, seq_len=16, n_layer=1, d_model=32, n_head=2)
    p = nbscaler.plan(GPT(tiny), {"batch": sample_batch(tiny, 2)}, "data", ComputeConfig(1, 1, use_end2end=True))
    here = Hardware.local()
    s = p.summary(hardware=here)
    assert list(s.columns) == [str(c) for c in PREDICTED_COLUMNS + TARGET_COLUMNS]
    assert (s.mfu == s.flops / (s.step_time_s * here.peak_flops(torch.float32))).all()
    assert (s.tokens_per_s == 2 * 16 / s.step_time_s).all()


def test_gradients_reduced_after_the_backward_in_fp32_cost_what_the_bytes_say(plan, no_profiling, monkeypatch):
    """Megatron-LM in 2021: the whole reduction after the backward; fp32 master copies double the
    bytes it sends over bf16 gradients, and the optimizer streams fp32 state."""
    from nbscaler.recipe import Recipe
    from nbscaler.cost import timing
    no_latency = dataclasses.replace(H100, intra_node_latency_s=0.0, inter_node_latency_s=0.0)
    args = (plan.placed, 0, NcclModel(no_latency))
    bf16 = timing.sync_time(*args, Recipe(master_dtype=None))
    assert bf16 > 0 and timing.sync_time(*args, Recipe(master_dtype=torch.float32)) == pytest.approx(2 * bf16)
    assert (plan.summary(torch.optim.Adam, hardware=H100, master_dtype=torch.float32).step_time_s
            > plan.summary(torch.optim.Adam, hardware=H100, master_dtype=None).step_time_s).all()
    waits = H100.running(Software(overlap_grad_reduce=False))
    monkeypatch.setattr(timing, "sync_buckets", lambda *a: [(1e-3, 0.0), (1e-5, 0.0)])
    overlapped, after = (plan.summary(hardware=hw).step_time_s for hw in (H100, waits))
    assert after.values == pytest.approx(overlapped.values + 1e-5, rel=1e-9)   # the second bucket is no longer hidden


def test_the_timeline_and_the_summary_on_one_target_share_one_step_model(no_profiling, monkeypatch):
    """Their section times are the slow part at size: made once per target, equal to a fresh model's."""
    fresh = nbscaler.plan(GPT(GPT_CFG), {"batch": sample_batch(GPT_CFG, BATCH)}, "hybrid", hybrid(),
                          module_dtype=torch.bfloat16)
    built = []
    real = timing.StepModel.__init__
    monkeypatch.setattr(timing.StepModel, "__init__", lambda self, *a, **k: built.append(1) or real(self, *a, **k))
    line, summary = fresh.timeline(hardware=H100), fresh.summary(torch.optim.Adam, hardware=H100, master_dtype=None)
    fresh.summary(torch.optim.SGD, hardware=dataclasses.replace(H100))       # an equal target: the same model
    assert len(built) == 1
    alone = timing.StepModel(fresh.placed, hardware=H100)
    assert line == alone.timeline(MICROS)
    steps = alone.step_times(MICROS, Recipe(torch.optim.Adam, master_dtype=None))
    assert list(summary[str(C.STEP_TIME_S)]) == list(steps[str(C.STEP_TIME_S)])
    fresh.summary(torch.optim.Adam, hardware=Hardware.named("A100-SXM-80GB"))
    assert len(built) == 3                                                     # another target, and `alone`
