"""A routing's imbalance as a parameter of a prediction (``Recipe(expert_imbalance=...)``): every
device of a dropless expert-parallel op priced as the busiest, whose experts get that many times the
mean of the (token, expert) pairs; capacity routing and experts held whole on every device are not
moved by it. Its memory is checked against the meter in ``test_memory``."""

import pytest

import nbscaler
from nbscaler import ComputeConfig, Hardware, Recipe
from nbscaler.cost.roofline import RooflineOps
from nbscaler.ir.expert_rules import EXPERT_OPS, exchanged_bytes
from nbscaler.layouts import Collective
from nbscaler.space import PlanSpace
from tests.models import batch, build

H100 = Hardware.named("H100-SXM-80GB")


def plan_of(model: str, pas: dict, policy: str = "tp"):
    return nbscaler.plan(build(model), batch(model, 0, 8), policy, ComputeConfig(2, 2, pas_config=pas))


def expert_calls(plan, recipe):
    run = plan.runs_for(recipe)[0][None]
    ops = [op for op in run.ops if op.node.target in EXPERT_OPS]
    exchanges = [c for c in run.collectives if c.fn == Collective.EXPERT_EXCHANGE]
    return ops, exchanges


def test_the_busiest_device_of_a_dropless_routing_is_priced_for_every_device():
    plan = plan_of("moe", {"expert_parallel": 2})
    even, heavy = Recipe(expert_imbalance=1.0), Recipe(expert_imbalance=1.5)
    (ops, exchanges), (heavy_ops, heavy_exchanges) = expert_calls(plan, even), expert_calls(plan, heavy)
    assert [op.scale for op in ops] == [1.0, 1.0] and [op.scale for op in heavy_ops] == [1.5, 1.5]
    roofline = RooflineOps(H100)
    for op, slow in zip(ops, heavy_ops):                       # its experts' products: half again as long
        assert roofline.time(slow) == pytest.approx(tuple(1.5 * t for t in roofline.time(op)))
    rows = exchanged_bytes(ops[0].node)
    assert {c.in_bytes for c in exchanges} == {rows} and {c.in_bytes for c in heavy_exchanges} == {round(1.5 * rows)}
    memory = [plan.memory(recipe=r).activation_bytes.iloc[0] for r in (even, heavy)]
    steps = [plan.summary(recipe=r, hardware=H100).step_time_s.iloc[0] for r in (even, heavy)]
    assert memory[1] > memory[0] and steps[1] > steps[0]
    assert plan.runs_for(heavy) is plan.runs_for(Recipe(expert_imbalance=1.5))      # replayed once


@pytest.mark.parametrize("model, pas, policy", [("moe_capacity", {"expert_parallel": 2}, "tp"),   # fixed buffers
                                                ("moe", {}, "tp"), ("moe", {}, "data")])          # every expert here
def test_capacity_routing_and_experts_held_on_every_device_are_not_moved(model, pas, policy):
    plan = plan_of(model, pas, policy)
    figures = [(plan.memory(recipe=r).peak_bytes.tolist(), plan.summary(recipe=r, hardware=H100).step_time_s.tolist())
               for r in (Recipe(expert_imbalance=1.0), Recipe(expert_imbalance=2.0))]
    assert figures[0] == figures[1]


@pytest.mark.parametrize("value", [0.5, True, float("inf"), "1.2"])
def test_an_imbalance_below_one_or_not_a_number_is_refused(value):
    with pytest.raises(ValueError, match="Recipe\\(expert_imbalance="):
        Recipe(expert_imbalance=value)


def test_the_plan_space_refuses_an_imbalance_it_cannot_price():
    with pytest.raises(ValueError, match="a plan space prices balanced routing"):
        PlanSpace(build("moe_e2e"), batch("moe_e2e", 0), H100, global_batch=8, recipe=Recipe(expert_imbalance=1.3))
