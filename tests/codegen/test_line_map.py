"""Code generation says which lines of each rank's file run each node, so views can point at them."""

import nbscaler
from nbscaler import ComputeConfig
from tests.models import batch, build


def test_source_lines_point_at_each_nodes_call_and_its_collectives():
    p = nbscaler.plan(build("mlp"), batch("mlp", 0), "tp", ComputeConfig(2, 2))
    for rank, per_node in p.source_lines.items():
        text = p.sources[rank].splitlines()
        assert set(per_node) == set(range(len(p.graph)))          # tp: every rank runs every node
        for i, lines in per_node.items():
            node = p.graph.nodes[i]
            assert lines == list(range(lines[0], lines[-1] + 1))  # one contiguous block
            assert text[lines[-1] - 1].strip().startswith(node.output_tensors[0].name)
            assert all(text[k - 1].strip().split(" = ")[1].startswith("comm.") for k in lines[:-1])
    assert any(len(lines) > 1 for lines in p.source_lines[0].values())   # some input needed a collective
    assert p.rank_nodes(1) == sorted(p.source_lines[1])


def test_a_pipeline_rank_has_lines_only_for_its_stage():
    cfg = ComputeConfig(2, 2, use_end2end=True, use_pipeline=True, pipeline_nmicros=2, pipeline_nstages=2)
    p = nbscaler.plan(build("mlp"), batch("mlp", 0), "pp", cfg)
    stages = {r: {p.graph.nodes[i].stage for i in per_node} for r, per_node in p.source_lines.items()}
    assert stages == {0: {0}, 1: {1}}
    assert set(p.source_lines[0]) | set(p.source_lines[1]) == set(range(len(p.graph)))
    assert all(p.rank_nodes(r) == sorted(p.source_lines[r]) for r in (0, 1))
