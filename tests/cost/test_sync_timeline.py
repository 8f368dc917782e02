"""The data-parallel gradient synchronisation on the timeline (``cost.timing.sync_spans``): each
bucket where the step's figures price it, its exposed part the step's ``sync_s``."""

import pytest

import nbscaler
from nbscaler import ComputeConfig, Hardware, Recipe, Software
from nbscaler.cost.timing import exposed_sync, sync_buckets, sync_spans
from nbscaler.models.gpt import GPT, GPTConfig, sample_batch

MODEL = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=64)
H100 = Hardware.named("H100-SXM-80GB")
BUCKET = 8 * 2**10                   # 15 buckets of this GPT's fp32 gradients


def dp_plan(policy="dp", **config):
    return nbscaler.plan(GPT(MODEL), {"batch": sample_batch(MODEL, 2)}, policy,
                         ComputeConfig(1, 2, reduce_bucket_bytes=BUCKET, **config))


@pytest.fixture(scope="module")
def plain():
    return dp_plan()


@pytest.fixture(scope="module")
def zero2():
    return dp_plan(use_zero=True, zero_stage=2)


def synced(line, rank=0):
    return [c for c in line.collectives if c.sync and c.rank == rank]


# -- the rule ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("times, overlap", [
    ([(1.0, 0.0), (2.0, 0.0), (3.0, 0.0)], 10.0),      # the others fit in the window
    ([(1.0, 0.0), (2.0, 0.0), (3.0, 0.0)], 4.0),       # 1 s of them does not
    ([(1.0, 0.0), (2.0, 0.0), (3.0, 0.0)], None),      # nothing overlaps
    ([(1.0, 0.5), (2.0, 0.25)], 1.0),                  # ZeRO: all-gathers after the step
    ([(1.0, 0.0)], 5.0),                               # one bucket: all of it exposed
])
def test_the_spans_wait_what_exposed_sync_prices(times, overlap):
    end, update = 20.0, 3.0
    spans = sync_spans(times, overlap, end, update)
    assert sum(s.waited_s for s in spans) == pytest.approx(exposed_sync(times, overlap))
    during = [s for s in spans if s.part == "during"]
    assert [s.index for s in during] == list(reversed(range(len(times))))    # the last parameters' first
    assert all(a.t_end == pytest.approx(b.t_start) or a.t_end < b.t_start for a, b in zip(during, during[1:]))
    first = during[-1]
    assert first.t_start >= end and first.waited_s == pytest.approx(first.t_end - first.t_start)
    start = end if overlap is None or len(times) == 1 else end - overlap
    assert during[0].t_start == start
    for s in spans:
        assert s.t_end - s.t_start == pytest.approx(times[s.index][0 if s.part == "during" else 1])
        assert s.waited_s == pytest.approx(max(0.0, s.t_end - max(s.t_start, end)))
    after = [s for s in spans if s.part == "after"]
    if after:                                          # the all-gathers follow the optimizer step
        assert after[0].t_start == pytest.approx(end + sum(s.waited_s for s in during) + update)
        assert after[-1].t_end == pytest.approx(end + exposed_sync(times, overlap) + update)


# -- on a plan ----------------------------------------------------------------------------------------
def test_on_an_h100_the_buckets_hide_in_the_backward_but_the_first(plain):
    line = plain.timeline(hardware=H100)
    figures = plain.step_figures(hardware=H100)
    model = plain.step_model(H100)
    times = sync_buckets(plain.placed, 0, model.comm, Recipe())
    for rank in (0, 1):
        calls = synced(line, rank)
        backward = max((b for b in line.blocks if b.rank == rank), key=lambda b: b.t_end)
        assert [c.unit for c in calls] == [f"bucket {i}" for i in reversed(range(len(times)))] and len(times) == 15
        assert {c.kind for c in calls} == {"all_reduce"} and {(c.phase, c.micro) for c in calls} == {("B", 0)}
        assert [c.duration for c in calls] == pytest.approx([d for d, _ in reversed(times)])
        assert sum(c.waited_s for c in calls) == pytest.approx(figures.devices[0].sync_s)
        *hidden, first = calls
        assert backward.t_start <= hidden[0].t_start and hidden[-1].t_end <= backward.t_end    # they fit
        assert all(c.waited_s == 0 for c in hidden)
        assert first.t_start == backward.t_end and first.waited_s == pytest.approx(times[0][0])
    # the blocks are what they were: the makespan and the step do not move
    assert line.makespan == pytest.approx(figures.devices[0].compute_s)
    assert max(c.t_end for c in synced(line)) == pytest.approx(figures.devices[0].compute_s + figures.devices[0].sync_s)


def test_software_that_waits_for_the_backward_exposes_every_bucket(plain):
    hw = H100.running(Software(overlap_grad_reduce=False))
    line = plain.timeline(hardware=hw)
    device = plain.step_figures(hardware=hw).devices[0]
    calls = synced(line)
    assert calls[0].t_start == pytest.approx(line.makespan)
    assert all(c.waited_s == pytest.approx(c.duration) for c in calls)
    assert calls[-1].t_end == pytest.approx(line.makespan + device.sync_s)


def test_zero2_reduce_scatters_in_the_backward_and_gathers_after_the_optimizer_step(zero2):
    line = zero2.timeline(hardware=H100)
    figures = zero2.step_figures(hardware=H100)
    device = figures.devices[0]
    calls = synced(line)
    kinds = [c.kind for c in calls]
    assert kinds == ["reduce_scatter"] * 15 + ["all_gather"] * 15
    gathers = calls[15:]
    assert [c.unit for c in gathers] == [f"bucket {i}" for i in range(15)]          # in parameter order
    assert gathers[0].t_start - calls[14].t_end == pytest.approx(device.update_s)    # the optimizer step between
    assert sum(c.waited_s for c in calls) == pytest.approx(device.sync_s)
    assert gathers[-1].t_end == pytest.approx(figures.step_time_s)                  # the step ends with them


