"""ZeRO stage 3 in time (cost.fsdp): each unit's bytes are what the runtime moves, each collective is
priced on the ZeRO group's link, and a step waits for the first gather and the last reduce-scatter
where the compute hides the rest, for more where the link is slow."""

import pytest
import torch
import torch.distributed as dist

import nbscaler
from nbscaler import ComputeConfig, Hardware, Recipe
from nbscaler.cost.fsdp import (WEIGHT_SHARE, Gather, Release, Work, cold_forwards, play_backward, play_forward,
                                script_of, stage_plays, step_counts, unit_bytes, unit_seconds, UnitSeconds)
from nbscaler.cost.nccl import NcclModel
from nbscaler.cost.timing import bucket_seconds, reduced_buckets
from nbscaler.ir.graph import REST_UNIT
from nbscaler.layouts import Collective
from nbscaler.models.gpt import GPT, GPTConfig, sample_batch
from nbscaler.schedule import build_schedule

MODEL = GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16, vocab_size=61)
H100 = Hardware.named("H100-SXM-80GB")
MIXED = Recipe(torch.optim.AdamW, master_dtype=torch.float32)        # bf16 gathers, fp32 reduce-scatters


def zero3_plan(ranks: int = 4, **config):
    return nbscaler.plan(GPT(MODEL), {"batch": sample_batch(MODEL, 2)}, "dp",
                         ComputeConfig(1, ranks, use_zero=True, zero_stage=3, **config), module_dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def plan():
    return zero3_plan(3)            # a group of 3: the units' buckets need padding to a multiple of it


# -- bytes ---------------------------------------------------------------------------------------
class _Work:
    def wait(self):
        pass


def test_the_bytes_priced_per_unit_are_the_bytes_the_runtime_moves(plan, monkeypatch):
    """``ShardedUnits`` built on the plan's weights over a group of 3 (the process group faked):
    each unit's all-gather makes ``gather_bytes`` on each rank (3 shards in bf16) and its
    reduce-scatter reads ``reduce_bytes`` (the padded flat gradients in fp32)."""
    from nbscaler.runtime import fsdp, zero
    n = plan.config.runtime_ngpus
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: n)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    gathered, reduced = {}, {}
    current = []

    def all_gather(chunks, mine, group=None, async_op=False):
        gathered[current[0]] = gathered.get(current[0], 0) + n * mine.numel() * mine.element_size()
        return _Work()

    def reduce_scatter_into(out, flat, group):
        reduced[current[0]] = reduced.get(current[0], 0) + flat.numel() * flat.element_size()
    monkeypatch.setattr(fsdp.dist, "all_gather", all_gather)
    monkeypatch.setattr(zero, "reduce_scatter_into", reduce_scatter_into)
    program = plan.programs.device(0)
    shapes = {w.name: w for w in program.weights}
    params = {u: [torch.nn.Parameter(torch.zeros(shapes[name].shape, dtype=shapes[name].dtype)) for name in names]
              for u, names in program.units.items()}
    shards = fsdp.ShardedUnits(params, object(), object(), None)
    shards.set_precision(MIXED, masters=False)
    for unit, ps in params.items():
        current[:] = [unit]
        shards.unshard(unit)
        for p in ps:
            p.grad = torch.ones_like(p)
        for index in shards.unit_buckets[unit]:
            shards._reduce_bucket(index)
    unit_of = {name: u for u, names in program.units.items() for name in names}
    priced = unit_bytes(program.weights, unit_of.get, n, MIXED)
    assert set(priced) == set(gathered) == {REST_UNIT, "blocks.0", "blocks.1"}
    for unit, u in priced.items():
        assert u.gather_bytes == gathered[unit] and u.reduce_bytes == reduced[unit], unit
        assert u.reduce_bytes == 2 * u.gather_bytes          # fp32 gradients of bf16 parameters
    numel = sum(p.numel() for p in params[REST_UNIT])
    assert numel % n and priced[REST_UNIT].gather_bytes == -(-numel // n) * n * 2     # padded


def test_a_step_gathers_each_layer_twice_and_the_rest_once_and_reduces_each_once(plan):
    program = plan.programs.device(0)
    from nbscaler.cost.fsdp import section_units
    units = {sec.stage: section_units(sec) for sec in program.sections if sec.mode != "eval"}
    gathers, reduces = step_counts(units, None)
    assert gathers == {REST_UNIT: 1, "blocks.0": 2, "blocks.1": 2} and reduces == {u: 1 for u in gathers}
    kept = {s: (order, set()) for s, (order, _) in units.items()}      # zero_reshard_after_forward=False
    assert step_counts(kept, None, nsamples=2)[0] == {u: 2 for u in gathers}


# -- the link ------------------------------------------------------------------------------------
def test_a_group_inside_a_node_gathers_on_nvlink_and_one_across_nodes_on_the_network():
    hw = Hardware.named("H100-SXM-80GB", nodes=8)
    nccl = NcclModel(hw)
    units = {"layer": _unit("layer", 2 ** 28)}
    inside = unit_seconds(units, nccl, range(8), (0,))["layer"]
    across = unit_seconds(units, nccl, range(0, 64, 8), (0,))["layer"]
    nvlink, network = hw.link(range(8)), hw.link(range(0, 64, 8))
    assert nvlink.kind == "intra-node" and network.kind == "inter-node"
    p, g = 2 ** 28, 2 ** 29
    assert inside.gather_s == pytest.approx(7 * nvlink.latency_s + 7 / 8 * p / nvlink.bytes_per_s)
    assert inside.reduce_s == pytest.approx(7 * nvlink.latency_s + 7 / 8 * g / nvlink.bytes_per_s)
    assert across.gather_s == pytest.approx(7 * network.latency_s + 7 / 8 * p / network.bytes_per_s)
    assert across.gather_s > 5 * inside.gather_s


def _unit(name: str, gather_bytes: int):
    from nbscaler.cost.fsdp import UnitBytes
    return UnitBytes(name, ((gather_bytes, 2 * gather_bytes),))


def test_on_h100_the_plans_gathers_are_priced_on_nvlink_inside_a_node_and_on_the_network_across(plan):
    inside = plan.step_model(H100).shard_units(MIXED)[0]
    wide = zero3_plan(64).step_model(Hardware.named("H100-SXM-80GB", nodes=8)).shard_units(MIXED)[0]
    nvlink, network = NcclModel(H100), H100.link(range(0, 64, 8))
    for unit, u in inside.bytes.items():
        assert inside.seconds[unit].gather_s == nvlink.forward(Collective.ALL_GATHER, u.gather_bytes // 3, 3,
                                                               ranks=(0, 1, 2))
        assert wide.seconds[unit].gather_s > inside.seconds[unit].gather_s
    assert network.kind == "inter-node"


# -- overlap -------------------------------------------------------------------------------------
LAYERS = ("l0", "l1", "l2")


def layer_script(reshard: bool = True):
    """Three units, each one second of forward and two of backward, and a second of work after them."""
    return script_of([Work(1.0, 2.0, frozenset({u})) for u in LAYERS] + [Work(1.0, 2.0)], reshard)


def test_the_script_gathers_each_layer_before_it_and_releases_it_after():
    script = layer_script()
    assert [type(s).__name__[0] + (s.unit if not isinstance(s, Work) else "") for s in script] == [
        "Gl0", "W", "Rl0", "Gl1", "W", "Rl1", "Gl2", "W", "Rl2", "W"]
    assert script[0] == Gather("l0", "l1") and script[6] == Gather("l2", None) and script[2] == Release("l0")
    assert not any(isinstance(s, Release) for s in layer_script(reshard=False))


def test_exposed_is_the_first_gather_and_the_last_reduce_scatter_when_the_compute_hides_the_rest():
    seconds = {u: UnitSeconds(gather_s=0.3, reduce_s=0.4) for u in LAYERS}
    script = layer_script()
    forward = play_forward(script, seconds, set(LAYERS), overlap=True)
    backward = play_backward(script, seconds, set(LAYERS), set(LAYERS), overlap=True)
    assert forward.compute_s == 4.0 and forward.exposed_s == pytest.approx(0.3)       # l0's gather
    assert backward.compute_s == 8.0 and backward.exposed_s == pytest.approx(0.3 + 0.4)   # l2's gather, l0's reduce
    waited = {(c.kind, c.unit): c.waited_s for c in forward.calls + backward.calls if c.waited_s > 0}
    assert waited == pytest.approx({(Collective.ALL_GATHER, "l0"): 0.3, (Collective.ALL_GATHER, "l2"): 0.3,
                                    (Collective.REDUCE_SCATTER, "l0"): 0.4})
    # nothing overlaps (this machine): every collective waited for in full
    alone = play_backward(script, seconds, set(LAYERS), set(LAYERS), overlap=False)
    assert alone.exposed_s == pytest.approx(3 * 0.3 + 3 * 0.4)
    # kept gathered after the forward: no gathers in the backward, its last reduce-scatter still exposed
    kept = play_backward(layer_script(False), seconds, set(), set(LAYERS), overlap=True)
    assert kept.exposed_s == pytest.approx(0.4) and all(c.kind == Collective.REDUCE_SCATTER for c in kept.calls)


def test_a_gather_longer_than_the_compute_it_hides_under_is_exposed_by_the_difference():
    slow = {u: UnitSeconds(gather_s=3.0, reduce_s=0.4) for u in LAYERS}
    forward = play_forward(layer_script(), slow, set(LAYERS), overlap=True)
    # l0's gather, then l1's and l2's each 3 s under 1 s of compute
    assert forward.exposed_s == pytest.approx(3.0 + 2 * (3.0 - 1.0))
    fast = play_forward(layer_script(), {u: UnitSeconds(0.3, 0.4) for u in LAYERS}, set(LAYERS), overlap=True)
    assert forward.exposed_s > fast.exposed_s
    # a split backward: B gathers, W reduce-scatters, each on its share of the compute
    plays = stage_plays(layer_script(), slow, overlap=True, splits=True)
    assert plays.input_grads.compute_s == pytest.approx((1 - WEIGHT_SHARE) * 8.0)
    assert {c.kind for c in plays.input_grads.calls} == {Collective.ALL_GATHER}
    assert {c.kind for c in plays.weight_grads.calls} == {Collective.REDUCE_SCATTER}


def test_a_kept_unit_is_gathered_again_only_where_no_earlier_forward_holds_it():
    line = build_schedule("1f1b", nstages=2, nmicros=4)
    cold = cold_forwards(line)
    # stage 0 runs two forwards before its first backward, then one each: gathered once; the
    # last stage runs each backward right after its forward
    assert sorted(b.micro for b in cold if b.stage == 0) == [0]
    assert sorted(b.micro for b in cold if b.stage == 1) == [0, 1, 2, 3]


# -- the step --------------------------------------------------------------------------------------
def test_stage_3_syncs_no_bucket_and_gathers_nothing_after_the_step(plan):
    stage2 = ComputeConfig(1, 3, use_zero=True, zero_stage=2)
    params = [w for w in plan.programs.weights(0) if w.kind == "param"]
    reduced = reduced_buckets(params, plan.config, MIXED)
    model = plan.step_model(H100)
    assert [after for _, after in bucket_seconds(stage2, 0, model.comm, reduced)][0] > 0    # stages 1 and 2
    assert bucket_seconds(plan.config, 0, model.comm, reduced) == []
    assert plan.step_figures(recipe=MIXED, hardware=H100).devices[0].sync_s == 0.0


def test_the_step_waits_for_what_the_timeline_shows_exposed(plan):
    figures = plan.step_figures(recipe=MIXED, hardware=H100)
    line = plan.timeline(hardware=H100, recipe=MIXED)
    mine = [c for c in line.collectives if c.rank == 0]
    assert figures.devices[0].fsdp_s == pytest.approx(sum(c.waited_s for c in mine)) and figures.devices[0].fsdp_s > 0
    assert figures.fsdp_comm_share == pytest.approx(figures.devices[0].fsdp_s / figures.step_time_s)
    assert {(c.kind, c.unit) for c in mine} == {(k, u) for k in ("all_gather", "reduce_scatter")
                                                for u in (REST_UNIT, "blocks.0", "blocks.1")}
    forward = [b for b in line.blocks if b.rank == 0 and b.phase == "F"][0]
    first = min(mine, key=lambda c: c.t_start)         # after the position ids, made before any weight is read
    assert first.unit == REST_UNIT and first.waited_s == pytest.approx(first.duration) and first.phase == "F"
    assert forward.t_start <= first.t_start < forward.t_end
    # the blocks last their compute and their waits
    model = plan.step_model(H100)
    f, b = model.times[0][None]
    assert line.makespan == pytest.approx(f + b + figures.devices[0].fsdp_s)


def test_a_group_across_nodes_waits_longer(plan):
    wide = zero3_plan(64)
    hw = Hardware.named("H100-SXM-80GB", nodes=8)
    inside, across = plan.step_figures(recipe=MIXED, hardware=H100), wide.step_figures(recipe=MIXED, hardware=hw)
    assert across.devices[0].fsdp_s > inside.devices[0].fsdp_s
    # HSDP: 8 groups of 8 inside the nodes gather on NVLink; the slices are summed across nodes
    hybrid = zero3_plan(64, zero_ngroups=8).step_model(hw).shard_units(MIXED)[0]
    assert hybrid.seconds["blocks.0"].gather_s == plan_unit_gather(hybrid, "blocks.0", hw, 8)


def plan_unit_gather(units, unit, hw, n):
    return NcclModel(hw).forward(Collective.ALL_GATHER, units.bytes[unit].gather_bytes // n, n, ranks=range(n))


def test_the_unit_table_says_what_each_unit_moves_and_waits(plan):
    from nbscaler.columns import UnitColumn
    table = plan.unit_collectives(H100, recipe=MIXED)
    assert list(table.columns) == [str(c) for c in UnitColumn]
    assert set(table.unit) == {REST_UNIT, "blocks.0", "blocks.1"} and set(table["rank"]) == {0}
    rows = table.set_index("unit")
    assert rows.gathers.to_dict() == {REST_UNIT: 1, "blocks.0": 2, "blocks.1": 2} and (rows.reduces == 1).all()
    assert (rows.reduce_bytes == 2 * rows.gather_bytes).all()
    figures = plan.step_figures(recipe=MIXED, hardware=H100)
    assert table.exposed_s.sum() == pytest.approx(figures.devices[0].fsdp_s)
    # the rest is gathered first, in full view, and reduced last
    assert rows.exposed_s[REST_UNIT] >= rows.gather_s[REST_UNIT] + rows.reduce_s[REST_UNIT] - 1e-12
    assert nbscaler.plan(GPT(MODEL), {"batch": sample_batch(MODEL, 2)}, "dp",
                         ComputeConfig(1, 2, use_zero=True, zero_stage=2)).unit_collectives(H100).empty


def test_a_pipeline_gathers_its_kept_units_once_on_a_first_stage_and_every_micro_batch_on_the_last():
    from tests.models import batch, build
    cfg = ComputeConfig(2, 4, use_end2end=True, use_pipeline=True, pipeline_nstages=2, pipeline_nmicros=4,
                        pipeline_scheduler="1f1b", use_zero=True, zero_stage=3)
    plan = nbscaler.plan(build("gpt"), batch("gpt", 0), "pp", cfg)
    table = plan.unit_collectives(H100).set_index(["rank", "unit"])
    assert table.gathers[(0, REST_UNIT)] == 1 and table.gathers[(1, REST_UNIT)] == 4      # 1F1B, 4 micro-batches
    layers = table[table.index.get_level_values("unit") != REST_UNIT]
    assert (layers.gathers == 8).all() and (table.reduces == 4).all()
    figures = plan.step_figures(hardware=H100)
    line = plan.timeline(hardware=H100)
    assert {c.phase for c in line.collectives} == {"F", "B"}
    assert all(d.fsdp_s > 0 for d in figures.devices.values())


def test_a_group_of_one_rank_moves_nothing():
    """tp x pp over every GPU leaves one rank a ZeRO group: the runtime copies its shard, no collective."""
    plan = zero3_plan(1)
    table = plan.unit_collectives(H100, recipe=MIXED)
    assert (table.gather_s == 0).all() and (table.gathers == 0).all() and (table.exposed_s == 0).all()
    assert plan.timeline(hardware=H100).collectives == () and plan.step_figures(hardware=H100).devices[0].fsdp_s == 0
