"""A call's arguments as one device makes them: code generation prints them and the cost model
calls the op with them, both from the shapes the rank's program holds."""

import pytest

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.comm.arguments import local_arguments
from nbscaler.cost.local import run_local
from nbscaler.ir.registry import spec_of
from tests.models import batch, build


def test_a_view_asks_for_the_local_shape_its_output_value_holds():
    p = nbscaler.plan(build("llama"), batch("llama", 0), "tp", ComputeConfig(2, 2))
    sec = p.programs[1].sections[0]
    views = [c for c in sec.calls() if spec_of(c.node.target) is not None and spec_of(c.node.target).shape_args]
    split = [c for c in views if c.outputs[0].shape != tuple(c.node.output_tensors[0].shape)]
    assert split, "tp splits the heads some views make"
    for c in split:
        args, kwargs = local_arguments(c.node, ("x",), {"shape": (0,)}, c.outputs[0].shape)
        assert args == ("x", c.outputs[0].shape) and kwargs == {}
        assert f".{c.node.target.split('.')[-1]}({c.outputs[0].shape})" in p.sources[1]     # the rank file's call
    replayed = {id(op.node): op.out_shapes[0][0] for op in run_local(sec).ops if op.out_shapes}
    assert all(tuple(replayed[id(c.node)]) == c.outputs[0].shape for c in split)


@pytest.mark.slow
def test_a_chunk_split_in_strided_blocks_keeps_its_count():
    """A chunk cut in strided blocks (Hugging Face's experts' ``gate_up_proj.chunk(2, dim=1)`` under
    tensor-parallel experts) still makes 2 pieces on each device, of its half of each block; a
    ``split`` of the same blocks passes sizes, which shrink with the parts."""
    p = nbscaler.plan(build("hf_mixtral"), batch("hf_mixtral", 0), "tp", ComputeConfig(2, 2))
    chunks = [n for n in p.graph.nodes if n.target == "Tensor.chunk" and "experts" in n.module_path]
    assert chunks and all(n.placement.split == "h" for n in chunks)
    for node in chunks:
        assert local_arguments(node, node.args, node.kwargs, ())[0] == node.args
    assert "_gate_up_proj.chunk(2, dim=1)" in p.sources[1] and "blocks=2" in p.sources[1]
