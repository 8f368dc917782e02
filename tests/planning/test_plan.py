"""The in-memory Plan: no files, no process group, and tables that agree with the generated code."""

import json
import re
from collections import Counter

import pytest
import torch

import nbscaler
from nbscaler.layouts import COLLECTIVES, Collective
import nbscaler.planning.planner as planner
from nbscaler import ComputeConfig, parallelize
from nbscaler.genfiles import PLAN_FILE, module_dir
from tests.models import batch, build


def pipeline(plan_ngpus, nstages=None, scheduler="1f1b", nmicros=4):
    return ComputeConfig(plan_ngpus, plan_ngpus, use_end2end=True, use_pipeline=True, pipeline_nmicros=nmicros,
                         pipeline_scheduler=scheduler, pipeline_nstages=nstages or plan_ngpus)


def comm_calls(source: str) -> Counter:
    """The collectives a rank's code calls: ``comm.<name>(...)``, and for each call of a function
    that runs one inside it (``CollectiveSpec.inside``: a split loss's token count) that collective."""
    calls = Counter(re.findall(r"= comm\.(\w+)\(", source))
    for collective, spec in COLLECTIVES.items():
        if spec.inside and collective != Collective.EXPERT_EXCHANGE:     # (an exchange runs twice a call)
            calls[collective.value] += len(re.findall(rf"= {spec.inside.rsplit('.', 1)[1]}\(", source))
    return +calls


def test_plan_writes_nothing_and_needs_no_process_group(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = nbscaler.plan(build("llama"), batch("llama", 0), "tp", ComputeConfig(2, 4))
    assert not torch.distributed.is_initialized()
    assert list(tmp_path.iterdir()) == []
    assert isinstance(p, nbscaler.Plan) and p.policy_name == "tp" and p.module_name == "nbscaler.models.llama.Llama"
    assert sorted(p.sources) == [0, 1, 2, 3] and "class " in p.sources[1]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("model,policy,cfg", [
    ("llama", "tp", ComputeConfig(2, 2)), ("llama", "data", ComputeConfig(2, 2)), ("mlp", "tp", ComputeConfig(4, 4)),
    ("mlp", "data", ComputeConfig(2, 2))])
def test_collectives_are_the_calls_in_the_generated_code(model, policy, cfg):
    p = nbscaler.plan(build(model), batch(model, 0), policy, cfg)
    assert list(p.graphs) == ["any"]            # one forward per file, so the counts compare directly
    forward = p.collectives[p.collectives.phase == "F"]
    for device in range(cfg.plan_ngpus):
        mine = forward[forward.devices.map(lambda g: device in g)]
        assert Counter(mine.collective) == comm_calls(p.sources[device]), device
    assert len(forward) > 0


def test_pipeline_crossings_count_each_micro_batch_both_ways():
    p = nbscaler.plan(build("llama"), batch("llama", 0), "pp", pipeline(2))
    crossing = p.collectives[p.collectives.collective == "send_recv"]
    assert sorted(crossing.phase) == ["B", "F"] and set(crossing.stage) == {0, 1}
    carried = crossing.tensor_bytes.iloc[0]
    traffic = p.traffic().set_index("rank")
    assert traffic.loc[0].tolist() == [4 * carried, 4 * carried]       # sends activations, gets gradients
    assert traffic.loc[1].tolist() == [4 * carried, 4 * carried]


def test_ops_table_and_cost_facts():
    p = nbscaler.plan(build("llama"), batch("llama", 0), "tp", ComputeConfig(2, 2))
    ops = p.ops
    assert len(ops) == len(p.graph) and list(ops.id) == list(range(len(p.graph)))
    linear = ops[ops.op == "linear"]
    assert set(linear.split) == {"n", "k"}
    q = linear[linear.module == "blocks.0.attn.q"].iloc[0]
    (_, d), (out, _) = q.in_shapes[0][-2:], q.in_shapes[1]
    assert q.flops_fwd == 2 * torch.Size(q.in_shapes[0][:-1]).numel() * d * out
    assert q.flops_bwd == 2 * q.flops_fwd and q.local_flops_fwd == q.flops_fwd / 2
    assert q.local_out_shapes[0][-1] == q.out_shapes[0][-1] // 2
    assert all(n.meta["bytes_read"] == sum(t.nbytes for t in n.inputs) for n in p.graph.nodes)


def test_single_device_flops_are_the_whole_model():
    p = nbscaler.plan(build("mlp"), batch("mlp", 0), "dp", ComputeConfig(1, 2))
    from nbscaler.planning.step import flops_per_device
    assert flops_per_device(p) == {0: p.ops.flops_fwd.sum() + p.ops.flops_bwd.sum()}
    assert p.collectives.empty


def test_replan_does_not_trace_and_leaves_the_first_plan_alone(monkeypatch):
    first = nbscaler.plan(build("llama"), batch("llama", 0), "tp", ComputeConfig(2, 2))
    splits = list(first.ops.split)

    def no_trace(*a, **k):
        raise AssertionError("replan must not trace")

    monkeypatch.setattr(planner, "trace_modes", no_trace)
    second = first.replan(policy="pp", compute_config=pipeline(2))
    assert second.schedule is not None and set(second.ops.stage) == {0, 1}
    assert second.ops.split.isna().all()
    assert list(first.ops.split) == splits and first.graph is not second.graph
    assert first.sources[0] != second.sources[0]


def test_plan_json_is_what_parallelize_writes(tmp_path):
    p = nbscaler.plan(build("llama"), batch("llama", 0), "tp", ComputeConfig(2, 2))
    parallelize(build("llama"), batch("llama", 0), "tp", ComputeConfig(2, 2), gen_savedir=tmp_path, load_module=False)
    saved = json.loads((module_dir(type(build("llama")), tmp_path, None) / PLAN_FILE).read_text())
    assert saved["format_version"] == nbscaler.planning.PLAN_FORMAT_VERSION == 1
    assert saved == json.loads(json.dumps(p.to_json(), default=str))
    assert saved["weights"]["blocks.0.attn.q.weight"]["layout"] == "S(0)"


def test_explain_and_html_name_the_policy():
    p = nbscaler.plan(build("mlp"), batch("mlp", 0), "tp", ComputeConfig(2, 2))
    assert "under 'tp'" in p.explain() and "split ops" in p.explain()
    assert "Plan(tests.models.MLP" in p._repr_html_()


@pytest.mark.slow
def test_summary_has_the_contract_columns_and_the_cost_models_numbers():
    p = nbscaler.plan(build("llama"), batch("llama", 0), "tp", ComputeConfig(2, 4))
    s = p.summary(optimizer=torch.optim.AdamW)
    assert list(s.columns) == ["rank", "flops", "bytes_sent", "bytes_received", "param_bytes", "grad_bytes",
                               "optimizer_bytes", "buffer_bytes", "activation_bytes", "gathered_bytes", "peak_bytes",
                               "step_time_s"]
    assert list(s["rank"]) == [0, 1, 2, 3]
    memory = p.memory(torch.optim.AdamW)
    assert s[memory.columns].equals(memory)
    # two units: each rank also all-reduces its gradients with its twin in the other unit
    from nbscaler.planning.tables import edge_traffic_per_device
    sent, _ = edge_traffic_per_device(p)[0]
    assert s.bytes_sent[0] == sent + 2 * (1 / 2) * s.param_bytes[0]
    assert (s.step_time_s > 0).all() and (s.flops > 0).all()
