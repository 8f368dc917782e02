"""The IR says which ops' gradients a split backward runs in B, in W, or in both."""

from nbscaler import ComputeConfig
from nbscaler.ir.backward_split import BackwardPart, mark_backward_split
from nbscaler.models import gpt
from tests.conftest import gpt_plan

CFG = gpt.GPTConfig(vocab_size=64, seq_len=16, n_layer=2, d_model=32, n_head=4)


def _plan(scheduler: str, nstages: int = 2):
    cfg = ComputeConfig(2, 2, use_end2end=True, use_pipeline=True, pipeline_scheduler=scheduler,
                        pipeline_nstages=nstages, pipeline_nmicros=2)
    return gpt_plan("pp", cfg, model=CFG)


def test_zb_h1_labels_the_data_path_b_and_its_weighted_ops_both():
    """Stage 0 reads tokens, which have no gradient: all of its backward is W. In stage 1 (block 1
    and the head) every op with weights is B+W (its input gradient in B, its weights' in W): the
    six the runtime starts a W from in a GPT block (qkv, attention projection, two LayerNorms, the
    MLP's two linears; tests/runtime/test_split_backward.py), then ln_f and the head; the rest of
    the data path is B."""
    ops = _plan("zb_h1").ops
    first, second = ops[ops.stage == 0], ops[ops.stage == 1]
    assert set(first.backward_part) == {BackwardPart.W, BackwardPart.NONE}       # the position ids: no gradient
    both = second[second.backward_part == BackwardPart.BOTH]
    assert list(both.module) == ["blocks.1.ln1", "blocks.1.attn.qkv", "blocks.1.attn.proj", "blocks.1.ln2",
                                 "blocks.1.mlp.fc", "blocks.1.mlp.proj", "ln_f", "head"]
    assert set(second.backward_part) - {BackwardPart.BOTH} == {BackwardPart.B, BackwardPart.NONE}
    assert set(second[second.op.isin(["attention", "elementwise", "loss"])].backward_part) == {BackwardPart.B}


def test_only_split_schedules_say_it_and_the_pass_stands_alone():
    """A 1F1B plan has no B/W split to show; the pass itself runs on any staged graph."""
    plan = _plan("1f1b")
    assert plan.ops.backward_part.isna().all()
    mark_backward_split(plan.graph)
    assert plan.graph.nodes[-1].meta["backward_part"] == BackwardPart.B
    assert _plan("zbv", 4).ops.backward_part.notna().all()
