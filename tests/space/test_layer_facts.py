"""The plan space prices a cut of the two-layer copy as a pipeline stage without placing it again:
the stages of the cut are given to the functions that read them, and the graph is left alone."""

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.ir.graph import IRNode
from nbscaler.space.layer_facts import _carried, _replay_span
from tests.models import batch, build


def test_a_span_is_priced_as_a_stage_without_rewriting_the_graph(monkeypatch):
    p = nbscaler.plan(build("llama"), batch("llama", 0), "tp", ComputeConfig(2, 2))
    graph = p.graph

    def refuse_stage(node, name, value):
        assert name != "stage", "pricing a cut rewrote a node's stage"
        object.__setattr__(node, name, value)

    monkeypatch.setattr(IRNode, "__setattr__", refuse_stage)
    shapes = {w.name: w.shape for w in p.programs[0].weights}
    run = _replay_span(graph, slice(10, 30), 0, p.storage, shapes)
    assert [op.node for op in run.ops] == [n for n in graph.nodes[10:30] if 0 in n.placement.devices]
    before = {id(t) for n in graph.nodes[:20] for t in n.output_tensors}
    crossing = _carried(graph, 20)
    assert crossing and all(id(t) in before for t in crossing)
    assert {n.stage for n in graph.nodes} == {None}
