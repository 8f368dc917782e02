"""``device_runs`` replays one device per group of devices whose programs are the same up to rank,
and hands the others the same run: it must equal replaying every device."""

import dataclasses

import pandas.testing as pd_testing
import pytest
import torch

import nbscaler
import nbscaler.cost.memory as memory
import nbscaler.cost.same_sections as same_sections
from nbscaler import ComputeConfig
from nbscaler.cost.local import CollectiveCall, LocalRun
from nbscaler.cost.memory import device_runs, stage_runs
from nbscaler.ir.annotation import OpAnnotation
from nbscaler.models.gpt import GPTConfig
from nbscaler.recipe import Recipe
from tests.conftest import gpt_plan


def _plan(recompute: bool, layers: int = 2, stages: int = 2) -> "nbscaler.Plan":
    torch.manual_seed(0)
    cfg = ComputeConfig(8, 8, use_end2end=True, use_pipeline=True, pipeline_nstages=stages, pipeline_nmicros=2,
                        pipeline_scheduler="1f1b", pas_config={"recompute_modules": ["blocks"]} if recompute else {})
    return gpt_plan("hybrid", cfg, model=GPTConfig(vocab_size=64, seq_len=8, n_layer=layers, d_model=32, n_head=4))


def _facts(run: LocalRun):
    ops = [(op.node.name, op.in_shapes, op.out_shapes, op.saved_bytes, op.recomputed) for op in run.ops]
    return run.device, run.stage, ops, run.collectives, run.saved_bytes, run.exact, run.rebuilt


@pytest.mark.parametrize("recompute", [False, True])
def test_shared_runs_equal_each_device_replayed(recompute, monkeypatch):
    plan = _plan(recompute)
    replays = []
    real = memory.run_local
    monkeypatch.setattr(same_sections, "run_local", lambda *a, **k: replays.append(a[0].device) or real(*a, **k))
    shared = device_runs(plan.placed)
    assert len(replays) == 4         # of 8: per stage, the first of its tp group of 4 and one of the others
    for device in range(plan.config.plan_ngpus):
        alone = stage_runs(plan.placed, device)
        assert alone.keys() == shared[device].keys()
        for stage in alone:
            assert _facts(shared[device][stage]) == _facts(alone[stage])
    assert any(c.fn != "sum_grad" for runs in shared.values() for r in runs.values() for c in r.collectives)


@pytest.mark.parametrize("recompute", [False, True])
def test_stages_of_repeated_layers_share_one_replay_and_give_the_same_table(recompute, monkeypatch):
    """8 layers on 4 stages of 2 devices: the middle stages (layers 2-3 and 4-5 here) differ only
    in names, so one replay serves both, and the memory table is the one of replaying every device."""
    plan = _plan(recompute, layers=8, stages=4)
    replays = []
    real = memory.run_local
    monkeypatch.setattr(same_sections, "run_local", lambda *a, **k: replays.append(a[0].stage) or real(*a, **k))
    shared = device_runs(plan.placed)
    assert sorted(replays) == [0, 0, 1, 1, 3, 3]     # the first of each tp group and one other; none of stage 2
    alone = {d: stage_runs(plan.placed, d) for d in range(plan.config.plan_ngpus)}
    for device, runs in alone.items():
        assert runs.keys() == shared[device].keys()
        for stage in runs:
            assert _facts(shared[device][stage]) == _facts(runs[stage])
    for optimizer in (torch.optim.SGD, torch.optim.Adam):
        args = (plan.placed, Recipe(optimizer))
        pd_testing.assert_frame_equal(memory.memory_per_rank(*args, runs=shared), memory.memory_per_rank(*args, runs=alone))
        pd_testing.assert_frame_equal(plan.memory(optimizer), memory.memory_per_rank(*args))


def test_sections_differing_beyond_names_have_different_keys():
    plan = _plan(False, layers=8, stages=4)
    sections = {d: {s.stage: s for s in plan.programs.device(d).sections if s.graph is plan.graph}
                for d in range(plan.config.plan_ngpus)}
    key = lambda d, s: same_sections.section_key(sections[d][s])[0]
    assert key(2, 1) == key(4, 2)                        # the first of each tp group: alike
    assert key(2, 1) != key(3, 1)                        # its tp partner: another place in the groups
    assert key(0, 0) != key(2, 1) != key(6, 3)           # the embedding and the loss stages


def test_the_key_reads_every_field_of_an_annotation():
    assert tuple(f.name for f in dataclasses.fields(OpAnnotation)) == same_sections.ANNOTATION_FIELDS


def test_runs_that_depend_on_the_place_in_a_group_are_not_shared():
    def run(fn, in_bytes, out_bytes, device=0):
        return LocalRun(device, None, collectives=[CollectiveCall(fn, "x", (0, 1, 2), in_bytes, out_bytes)])
    assert memory._shares(run("chunk", 60, 20), 1) and memory._shares(run("all_reduce", 40, 40), 1)
    assert not memory._shares(run("chunk", 60, 24), 1)          # 5 rows cut in 3: the pieces differ
    assert not memory._shares(run("chunk", 0, 0), 1)            # empty: the shapes could still differ
    assert not memory._shares(run("first_only", 40, 40), 1)     # values on the first device, zeros elsewhere
    assert memory._shares(run("first_only", 40, 40, device=1), 2)
