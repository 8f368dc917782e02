"""A parameter read in two pipeline stages (a tied embedding and output head) becomes a copy on
each stage whose gradients are summed between the stages."""

import pytest

from nbscaler import ComputeConfig
from nbscaler.planning.planner import plan
from tests.models import batch, build
from nbscaler.policy.primitives import PolicyError
from tests.multiprocess import pipeline, zero


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


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_that_frees_gradients_in_the_backward_refuses_weights_tied_across_stages(stage):
    """The copies' gradients are summed after the backward, which ZeRO-2 and ZeRO-3 reduce-scatter
    and free during it: the copies would train apart (they did, by 1e-3 in a step's loss), so the
    plan is refused by name, with the fix; ZeRO-1 reduces at the step and plans."""
    cfg = ComputeConfig(plan_ngpus=2, runtime_ngpus=4, **dict(pipeline("1f1b", 2, 2) + zero(1, stage)))
    with pytest.raises(PolicyError, match=r"model\.transformer\.wte\.weight \(stages 0, 1\).*Use zero_stage=1"):
        plan(build("hf_gpt2"), batch("hf_gpt2", 0), "pp", cfg)
    plan(build("hf_gpt2"), batch("hf_gpt2", 0), "pp", cfg.with_changes(zero_stage=1))
