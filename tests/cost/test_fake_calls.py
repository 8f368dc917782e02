"""A replay that makes calls again from their records (``cost.fake_calls``) must read exactly what
dispatching every call on fake tensors reads: shapes, collectives, saved storages and bytes."""

import pytest
import torch
import torch.nn as nn

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.cost.fake_calls import FakeCalls, FakeValue, call_key
from nbscaler.cost.local import run_local
from nbscaler.cost.memory import train_graph
from tests.models import batch, build


def _facts(run):
    """A run's facts, its storages by their order (keys are the replay's own numbers)."""
    order = {k: i for i, k in enumerate(run.saved)}
    ops = [(op.node.name, op.in_shapes, op.out_shapes, op.saved_bytes, op.recomputed,
            tuple(order[k] for k in op.saved_keys)) for op in run.ops]
    return ops, run.collectives, list(run.saved.values()), run.exact, run.rebuilt


def _sections(model, policy, cfg):
    p = nbscaler.plan(build(model), batch(model, 0), policy, cfg)
    graph = train_graph(p.graphs)
    return [s for d in range(cfg.plan_ngpus) for s in p.programs.device(d).sections if s.graph is graph]


PIPELINE = dict(use_end2end=True, use_pipeline=True, pipeline_nstages=2, pipeline_nmicros=2, pipeline_scheduler="1f1b")


@pytest.mark.parametrize("model, policy, cfg", [
    ("llama", "tp", ComputeConfig(2, 2)),
    ("cnn", "dp", ComputeConfig(1, 2)),
    ("llama_e2e", "hybrid", ComputeConfig(4, 4, **PIPELINE, pas_config={"recompute_modules": ["llama.blocks"],
                                                                         "sequence_parallel": True})),
    ("post_norm", "hybrid", ComputeConfig(2, 2, **PIPELINE)),
])
def test_remembered_calls_replay_as_dispatched_ones(model, policy, cfg):
    calls = FakeCalls()
    for section in _sections(model, policy, cfg):
        dispatched = run_local(section, calls=None)
        first = run_local(section, calls=calls)          # records what it dispatches
        again = run_local(section, calls=calls)          # every call from a record
        assert _facts(first) == _facts(again) == _facts(dispatched)
    assert calls.records


class InPlace(nn.Module):
    """An op that changes its input in place, then reads it: such a call is never remembered."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        h = self.fc(x).relu()
        h.mul_(2.0)
        return self.fc(h).sigmoid().sum()


def test_a_call_that_changes_its_input_in_place_is_dispatched_each_time():
    p = nbscaler.plan(InPlace(), {"x": torch.randn(4, 8)}, "dp", ComputeConfig(1, 1))
    section = p.programs.device(0).sections[0]
    calls = FakeCalls()
    runs = [run_local(section, calls=calls) for _ in range(2)] + [run_local(section, calls=None)]
    assert _facts(runs[0]) == _facts(runs[1]) == _facts(runs[2])
    assert not any(key[0][0] == "Tensor.mul_" for key in calls.records)
    assert any(key[0][0] == "torch.sigmoid" or key[0][0] == "Tensor.sigmoid" for key in calls.records)


def test_keys_tell_apart_what_the_op_would_see():
    x, y = FakeValue.made((2, 3), torch.float32), FakeValue.made((2, 3), torch.float32)
    key = lambda *args: call_key("f", args, {}, [x, y])
    assert key(x, 1) != key(x, 1.0) != key(x, True)
    assert key(x, 0.0) != key(x, -0.0)
    assert key(x, y) != key(y, x)
    assert key(x, object()) is None                   # an argument it cannot write down: dispatched
    same = call_key("f", (x, x), {}, [x, x])
    two = call_key("f", (x, y), {}, [x, y])
    assert same != two                                 # one storage read twice, or two storages



def test_a_user_op_registered_again_under_its_name_is_replayed_anew():
    """A notebook that registers a new version of its op (the same module and name) replays the new one."""
    from nbscaler import register_op

    def widen(x):
        return torch.cat([x, x], dim=-1)       # (B, 8) -> (B, 16)

    def keep(x):
        return x * 2.0                         # (B, 8) -> (B, 8)

    class Model(nn.Module):
        def __init__(self, op):
            super().__init__()
            self.fc, self.op = nn.Linear(8, 8), op

        def forward(self, x):
            return self.op(self.fc(x)).sum()

    shapes = []
    for fn in (widen, keep):
        fn.__qualname__ = "again"                               # one name for both
        p = nbscaler.plan(Model(register_op("b d -> b e")(fn)), {"x": torch.randn(4, 8)}, "dp", ComputeConfig(1, 1))
        run = run_local(p.programs.device(0).sections[0])
        shapes += [op.out_shapes[0][0] for op in run.ops if op.node.target.endswith(".again")]
    assert shapes == [(4, 16), (4, 8)]


@pytest.mark.parametrize("model", ["moe", "moe_capacity"])
@pytest.mark.parametrize("pas", [{"expert_parallel": 4}, {"expert_parallel": 2, "expert_tensor_parallel": 2}])
def test_the_fake_expert_call_sends_what_the_traffic_table_prices(model, pas, monkeypatch):
    """The replay runs the runtime's expert-parallel call with a planned group: the rows it sends
    each way (each pair to every device of its expert's group) are the bytes ``exchanged_bytes``
    prices, so the memory model and the traffic table count the same exchange."""
    from nbscaler.experts import parallel
    from nbscaler.ir.expert_rules import EXPERT_OPS, exchanged_bytes
    sent, exchange = [], parallel._exchange

    def recorded(rows, send, receive, group):
        if isinstance(group, parallel.PlannedGroup):
            sent.append(sum(send) * rows[0].numel() * rows.element_size())
        return exchange(rows, send, receive, group)

    monkeypatch.setattr(parallel, "_exchange", recorded)
    plan = nbscaler.plan(build(model), batch(model, 0, 16), "tp", ComputeConfig(4, 4, pas_config=pas))
    plan.local_runs
    priced = {exchanged_bytes(n) for n in plan.graph.nodes if n.target in EXPERT_OPS}
    assert sent and set(sent) == priced, (sent, priced)
