"""The recompute knob: names checked, regions marked, code written through checkpoint, costs adjusted."""

import pytest
import torch

import nbscaler
from nbscaler import ComputeConfig, Hardware
from nbscaler.policy import PolicyError
from nbscaler.policy.recompute import recomputed_regions, region_module
from nbscaler.schedule import PipelineGeometry
from tests.conftest import model_plan
from tests.models import batch, build

CLASSES = {"gpt": "GPT", "gpt.blocks": "ModuleList", "gpt.blocks.0": "Block", "gpt.blocks.0.mlp": "MLP",
           "gpt.blocks.1": "Block", "gpt.head": "Linear"}
CONTAINERS = ["gpt.blocks"]


@pytest.mark.parametrize("path, names, region", [
    ("gpt.blocks.0.mlp.fc", ["gpt.blocks"], "gpt.blocks.0"),        # a ModuleList: each layer on its own
    ("gpt.blocks.1.ln1", ["Block"], "gpt.blocks.1"),                 # by class
    ("gpt.blocks.0.mlp.fc", ["gpt.blocks.*.mlp"], "gpt.blocks.0.mlp"),
    ("gpt.blocks.0.mlp.fc", ["gpt.blocks.0.mlp", "Block"], "gpt.blocks.0"),   # the outermost wins
    ("gpt.blocks.1.mlp.fc", ["gpt.blocks.0"], None),
    ("gpt.head", ["Block"], None),
])
def test_region_of_an_op(path, names, region):
    assert region_module(path, names, CLASSES, CONTAINERS) == region


def _plan(policy="dp", names=("gpt.blocks",), **config):
    plan_ngpus = 1 if policy == "dp" else 2
    cfg = ComputeConfig(plan_ngpus, plan_ngpus, pas_config={"recompute_modules": list(names)} if names else {}, **config)
    return model_plan("gpt", policy, cfg)


@pytest.mark.parametrize("value", ["gpt.blocks", [""], [3], {"gpt.blocks": True}])
def test_config_rejects_what_is_not_a_list_of_names(value):
    with pytest.raises(ValueError, match=r"recompute_modules.*list of module paths or class names"):
        ComputeConfig(1, 1, pas_config={"recompute_modules": value})


def test_a_bad_name_lists_the_modules_there_are():
    with pytest.raises(PolicyError) as err:
        _plan(names=["blocks", "gpt.blocks.0"])
    text = str(err.value)
    assert "['blocks']" in text and "gpt.blocks.0 (Block)" in text and "gpt.blocks (ModuleList)" in text


def test_each_block_is_one_checkpointed_function():
    plan = _plan("tp", names=["Block"])
    assert list(recomputed_regions(plan.graph)) == [f"gpt.blocks.{i}" for i in range(4)]
    for source in plan.sources.values():
        compile(source, "gencode.py", "exec")
        assert source.count("def recompute_gpt_blocks_") == 4
        assert "from torch.utils.checkpoint import checkpoint" in source
        assert "= checkpoint(recompute_gpt_blocks_3, " in source and "use_reentrant=False)" in source
        assert "# gpt.blocks.0 (Block) is recomputed in the backward" in source
        body = source.split("def recompute_gpt_blocks_0")[1].split("= checkpoint(")[0]
        assert "comm.all_reduce(" in body          # tp's collectives run inside, again in the backward
    assert "recomputed in the backward: gpt.blocks.0, gpt.blocks.1" in plan.explain()
    lines = plan.sources[0].splitlines()
    fc = next(i for i, n in enumerate(plan.graph.nodes) if n.module_path == "gpt.blocks.2.mlp.fc")
    assert any(lines[k - 1].startswith(" " * 12) and "F.linear(" in lines[k - 1] for k in plan.source_lines[0][fc])


def test_pipeline_regions_stay_inside_their_stage():
    plan = _plan("pp", use_end2end=True, use_pipeline=True, pipeline_nmicros=2, pipeline_scheduler="1f1b")
    regions = recomputed_regions(plan.graph)
    assert len(regions) >= 4 and all(len({n.stage for n in nodes}) == 1 for nodes in regions.values())
    assert isinstance(plan.geometry, PipelineGeometry)
    whole = _plan("pp", names=["gpt"], use_end2end=True, use_pipeline=True, pipeline_nmicros=2)
    assert list(recomputed_regions(whole.graph)) == ["gpt", "gpt#2"]          # one function per stage
    assert "def recompute_gpt(" in whole.sources[0] and "def recompute_gpt_2(" in whole.sources[1]


def test_memory_model_keeps_inputs_and_rebuilds_one_region_at_a_time():
    plain, recomputed = _plan(names=()), _plan()
    before = plain.memory().activation_bytes[0]
    after = recomputed.memory().activation_bytes[0]
    assert 0 < after < before
    rebuilt = recomputed.local_runs[0][None].rebuilt
    assert set(rebuilt) == {f"gpt.blocks.{i}" for i in range(4)} and all(b > 0 for b in rebuilt.values())


def test_time_model_runs_the_forward_of_a_recomputed_op_again():
    """On a target (ops priced by their roofline, nothing profiled here): the time model adds a
    recomputed op's forward to its backward whichever way its ops are timed."""
    plain, recomputed = _plan(names=()), _plan()
    h100 = Hardware.named("H100-SXM-80GB")
    plain.timeline(hardware=h100), recomputed.timeline(hardware=h100)
    for a, b in zip(plain.graph.nodes, recomputed.graph.nodes):
        fwd, bwd = a.meta["local_time_fwd_s"][0], a.meta["local_time_bwd_s"][0]
        again = fwd if "recompute" in b.meta else 0.0
        assert b.meta["local_time_bwd_s"][0] == pytest.approx(bwd + again, rel=1e-9), a.name


def test_autodist_keeps_the_knob():
    cfg = ComputeConfig(2, 2, pas_config={"recompute_modules": ["gpt.blocks.1"]})
    plan = nbscaler.plan(build("gpt"), batch("gpt", 0), "autodist", cfg)
    assert list(recomputed_regions(plan.graph)) == ["gpt.blocks.1"]
    assert "checkpoint(recompute_gpt_blocks_1" in plan.sources[0]
    assert "recomputed in the backward: gpt.blocks.1" in plan.explain()


@pytest.mark.slow       # profiles the model on this CPU; test_autodist_keeps_the_knob and the memory tests stay fast
def test_autodist_recomputes_the_layers_when_no_plan_fits_otherwise():
    model, args = build("gpt"), batch("gpt", 0)
    peak = lambda p: int(p.memory(torch.optim.AdamW).peak_bytes[0])
    plain = _plan(names=())
    layered = _plan()
    rebuilt = max(layered.local_runs[0][None].rebuilt.values())
    assert peak(layered) + rebuilt < peak(plain)
    limit = (peak(layered) + rebuilt + peak(plain)) // 2
    cfg = ComputeConfig(1, 1, pas_config={"memory_limit_bytes": limit, "memory_optimizer": "adamw"})
    chosen = nbscaler.plan(model, args, "autodist", cfg)
    assert chosen.config.pas_config["recompute_modules"] == ["gpt.blocks"]
    assert peak(chosen) == peak(layered)
    assert "so it recomputes every layer of gpt.blocks" in chosen.explain()
