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


@pytest.mark.slow       # seconds on its own: make test runs it, the edit-test loop does not
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


@pytest.mark.slow       # seconds on its own: make test runs it, the edit-test loop does not
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


# recompute='none' | 'selective' | 'full' (RecomputeGranularity)

def _granular(name, granularity, policy="dp", plan_ngpus=1, **config):
    cfg = ComputeConfig(plan_ngpus, plan_ngpus, pas_config={"recompute": granularity}, **config)
    return model_plan(name, policy, cfg)


def test_granularity_is_checked_by_the_config():
    with pytest.raises(ValueError, match=r"\['recompute'\]='some' is invalid: use one of 'none', 'selective', 'full'"):
        ComputeConfig(1, 1, pas_config={"recompute": "some"})
    with pytest.raises(ValueError, match=r"both 'recompute'='full' and 'recompute_modules'.*not both"):
        ComputeConfig(1, 1, pas_config={"recompute": "full", "recompute_modules": ["gpt.blocks"]})
    cfg = ComputeConfig(1, 1, pas_config={"recompute": nbscaler.RecomputeGranularity.SELECTIVE})
    assert type(cfg.pas_config["recompute"]) is str and cfg.pas_config["recompute"] == "selective"


def test_full_recomputes_each_layer_of_the_stack_as_recompute_modules_does():
    full, named = _granular("gpt", "full", "tp", 2), _plan("tp", names=["gpt.blocks"])
    assert list(recomputed_regions(full.graph)) == list(recomputed_regions(named.graph)) == \
        [f"gpt.blocks.{i}" for i in range(4)]
    assert full.sources == named.sources
    assert list(recomputed_regions(_granular("llama", "full").graph)) == ["blocks.0", "blocks.1"]
    assert not recomputed_regions(_granular("gpt", "none").graph)


@pytest.mark.parametrize("name, first, ops", [
    ("gpt", "gpt.blocks.0.attn:core", ["attention"]),           # one scaled_dot_product_attention
    ("llama", "blocks.0.attn:core",                              # q @ k.T, scale, mask, softmax, @ v
     ["matmul", "elementwise", "constructor", "triangle", "elementwise", "softmax", "matmul"]),
    pytest.param("hf_gpt2", "model.transformer.h.0.attn:core", ["attention"], marks=pytest.mark.slow),
    ("hf_qwen2", "model.model.layers.0.self_attn:core", ["attention"]),
])
def test_selective_finds_the_attention_core_of_every_layer(name, first, ops):
    plan = _granular(name, "selective")
    regions = recomputed_regions(plan.graph)
    assert len(regions) == {"gpt": 4}.get(name, 2) and list(regions)[0] == first
    assert [n.op for n in regions[first]] == ops
    kept, recomputed = model_plan(name, "dp", ComputeConfig(1, 1)).memory(), plan.memory()
    assert 0 < recomputed.activation_bytes[0] < kept.activation_bytes[0]


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_selective_follows_an_eager_attention_through_the_graph(model):
    """Hugging Face's eager attention (with attention dropout): the scores, their scale and mask, the
    softmax, its cast, the dropout and the product with V make one region."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    from tests.models import hf
    if model == "gpt2":
        net = GPT2LMHeadModel(GPT2Config(vocab_size=hf.VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                         attn_pdrop=0.1, bos_token_id=0, eos_token_id=0,
                                         attn_implementation="eager"))
    else:
        net = LlamaForCausalLM(LlamaConfig(**{**hf._decoder_kwargs(), "attention_dropout": 0.1},
                                           attn_implementation="eager"))
    plan = nbscaler.plan(hf.LossOf(net), batch(f"hf_{model}", 0), "dp",
                         ComputeConfig(1, 1, pas_config={"recompute": "selective"}))
    regions = list(recomputed_regions(plan.graph).values())
    assert len(regions) == 2
    targets = [n.target.rsplit(".", 1)[-1] for n in regions[0]]
    assert targets[0] == targets[-1] == "matmul" and "softmax" in targets and "dropout" in targets


def test_selective_regions_are_written_through_checkpoint():
    plan = _granular("gpt", "selective", "tp", 2)
    source = plan.sources[0]
    assert "def recompute_gpt_blocks_0_attn_core(" in source
    assert "# the attention core of gpt.blocks.0.attn (CausalSelfAttention) is recomputed in the backward" in source
    assert "recomputed in the backward: gpt.blocks.0.attn:core" in plan.explain()


@pytest.mark.parametrize("policy, plan_ngpus, config", [
    ("dp", 1, {}), ("tp", 2, {}), ("data", 2, {}),
    ("hybrid", 4, dict(use_end2end=True, use_pipeline=True, pipeline_nmicros=2, pipeline_nstages=2)),
])
def test_the_builtin_policies_take_the_granularity(policy, plan_ngpus, config):
    for granularity, count in (("selective", 4), ("full", 4), ("none", 0)):
        plan = _granular("gpt", granularity, policy, plan_ngpus, **config)
        regions = recomputed_regions(plan.graph)
        assert len(regions) == count and all(len({n.stage for n in ops}) == 1 for ops in regions.values())


def test_a_model_without_the_structure_is_told_why_and_what_to_do():
    with pytest.raises(PolicyError, match=r"'selective'.*this model has none.*recompute='full'.*recompute_modules"):
        _granular("mlp", "selective")
    with pytest.raises(PolicyError, match=r"'full'.*nn.ModuleList.*has none.*recompute_modules"):
        _granular("fused_gqa", "full")


def test_time_model_runs_the_attention_core_again():
    plain, recomputed = _plan(names=()), _granular("gpt", "selective")
    h100 = Hardware.named("H100-SXM-80GB")
    plain.timeline(hardware=h100), recomputed.timeline(hardware=h100)
    again = 0
    for a, b in zip(plain.graph.nodes, recomputed.graph.nodes):
        fwd, bwd = a.meta["local_time_fwd_s"][0], a.meta["local_time_bwd_s"][0]
        again += "recompute" in b.meta
        assert b.meta["local_time_bwd_s"][0] == pytest.approx(bwd + (fwd if "recompute" in b.meta else 0.0),
                                                             rel=1e-9), a.name
    assert again == 4
