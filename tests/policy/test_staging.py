"""Cutting a model into pipeline stages: by FLOPs (the default) or by equal numbers of layers."""

import pytest

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.models.gpt import GPT, GPTConfig, sample_batch
from nbscaler.policy.primitives import PolicyError

CFG = GPTConfig(vocab_size=512, seq_len=16, n_layer=4, d_model=32, n_head=2)


def config(split, nstages=2):
    return ComputeConfig(nstages, nstages, use_end2end=True, use_pipeline=True, pipeline_nstages=nstages,
                         pipeline_nmicros=2, pipeline_scheduler="1f1b", pas_config={"pipeline_split": split})


def stage_of_layers(plan):
    return {n.module_path.split(".")[0] + ("." + n.module_path.split(".")[1] if n.module_path.startswith("blocks.") else ""):
            n.stage for n in plan.graph.nodes if n.module_path}


def test_layers_gives_each_stage_as_many_layers_the_ends_with_the_first_and_last():
    """A large vocabulary makes the head heavy: by FLOPs the last stage takes fewer layers; by
    layers each takes two, as Megatron-LM splits a model, the head on the last."""
    by_layers = nbscaler.plan(GPT(CFG), {"batch": sample_batch(CFG, 2)}, "pp", config("layers"))
    stages = stage_of_layers(by_layers)
    assert stages == {"tok": 0, "pos": 0, "blocks.0": 0, "blocks.1": 0, "blocks.2": 1, "blocks.3": 1,
                      "ln_f": 1, "head": 1}
    by_flops = nbscaler.plan(GPT(CFG), {"batch": sample_batch(CFG, 2)}, "pp", config("flops"))
    assert stage_of_layers(by_flops)["blocks.2"] == 0               # the head's FLOPs push a layer forward


def test_a_split_that_does_not_divide_the_layers_or_is_unknown_is_refused():
    with pytest.raises(PolicyError, match=r"same number of repeated layers, but the model has 4.*pipeline_split='flops'"):
        nbscaler.plan(GPT(CFG), {"batch": sample_batch(CFG, 2)}, "pp", config("layers", nstages=3))
    with pytest.raises(ValueError, match=r"pipeline_split'\]='evenly' is invalid: give one of flops, layers"):
        nbscaler.plan(GPT(CFG), {"batch": sample_batch(CFG, 2)}, "pp", config("evenly"))
