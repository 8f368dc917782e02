"""A parameter read in two pipeline stages (a tied embedding and output head) becomes a copy on
each stage whose gradients are summed between the stages."""

import pytest

from nbscaler import ComputeConfig
from nbscaler.planning.planner import plan
from tests.models import batch, build
from tests.multiprocess import pipeline


@pytest.mark.slow       # a second or so: make test runs it, the edit-test loop does not
def test_tied_embedding_has_a_copy_per_stage_with_summed_gradients():
    cfg = ComputeConfig(plan_ngpus=2, runtime_ngpus=2, **dict(pipeline("1f1b", 2, 2)))
    p = plan(build("hf_gpt2"), batch("hf_gpt2", 0), "pp", cfg)
    readers = {n.stage for n in p.graph.nodes for t in n.inputs if t.name == "model.transformer.wte.weight"}
    assert readers == {0, 1}
    for rank in (0, 1):
        code = p.sources[rank]
        spec = next(line for line in code.splitlines() if "'model.transformer.wte.weight'" in line)
        assert f"devices=({rank},)" in spec and "replicas=(0, 1)" in spec
        assert "(0, 1)" in next(line for line in code.splitlines() if "device_groups" in line)