def test_accumulated_micro_batches_reduce_in_the_last_backward_only():
    plan = dp_plan("hybrid", use_end2end=True, use_pipeline=True, pipeline_nstages=1, pipeline_nmicros=3)
    line = plan.timeline(hardware=H100)
    calls = synced(line)
    last = max((b for b in line.blocks if b.rank == 0), key=lambda b: b.t_end)
    assert last.micro == 2 and {(c.phase, c.micro) for c in calls} == {("B", 2)}
    assert min(c.t_start for c in calls) >= last.t_start
    assert sum(c.waited_s for c in calls) == pytest.approx(plan.step_figures(hardware=H100).devices[0].sync_s)


@pytest.mark.slow
def test_here_every_bucket_follows_the_backward(plain):
    line = plain.timeline()
    device = plain.step_figures().devices[0]
    calls = synced(line)
    assert calls[0].t_start == pytest.approx(line.makespan) and all(c.waited_s == c.duration for c in calls)
    assert sum(c.waited_s for c in calls) == pytest.approx(device.sync_s)


def test_one_unit_synchronises_nothing():
    plan = nbscaler.plan(GPT(MODEL), {"batch": sample_batch(MODEL, 2)}, "dp", ComputeConfig(1, 1))
    assert synced(plan.timeline(hardware=H100)) == []


def test_a_pipelines_ranks_synchronise_after_the_makespan_their_step_counts():
    """Each stage's units sum their own buckets; the step counts the pipeline's makespan, so the
    exposed part of every rank's synchronisation follows it."""
    cfg = ComputeConfig(2, 4, use_end2end=True, use_pipeline=True, pipeline_nstages=2, pipeline_nmicros=4,
                        pipeline_scheduler="1f1b", reduce_bucket_bytes=BUCKET)
    plan = nbscaler.plan(GPT(MODEL), {"batch": sample_batch(MODEL, 2)}, "pp", cfg)
    line = plan.timeline(hardware=H100)
    figures = plan.step_figures(hardware=H100)
    for rank in range(4):
        calls = synced(line, rank)
        device = figures.devices[plan.config.device_of(rank)]
        assert calls and sum(c.waited_s for c in calls) == pytest.approx(device.sync_s)
        assert calls[-1].unit == "bucket 0" and calls[-1].t_start >= line.makespan - 1e-15
        assert calls[-1].t_end == pytest.approx(line.makespan + device.sync_s)
    assert plan.timeline(hardware=H100).makespan == pytest.approx(figures.pipeline.makespan_s)


def test_buckets_of_no_seconds_are_not_drawn():
    """One unit sums with nobody: its buckets cost nothing, on a target and here alike."""
    assert sync_spans([(0.0, 0.0)] * 3, 1.0, 5.0, 1.0) == sync_spans([(0.0, 0.0)] * 3, None, 5.0, 1.0) == []


def test_partial_gradients_summed_inside_the_unit_are_buckets_of_their_own():
    """Sequence parallelism leaves the norms' gradients partial over the unit's 2 devices: they are
    summed there first (``partial i``), all-reduces as the others, and the step waits what the rest do."""
    plan = nbscaler.plan(GPT(MODEL), {"batch": sample_batch(MODEL, 2)}, "tp",
                         ComputeConfig(2, 4, reduce_bucket_bytes=BUCKET, pas_config={"sequence_parallel": True}))
    line = plan.timeline(hardware=H100)
    figures = plan.step_figures(hardware=H100)
    calls = synced(line)
    partial = [c for c in calls if c.unit.startswith("partial")]
    assert partial and {c.kind for c in partial} == {"all_reduce"}
    assert any(c.unit == "bucket 0" for c in calls) and calls[-1].unit == "partial 0"     # exposed_sync's first
    assert sum(c.waited_s for c in calls) == pytest.approx(figures.devices[0].sync_s)


def test_partial_sums_of_tp_inside_cp_run_over_each_slices_holders_on_the_link_they_span():
    """tp 2 inside cp 2: device 1 sums its slices' gradients with device 3, its counterpart in the
    other pair (``partial_ranks``), not with its neighbour. On nodes of 2 GPUs that pair of devices
    spans 2 nodes, so the sum is priced on the network and takes longer than on one node of 8."""
    from nbscaler.cost.timing import partial_ranks, partials_of
    plan = nbscaler.plan(GPT(MODEL), {"batch": sample_batch(MODEL, 1)}, "tp",
                         ComputeConfig(4, 4, reduce_bucket_bytes=BUCKET, pas_config={"context_parallel": 2}))
    params = [w for w in plan.programs.weights(1) if w.kind == "param"]
    assert partials_of(params) == [(2, 2)]
    assert list(partial_ranks(1, (2, 2))) == [1, 3] and list(partial_ranks(2, (2, 2))) == [0, 2]
    assert list(partial_ranks(5, (4, 1))) == [4, 5, 6, 7]             # neighbours, as sequence parallelism sums
    spans = {}
    for name, hw in (("one node", Hardware.named("H100-SXM-80GB")),
                     ("two a node", Hardware.resolve("H100-SXM-80GB", nodes=2, gpus_per_node=2))):
        spans[name] = [c.t_end - c.t_start for c in synced(plan.timeline(hardware=hw), rank=1)
                       if c.unit.startswith("partial")]
    assert len(spans["one node"]) == len(spans["two a node"]) > 0
    assert all(far > 2 * near for near, far in zip(spans["one node"], spans["two a node"]))
