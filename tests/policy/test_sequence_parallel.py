"""What ``pas_config={'sequence_parallel': True}`` makes of a plan, and the keys built-in policies read.

Under sequence parallelism the blocks' collectives are an all-gather before each column-parallel
linear (whose backward reduce-scatters) and a reduce-scatter after each row-parallel one (whose
backward all-gathers): no activation is all-reduced, and the norms, residual adds and embedding sums
keep a sequence slice, so each device saves fewer activation bytes.
"""

import re

import pytest

from nbscaler import ComputeConfig
from nbscaler.policy.builtin import POLICY_KEYS, tp
from tests.conftest import model_plan

SP = {"sequence_parallel": True}


def _plan(model: str, ngpus: int, pas_config: dict, policy="tp", **config):
    return model_plan(model, policy, ComputeConfig(ngpus, ngpus, pas_config=pas_config, **config))


# The GPT on 2 devices in the edit-test loop; the other models and widths in make test.
@pytest.mark.parametrize("model, ngpus", [("gpt", 2), pytest.param("llama", 2, marks=pytest.mark.slow),
                                          pytest.param("gpt", 4, marks=pytest.mark.slow),
                                          pytest.param("hf_llama", 2, marks=pytest.mark.slow)])
def test_sequence_parallel_gathers_and_scatters_instead_of_all_reducing(model, ngpus):
    plain, sp = _plan(model, ngpus, {}), _plan(model, ngpus, SP)
    rows = sp.collectives
    forward, backward = rows[rows.phase == "F"], rows[rows.phase == "B"]
    # row-parallel linears and vocabulary-parallel embeddings: both leave partial sums
    partial = [n for n in sp.graph.nodes if n.op in ("linear", "embedding") and n.placement.split is not None]
    rows_in = {n.name for n in partial if n.placement.split in n.annotation.reduce}
    # one reduce-scatter of the partial sums after every row-parallel linear and vocabulary-parallel
    # embedding (Megatron's order under sequence parallelism), and its all-gather back
    assert set(forward[forward.collective == "reduce_scatter"].producer) == rows_in
    assert set(backward[backward.collective == "all_gather"].producer) >= rows_in
    # an all-gather before every column-parallel linear, whose backward is a reduce-scatter
    gathers = forward[forward.collective == "all_gather_sum_grad"]
    row_linears = {n.name for n in partial if n.op == "linear" and n.name in rows_in}
    assert len(gathers) >= len(row_linears) and set(gathers.want) == {"R*"}
    assert len(backward[backward.collective == "reduce_scatter"]) == len(gathers)
    # no activation is all-reduced in the blocks, forward or backward (the plain plan all-reduces
    # every block); a head may still read a whole copy (transformers' Llama slices it first)
    in_block = {n.name for n in sp.graph.nodes if re.search(r"\.\d+(\.|$)", n.module_path)}
    assert not rows[rows.consumer.isin(in_block)].collective.isin(["all_reduce", "sum_grad"]).any()
    assert plain.collectives.collective.isin(["all_reduce"]).sum() >= len(row_linears)
    # the norms (LayerNorm, or RMSNorm modules written out in elementwise ops) run on a sequence slice
    classes = sp.graph.meta["module_classes"]
    norms = [n for n in sp.graph.nodes if n.op == "norm" or "Norm" in classes.get(n.module_path, "")]
    assert norms and all(n.placement.split is not None for n in norms)
    before, after = plain.memory()["activation_bytes"], sp.memory()["activation_bytes"]
    assert (after < before).all(), f"activation bytes per rank {list(after)} not below {list(before)}"


def _loss(p) -> str:
    """The name of the plan's cross-entropy: its devices' parts of the loss are all-reduced (a
    vocabulary-parallel loss), the one all-reduce sequence parallelism keeps."""
    return next(n.name for n in p.graph.nodes if n.target == "torch.nn.functional.cross_entropy")


def test_sequence_parallel_under_hybrid_slices_each_stage():
    p = _plan("gpt", 4, SP, "hybrid", use_end2end=True, use_pipeline=True, pipeline_nstages=2, pipeline_nmicros=4)
    collectives = set(p.collectives.collective)
    reduced = set(p.collectives[p.collectives.collective == "all_reduce"].tensor)
    assert {"reduce_scatter", "all_gather_sum_grad"} <= collectives and reduced == {_loss(p)}


@pytest.mark.slow       # a second or so: make test runs it, the edit-test loop does not
def test_autodist_weighs_the_sequence_parallel_tp_plan():
    """autodist scores ``tp`` as a rival to its search: with the key, the sequence-parallel one."""
    plain, sp = _plan("gpt", 2, {}, "autodist"), _plan("gpt", 2, SP, "autodist")
    rival = lambda p: p.graph.meta["autodist"]["rival_scores"]["tp"]
    assert rival(plain) != rival(sp)              # another placement scored: its collectives differ


@pytest.mark.slow
def test_autodist_may_choose_sequence_parallelism_unless_the_config_says():
    """Without the key, ``tp`` with and without sequence parallelism both compete with the search;
    the plan's config says ``sequence_parallel=True`` exactly when that one is kept, and its
    placement is then the sequence-parallel ``tp``'s. With the key (True or False) only that ``tp``
    competes."""
    free = _plan("gpt", 2, {}, "autodist")
    info = free.graph.meta["autodist"]
    assert {"tp", "tp sequence parallel"} <= set(info["rival_scores"])
    chose = info["kept"] == "tp sequence parallel"
    assert free.config.pas_config.get("sequence_parallel", False) == chose
    if chose:
        assert [n.placement for n in free.graph.nodes] == [n.placement for n in _plan("gpt", 2, SP).graph.nodes]
    for said in (True, False):
        scores = _plan("gpt", 2, {"sequence_parallel": said}, "autodist").graph.meta["autodist"]["rival_scores"]
        assert "tp sequence parallel" not in scores


def test_the_generated_code_shows_the_collectives():
    p = _plan("gpt", 2, SP)
    code = p.sources[0]
    assert "comm.reduce_scatter(" in code and "comm.all_gather_sum_grad(" in code
    assert re.findall(r"comm\.all_reduce\((\w+)", code) == [_loss(p)]


@pytest.mark.parametrize("policy, key", [("tp", "sequence_paralel"), ("dp", "sequence_parallel"),
                                         ("autodist", "memory_limit"), ("pp", "recompute_layers")])
def test_a_builtin_policy_refuses_a_key_it_does_not_read(policy, key):
    ngpus = 1 if policy == "dp" else 2
    config = dict(use_end2end=True, use_pipeline=True, pipeline_nmicros=2) if policy == "pp" else {}
    with pytest.raises(ValueError, match=rf"'{key}'.*policy '{policy}' does not read.*'recompute_modules'"):
        _plan("gpt", ngpus, {key: True}, policy, **config)


def test_the_refusal_names_the_keys_the_policy_reads():
    with pytest.raises(ValueError) as err:
        _plan("gpt", 2, {"sequence_paralel": True}, tp)            # the built-in passed as a function
    assert all(f"'{k}'" in str(err.value) for k in POLICY_KEYS["tp"] + ("pipeline_nmicros", "recompute_modules"))


def test_a_users_policy_reads_what_it_likes():
    def mine(graph, cfg):
        assert cfg.pas_config["my_knob"] == 3
        return tp(graph, cfg)
    assert _plan("gpt", 2, {"my_knob": 3}, mine).graph is not None


def test_sequence_parallel_must_be_a_bool():
    with pytest.raises(ValueError, match="sequence_parallel.*True or False"):
        _plan("gpt", 2, {"sequence_parallel": "yes"})
