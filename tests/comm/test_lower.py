"""The lowered program: one walk of the placement that code generation, the cost model and the
traffic table all read."""

import math
import re
from collections import Counter

import pytest
import torch

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.comm.layout import Layout, LocalStep, Step, effective_requirement, keeps_partial_grad, local_steps
from nbscaler.comm.lower import LoweringError, SectionLowering, lower_device
from nbscaler.comm.program import Call, Recompute, Return, Send, output_shapes
from nbscaler.cost.comm_model import CommModel
from nbscaler.cost.local import run_local
from nbscaler.ir.graph import Placement
from nbscaler.layouts import Collective
from nbscaler.policy import get_policy
from nbscaler.policy.autodist.costs import ChoiceCosts
from tests.conftest import model_plan
from tests.models import batch, build


PLAN = dict(name="llama", policy="tp", config=ComputeConfig(2, 4))      # the tests below only read it


def _steps(section):
    return [c.step.fn for f in section.fetches() for c in f.steps]


def test_ranks_playing_one_device_share_its_program_and_it_is_lowered_once(plan):
    p = plan
    assert p.programs[0] is p.programs[2] and p.programs[1] is p.programs[3]
    assert p.programs is p.programs and p.programs[1].device == 1


def test_the_rank_file_calls_exactly_the_collectives_of_the_program(plan):
    p = plan
    for rank in (0, 1):
        printed = Counter(re.findall(r"= comm\.(\w+)\(", p.sources[rank]))
        lowered = Counter(str(fn) for sec in p.programs[rank].sections for fn in _steps(sec))
        assert printed == lowered and lowered[Collective.SUM_GRAD] > 0


def test_the_cost_model_replays_every_call_and_collective_of_the_program(plan):
    p = plan
    program = p.programs[1]
    sec = program.sections[0]
    run = run_local(sec)
    assert [op.node for op in run.ops] == [c.node for c in sec.calls()]
    assert [tuple(v.shape) for c in sec.calls() for v in c.outputs] == [s for op in run.ops for s, _ in op.out_shapes]
    assert [c.fn for c in run.collectives] == _steps(sec)
    assert run.device == 1 and run.saved_bytes > 0


def test_a_sum_gradient_request_of_a_tensor_without_gradient_is_plain_replicated(plan):
    """The token ids reach the tensor-parallel embedding without a gradient: no ``sum_grad`` for them."""
    p = plan
    sec = p.programs[0].sections[0]
    ids = sec.graph.inputs[0]
    assert not ids.dtype.is_floating_point
    assert all(f.want.kind != "R*" for f in sec.fetches() if f.tensor is ids)
    assert any(f.want.kind == "R*" for f in sec.fetches())


def test_weight_table_holds_local_shapes_and_the_slice_of_the_original(plan):
    p = plan
    table = {w.name: w for w in p.programs[1].weights}
    split = [w for w in table.values() if w.layout.kind == "S"]
    assert split, "tp splits some weights"
    for w in split:
        assert w.shape[w.layout.dim] * len(w.devices) == w.full_shape[w.layout.dim] and w.index == 1
        assert f"split_dim={w.layout.dim}, parts={len(w.devices)}, index=1" in p.sources[1]
    assert list(table) == [n for n in p.graph.weights if n in table]     # the order of module.parameters()


def test_a_pipeline_stage_receives_and_sends_and_a_recomputed_region_is_one_instruction():
    torch.manual_seed(0)
    cfg = ComputeConfig(2, 2, use_end2end=True, use_pipeline=True, pipeline_nstages=2, pipeline_nmicros=2,
                        pipeline_scheduler="1f1b", pas_config={"recompute_modules": ["gpt.blocks"]})
    p = nbscaler.plan(build("gpt"), batch("gpt", 0), "pp", cfg)
    first, last = p.programs[0].section("any", 0), p.programs[1].section("any", 1)
    assert isinstance(first.instructions[-1], Send) and isinstance(last.instructions[-1], Return)
    assert type(last.instructions[0]).__name__ == "Receive"
    regions = [i for i in first.instructions if isinstance(i, Recompute)]
    assert regions and all(isinstance(c, Call) and c.region == r.region for r in regions for c in r.body)
    assert len(regions) == p.sources[0].count("= checkpoint(")


def test_a_tensor_read_before_any_device_makes_it_is_a_clear_error():
    p = model_plan("mlp", "tp", ComputeConfig(2, 2))
    program = lower_device(p.graphs, p.storage, 0, None)
    sec = program.sections[0]
    sec.instructions.clear()
    lowering = SectionLowering(sec, p.storage, {})
    with pytest.raises(LoweringError, match="used before it is computed on device 0"):
        lowering.fetch(p.graph.nodes[-1].output_tensors[0], sec.weights[0].layout, (0, 1), None, 0)


def _unblocked_projection(graph, cfg):
    """``tp``, but the fused q, k, v projection split as one block: its output is gathered whole
    and cut again in blocks for the ``split`` that reads it."""
    graph = get_policy("tp")(graph, cfg)
    fused = graph.nodes[0]
    fused.placement = Placement(fused.placement.devices, fused.placement.split)
    return graph


def test_autodist_prices_each_collective_on_the_local_bytes_of_the_lowered_values():
    """An all_gather then a chunk: the chunk reads the whole tensor the gather made, so its
    backward (an all_gather of the chunk's piece) moves half the tensor, not a quarter."""
    p = nbscaler.plan(build("fused_gqa"), batch("fused_gqa", 0), _unblocked_projection, ComputeConfig(2, 2))
    fetch = next(f for f in p.programs[0].sections[0].fetches() if len(f.steps) == 2)
    assert [c.step.fn for c in fetch.steps] == [Collective.ALL_GATHER, Collective.CHUNK]
    comm = CommModel(alpha_s=1e-4, beta_s_per_byte=1e-9)
    local = lambda value: math.prod(value.shape) * value.tensor.dtype.itemsize
    lowered = sum(comm.forward(c.step.fn, local(c.src), 2) + comm.backward(c.step.fn, local(c.src), 2)
                  for c in fetch.steps)
    costs = ChoiceCosts(p.graph, (0, 1), None, comm, state_factor=0.0)
    reader = fetch.consumer
    assert costs.edge_seconds(costs.layout_id(fetch.have), reader, fetch.position, reader.placement.split) == lowered


def test_the_rules_lowering_and_autodist_share():
    R, sum_grad = Layout.replicated(), Layout("R*")
    assert effective_requirement(sum_grad, carries_grad=False) == R        # nothing to sum
    assert effective_requirement(sum_grad, carries_grad=True) == sum_grad
    assert keeps_partial_grad(sum_grad, is_param=True, partial_grads=True)
    assert not keeps_partial_grad(sum_grad, is_param=True, partial_grads=False)     # ZeRO stage 2
    assert local_steps(Layout.split(1), Layout.split(1, 2), (4, 4), 2) == [
        LocalStep(Step(Collective.ALL_GATHER, dim=1), (4, 4), (4, 8)),
        LocalStep(Step(Collective.CHUNK, dim=1, blocks=2), (4, 8), (4, 4))]


def test_the_ops_table_reads_local_shapes_off_the_programs():
    p = model_plan("llama", "tp", ComputeConfig(2, 2))
    made = {c.node.name: [v.shape for v in c.outputs] for c in p.programs[0].sections[0].calls()}
    rows = dict(zip(p.ops.name, p.ops.local_out_shapes))
    assert made and all(rows[name] == shapes for name, shapes in made.items())
    assert output_shapes(p.programs.distinct(), p.graph).keys() == {id(n) for n in p.graph.nodes}
