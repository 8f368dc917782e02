"""The rank grid against the arithmetic it replaced, on small hybrid, chimera and interleaved layouts.

Each ``old_*`` function is the formula that was written out where the runtime, the tables and code
generation needed it; the grid must give the same answer for every rank, device and stage.
"""

import itertools

import pytest

from nbscaler.config import ComputeConfig
from nbscaler.schedule import SCHEDULERS, PipelineGeometry, RankGrid, build_schedule, scheduler_spec


def old_dp_ranks(device, plan, runtime):
    return tuple(u * plan + device for u in range(runtime // plan))


def old_zero_ranks(rank, plan, runtime, ngroups):
    same = old_dp_ranks(rank % plan, plan, runtime)
    size = len(same) // ngroups
    first = (rank // plan) // size * size
    return same[first:first + size]


def old_zero_replica_ranks(rank, plan, runtime, ngroups):
    same = old_dp_ranks(rank % plan, plan, runtime)
    size = len(same) // ngroups
    return same[(rank // plan) % size::size]


def old_groups(plan, runtime, device_sets, ngroups):
    """The order ``ensure_groups`` created groups in."""
    out = []
    for u in range(runtime // plan):
        out += [tuple(u * plan + d for d in devices) for devices in device_sets]
        out.append(tuple(u * plan + d for d in range(plan)))
    out += [old_dp_ranks(d, plan, runtime) for d in range(plan)]
    if ngroups is not None:
        for r in range(runtime):
            out += [old_zero_ranks(r, plan, runtime, ngroups), old_zero_replica_ranks(r, plan, runtime, ngroups)]
    return out


def old_replica_groups(geometry, stage):
    """Code generation's copies of a stage slice (chimera)."""
    holders = sorted({geometry.group_of(p[stage]) for p in geometry.schedule.placements})
    if len(holders) < 2:
        return {}
    return {position: tuple(sorted(h[position] for h in holders)) for position in range(len(holders[0]))}


HYBRID = dict(plan_ngpus=4, runtime_ngpus=16, use_zero=True, zero_ngroups=2, use_end2end=True, use_pipeline=True,
              pipeline_scheduler="1f1b", pipeline_nstages=2, pipeline_nmicros=4)
CHIMERA = dict(plan_ngpus=4, runtime_ngpus=8, use_end2end=True, use_pipeline=True,
               pipeline_scheduler="chimera_direct", pipeline_nstages=4, pipeline_nmicros=4)
INTERLEAVED = dict(plan_ngpus=2, runtime_ngpus=4, use_zero=True, use_end2end=True, use_pipeline=True,
                   pipeline_scheduler="1f1b_interleaved", pipeline_nstages=4, pipeline_nmicros=4)

VIRTUAL = dict(plan_ngpus=4, runtime_ngpus=8, use_end2end=True, use_pipeline=True, pipeline_virtual_stages=2,
               pipeline_scheduler="1f1b_interleaved", pipeline_nstages=4, pipeline_nmicros=4)   # 2 devices x tp 2
SHARED_HEAD = dict(plan_ngpus=4, runtime_ngpus=4, use_end2end=True, use_pipeline=True,
                   pipeline_scheduler="1f1b_plus", pipeline_nstages=2, pipeline_nmicros=4)     # stage 0 on all 4


@pytest.mark.parametrize("kwargs", [HYBRID, CHIMERA, INTERLEAVED, VIRTUAL, SHARED_HEAD],
                         ids=["hybrid", "chimera", "interleaved", "interleaved-tp", "shared-head"])
def test_every_answer_equals_the_old_arithmetic(kwargs):
    cfg = ComputeConfig(**kwargs)
    grid, plan, runtime = cfg.grid, cfg.plan_ngpus, cfg.runtime_ngpus
    ngroups = cfg.zero_ngroups if cfg.use_zero else None
    assert grid.units == runtime // plan == cfg.units
    for rank in range(runtime):
        assert grid.unit_of(rank) == rank // plan == cfg.unit_of(rank)
        assert grid.device_of(rank) == rank % plan == cfg.device_of(rank)
        assert grid.rank_of(grid.unit_of(rank), grid.device_of(rank)) == rank
        if ngroups is not None:
            assert grid.zero_ranks(rank) == old_zero_ranks(rank, plan, runtime, ngroups)
            assert grid.zero_replica_ranks(rank) == old_zero_replica_ranks(rank, plan, runtime, ngroups)
    for unit, devices in itertools.product(range(grid.units), [(0,), (1, 2), tuple(range(plan))]):
        devices = tuple(d for d in devices if d < plan)
        assert grid.unit_ranks(unit, devices) == tuple(unit * plan + d for d in devices)
    for device in range(plan):
        assert grid.dp_ranks(device) == old_dp_ranks(device, plan, runtime)
    sets = [(0, 1)]
    assert grid.groups(sets) == old_groups(plan, runtime, sets, ngroups)

    geometry = grid.pipeline
    assert geometry == PipelineGeometry.from_config(cfg)
    assert grid.stage_group(None) == tuple(range(plan))
    for stage in range(geometry.schedule.nstages):
        assert grid.stage_group(stage) == geometry.stage_group(stage)
        assert geometry.stage_copies(stage) == old_replica_groups(geometry, stage)
        group = geometry.stage_group(stage)
        for device in range(plan):
            old_view = device if device in group else group[device % geometry.tp]    # code generation's
            assert geometry.view_of(stage, device) == old_view
            assert geometry.view_of(stage, device) in group
    for device in range(plan):
        assert geometry.tp_index(device) == device % geometry.tp
        assert geometry.stages_of(device) == geometry.schedule.stages_of(device // geometry.tp)


def test_the_layouts_themselves():
    """What the three layouts are, written out: the grid is tested on the cases that matter."""
    hybrid = ComputeConfig(**HYBRID).grid
    assert hybrid.pipeline.tp == 2 and hybrid.stage_group(1) == (2, 3)
    assert hybrid.dp_ranks(3) == (3, 7, 11, 15)
    assert hybrid.zero_ranks(11) == (11, 15) and hybrid.zero_replica_ranks(11) == (3, 11)
    virtual = ComputeConfig(**VIRTUAL).grid.pipeline        # stages 0, 2 on devices 0-1; 1, 3 on 2-3
    assert virtual.tp == 2 and [virtual.stage_group(s) for s in range(4)] == [(0, 1), (2, 3), (0, 1), (2, 3)]
    assert virtual.stages_of(3) == (1, 3)
    chimera = ComputeConfig(**CHIMERA).grid.pipeline
    assert chimera.stages_of(1) == (1, 2) and chimera.copy_groups() == [(0, 3), (1, 2)]
    assert [chimera.view_of(s, 1) for s in chimera.stages_of(1)] == [1, 2]     # stage 2 as device 2 runs it
    interleaved = ComputeConfig(**INTERLEAVED).grid
    assert interleaved.pipeline.stages_of(0) == (0, 2) and interleaved.stage_group(3) == (1,)
    assert interleaved.pipeline.copy_groups() == []
    assert interleaved.zero_group_size == 2


def test_a_plain_grid_has_one_stage_group_and_no_zero():
    grid = RankGrid(2, 4)
    assert grid.stage_group(0) == (0, 1) and grid.groups() == [(0, 1), (2, 3), (0, 2), (1, 3)]
    with pytest.raises(ValueError, match="no ZeRO groups"):
        grid.zero_ranks(0)


@pytest.mark.parametrize("kwargs, words", [
    (dict(plan_ngpus=0, runtime_ngpus=1), "RankGrid.plan_ngpus=0 is invalid: it must be a positive integer."),
    (dict(plan_ngpus=2, runtime_ngpus=3), "RankGrid.runtime_ngpus=3 is invalid: it must be a multiple of plan_ngpus=2"),
    (dict(plan_ngpus=1, runtime_ngpus=4, zero_ngroups=3), "RankGrid.zero_ngroups=3 is invalid: it must divide the "
                                                         "number of data-parallel units (4"),
    (dict(plan_ngpus=2, runtime_ngpus=2, pipeline=PipelineGeometry(build_schedule("1f1b", 4, 4), 4)),
     "the pipeline is laid out on 4 plan devices"),
])
def test_a_bad_grid_names_the_field_and_the_fix(kwargs, words):
    with pytest.raises(ValueError) as err:
        RankGrid(**kwargs)
    assert words in str(err.value)


def test_chimera_declares_its_rules_where_it_registers():
    spec = scheduler_spec("chimera_direct")
    assert (spec.fixed_nstages, spec.one_device_per_stage, spec.stage_copies) == (4, True, 2)
    assert all((s.fixed_nstages, s.one_device_per_stage, s.stage_copies) == (None, False, 1)
               for name, s in SCHEDULERS.items() if name != "chimera_direct")


def test_zero_stage_2_refuses_a_scheduler_with_stage_copies():
    with pytest.raises(ValueError) as err:
        ComputeConfig(**CHIMERA, use_zero=True, zero_stage=2)
    assert str(err.value) == (
        "ComputeConfig.zero_stage=2 is invalid: chimera_direct sums the gradients of each stage's two copies after "
        "the backward, which ZeRO-2 has already freed by then; use zero_stage=1 with chimera_direct.")


def test_zero_over_a_stage_spans_its_devices_in_every_unit_of_the_run():
    """Under context parallelism a stage's devices hold the same weights: ZeRO's groups take them
    in, unit by unit; the ranks holding the same slice are still one per group."""
    grid = RankGrid(plan_ngpus=2, runtime_ngpus=8, zero_ngroups=2, zero_over_stage=True)
    assert grid.zero_group_size == 4
    assert [grid.zero_ranks(r) for r in (0, 3, 5)] == [(0, 1, 2, 3), (0, 1, 2, 3), (4, 5, 6, 7)]
    assert [grid.zero_replica_ranks(r) for r in (0, 3, 5)] == [(0, 4), (3, 7), (1, 5)]
    # every rank sits at the same place in its group as the ranks holding its slice do in theirs
    for rank in range(8):
        where = grid.zero_ranks(rank).index(rank)
        assert [grid.zero_ranks(r).index(r) for r in grid.zero_replica_ranks(rank)] == [where] * 2
    assert grid.dp_ranks(1) == (1, 3, 5, 7)                  # the data-parallel sets are as before
    assert {(0, 1, 2, 3), (4, 5, 6, 7), (0, 4), (3, 7)} <= set(grid.groups())


def test_zero_over_a_stage_stays_inside_each_pipeline_stage():
    """Two stages of two context-parallel devices: each group spans one stage's devices only."""
    cfg = ComputeConfig(plan_ngpus=4, runtime_ngpus=8, use_end2end=True, use_pipeline=True, pipeline_nstages=2,
                        pipeline_nmicros=2, use_zero=True, pas_config={"context_parallel": 2})
    grid = cfg.grid
    assert grid.zero_over_stage and grid.zero_group_size == 4
    assert grid.same_weight_devices(3) == (2, 3)
    assert grid.zero_ranks(2) == (2, 3, 6, 7)
    assert grid.zero_ranks(5) == (0, 1, 4, 5)
    assert cfg.sums_partial_grads_after_backward                # the reduce-scatter sums the parts
    assert not ComputeConfig(plan_ngpus=2, runtime_ngpus=4, use_zero=True, zero_stage=2).sums_partial_grads_after_backward


def test_zero_over_a_stage_needs_zero_groups_and_one_copy_of_each_stage():
    with pytest.raises(ValueError, match="needs ZeRO groups"):
        RankGrid(plan_ngpus=2, runtime_ngpus=4, zero_over_stage=True)
    chimera = PipelineGeometry.from_config(ComputeConfig(**CHIMERA))
    with pytest.raises(ValueError, match="two copies of each stage"):
        RankGrid(plan_ngpus=4, runtime_ngpus=8, zero_ngroups=1, pipeline=chimera, zero_over_stage=True)
