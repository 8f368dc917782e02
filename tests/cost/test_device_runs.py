"""``device_runs`` replays one device per group of devices whose programs are the same up to rank,
and hands the others the same run: it must equal replaying every device."""

import pytest
import torch

import nbscaler
import nbscaler.cost.memory as memory
from nbscaler import ComputeConfig
from nbscaler.cost.local import CollectiveCall, LocalRun
from nbscaler.cost.memory import device_runs, stage_runs
from nbscaler.models.gpt import GPT, GPTConfig, sample_batch


def _plan(recompute: bool) -> "nbscaler.Plan":
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, seq_len=8, n_layer=2, d_model=32, n_head=4))
    cfg = ComputeConfig(8, 8, use_end2end=True, use_pipeline=True, pipeline_nstages=2, pipeline_nmicros=2,
                        pipeline_scheduler="1f1b", pas_config={"recompute_modules": ["blocks"]} if recompute else {})
    return nbscaler.plan(model, {"batch": sample_batch(model.config, 2)}, "hybrid", cfg)


def _facts(run: LocalRun):
    ops = [(op.node.name, op.in_shapes, op.out_shapes, op.saved_bytes, op.recomputed) for op in run.ops]
    return run.device, run.stage, ops, run.collectives, run.saved_bytes, run.exact, run.rebuilt


@pytest.mark.parametrize("recompute", [False, True])
def test_shared_runs_equal_each_device_replayed(recompute, monkeypatch):
    plan = _plan(recompute)
    replays = []
    real = memory.run_local
    monkeypatch.setattr(memory, "run_local", lambda *a, **k: replays.append(a[0].device) or real(*a, **k))
    shared = device_runs(plan.graphs, plan.storage, plan.config, plan.geometry)
    assert len(replays) == 4         # of 8: per stage, the first of its tp group of 4 and one of the others
    for device in range(plan.config.plan_ngpus):
        alone = stage_runs(plan.graphs, plan.storage, device, plan.geometry)
        assert alone.keys() == shared[device].keys()
        for stage in alone:
            assert _facts(shared[device][stage]) == _facts(alone[stage])
    assert any(c.fn != "sum_grad" for runs in shared.values() for r in runs.values() for c in r.collectives)


def test_runs_that_depend_on_the_place_in_a_group_are_not_shared():
    def run(fn, in_bytes, out_bytes, device=0):
        return LocalRun(device, None, collectives=[CollectiveCall(fn, "x", (0, 1, 2), in_bytes, out_bytes)])
    assert memory._shares(run("chunk", 60, 20), 1) and memory._shares(run("all_reduce", 40, 40), 1)
    assert not memory._shares(run("chunk", 60, 24), 1)          # 5 rows cut in 3: the pieces differ
    assert not memory._shares(run("chunk", 0, 0), 1)            # empty: the shapes could still differ
    assert not memory._shares(run("first_only", 40, 40), 1)     # values on the first device, zeros elsewhere
    assert memory._shares(run("first_only", 40, 40, device=1), 2)
