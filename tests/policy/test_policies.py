import html

import pytest

import nbscaler
from nbscaler import ComputeConfig, parallelize
from nbscaler.policy import PolicyError, get_policy, partition, replicate
from nbscaler.trace import trace_module
from tests.models import Llama, batch, build
from tests.multiprocess import Case, check_equivalence, run_ranks, train_parallel


def llama_graph():
    return trace_module(Llama(), batch("llama", 0))


def test_tp_is_megatron_style_on_a_transformer():
    g = get_policy("tp")(llama_graph(), ComputeConfig(plan_ngpus=2, runtime_ngpus=2))
    split = {n.module_path: n.placement.split for n in g.nodes if n.op == "linear"}
    for proj in ("q", "k", "v"):
        assert split[f"blocks.0.attn.{proj}"] == "n"          # column parallel
    assert split["blocks.0.attn.o"] == "k"                     # row parallel: partial sums
    assert split["blocks.0.mlp.w1"] == "n" and split["blocks.0.mlp.w2"] == "k"
    assert all(n.placement.split == "v" for n in g.select(op="embedding"))     # vocabulary-parallel


def test_data_splits_along_the_batch():
    g = get_policy("data")(llama_graph(), ComputeConfig(plan_ngpus=2, runtime_ngpus=2))
    linear = g.select(op="linear")[0]
    assert linear.placement.split == "*0"


def test_dp_needs_one_device_per_unit():
    with pytest.raises(PolicyError, match="plan_ngpus=1"):
        get_policy("dp")(llama_graph(), ComputeConfig(plan_ngpus=2, runtime_ngpus=2))


@pytest.mark.parametrize("name", ["pp", "hybrid"])
def test_pipeline_policies_need_a_pipeline_config(name, tmp_path):
    with pytest.raises(PolicyError, match="use_pipeline=True"):
        parallelize(build("mlp"), batch("mlp", 0), name, ComputeConfig(2, 2), gen_savedir=tmp_path, load_module=False)


def test_unknown_policy_name():
    with pytest.raises(ValueError, match="unknown PAS policy 'zz'"):
        get_policy("zz")


def test_partition_explains_refusals():
    node = llama_graph().select(op="softmax")[0]
    with pytest.raises(PolicyError, match="must not be split"):
        partition(node, node.annotation.inputs[0][-1], [0, 1])
    with pytest.raises(PolicyError, match="not divisible by 3"):
        partition(node, 0, [0, 1, 2])
    assert replicate(node, [0, 1]).placement.devices == (0, 1)


def test_ops_must_cover_the_unit_without_a_pipeline(tmp_path):
    def half(graph, cfg):
        for node in graph.nodes:
            replicate(node, [0])
        return graph

    with pytest.raises(PolicyError, match="not on all 2 devices"):
        parallelize(build("mlp"), batch("mlp", 0), half, ComputeConfig(2, 2), gen_savedir=tmp_path, load_module=False)


def column_then_row(graph, cfg):
    """A hand-written policy: the MLP's first linear column-parallel, the second row-parallel."""
    devices = list(range(cfg.plan_ngpus))
    for node in graph.nodes:
        if node.module_path == "fc1":
            partition(node, "n", devices)
        elif node.module_path == "fc2":
            partition(node, "k", devices)
        elif node.op == "elementwise" and node.module_path == "" and node.target.endswith("gelu"):
            partition(node, 1, devices)
        else:
            replicate(node, devices)
    return graph


@pytest.mark.multiprocess
def test_custom_policy_trains_like_one_process(tmp_path):
    cases = [Case("mlp", column_then_row, 2, 2), Case("mlp", column_then_row, 2, 4)]
    per_rank = run_ranks(train_parallel, 4, cases[1:], str(tmp_path))
    check_equivalence(cases[1], [r[0] for r in per_rank])
    per_rank = run_ranks(train_parallel, 2, cases[:1], str(tmp_path))
    check_equivalence(cases[0], [r[0] for r in per_rank])


def test_data_refuses_a_batch_that_does_not_divide():
    graph = trace_module(Llama(), batch("llama", 0))          # a batch of 4
    with pytest.raises(PolicyError, match=r"batch size 4\).*multiple of 3 \(e\.g\. 6\).*divisor of 4"):
        get_policy("data")(graph, ComputeConfig(plan_ngpus=3, runtime_ngpus=3))


def test_hybrid_says_a_scheduler_leaves_no_tensor_parallelism(tmp_path):
    cfg = ComputeConfig(4, 4, use_end2end=True, use_pipeline=True, pipeline_scheduler="1f1b_interleaved",
                        pipeline_nstages=8, pipeline_nmicros=4)
    p = nbscaler.plan(Llama(), batch("llama", 0), "hybrid", cfg)
    said = ("1f1b_interleaved spreads its stages over every one of the 4 plan devices, so 'hybrid' runs each stage "
            "on one device")
    assert said in str(p.explain()) and html.escape(said) in p._repr_html_()
    fix = "set pipeline_virtual_stages, the stages on each pipeline device (here pipeline_virtual_stages=4: 2 pipeline"
    assert fix in str(p.explain())
    assert {len(n.placement.devices) for n in p.graph.nodes} == {1}
    sequence = ComputeConfig(4, 4, use_end2end=True, use_pipeline=True, pipeline_scheduler="1f1b_interleaved",
                             pipeline_nstages=8, pipeline_nmicros=4, pas_config={"sequence_parallel": True})
    with pytest.raises(PolicyError, match="asks for tensor-parallel stages, but 1f1b_interleaved spreads"):
        get_policy("hybrid")(llama_graph(), sequence)
    two = ComputeConfig(4, 4, use_end2end=True, use_pipeline=True, pipeline_scheduler="1f1b", pipeline_nstages=2,
                        pipeline_nmicros=4)
    graph = get_policy("hybrid")(llama_graph(), two)                    # 1f1b keeps 2-way tensor parallelism
    assert {len(n.placement.devices) for n in graph.nodes} == {2}
    assert any(n.placement.split for n in graph.select(op="linear"))


@pytest.mark.parametrize("sequence", [False, True])
def test_hybrid_keeps_tensor_parallelism_under_interleaving_given_virtual_stages(sequence):
    """With ``pipeline_virtual_stages``, 1f1b_interleaved's stages sit on fewer pipeline devices and
    ``hybrid`` splits each over its group, as Megatron-LM's virtual stages: 4 stages, 2 a device, on 2
    pipeline devices x 2-way tensor parallelism; the plan prices those collectives on a target."""
    pas = {"sequence_parallel": True} if sequence else {}
    cfg = ComputeConfig(4, 4, use_end2end=True, use_pipeline=True, pipeline_scheduler="1f1b_interleaved",
                        pipeline_nstages=4, pipeline_virtual_stages=2, pipeline_nmicros=4, pas_config=pas)
    p = nbscaler.plan(Llama(), batch("llama", 0), "hybrid", cfg)
    assert "policy_note" not in p.graph.meta and p.schedule.ndevices == 2
    groups = {n.stage: n.placement.devices for n in p.graph.nodes}
    assert groups == {0: (0, 1), 1: (2, 3), 2: (0, 1), 3: (2, 3)}
    assert any(n.placement.split for n in p.graph.select(op="linear"))
    tp_collectives = p.collectives[p.collectives.collective != "send_recv"]
    assert set(tp_collectives.devices.map(tuple)) >= {(0, 1), (2, 3)}
    figures = p.step_figures(hardware=nbscaler.Hardware.named("H100-SXM-80GB"))
    assert all(d.tp_s > 0 for d in figures.devices.values())
