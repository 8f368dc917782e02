"""Under ``tp`` (and ``hybrid``) the output head and the cross-entropy are split by vocabulary, as
Megatron-LM splits them: the head's column-parallel logits go straight into
``nbscaler.runtime.vocab.vocab_cross_entropy`` and are never gathered, so each device keeps only
its share of the largest activation of a language model. Training still equals one process
(``tests.multiprocess.check_equivalence``: losses, merged gradients and parameters over 3 steps).
"""

import pytest
import torch

import nbscaler
from nbscaler import ComputeConfig
from tests.models import batch, build
from tests.multiprocess import Case, check_equivalence, pipeline, run_ranks, sequence_parallel, train_parallel

LANGUAGE_MODELS = ["gpt", "llama", "hf_llama"]


def _loss_node(plan):
    return next(n for n in plan.graph.nodes if n.target == "torch.nn.functional.cross_entropy")


@pytest.mark.parametrize("model", LANGUAGE_MODELS)
def test_tp_splits_the_loss_by_vocabulary_and_never_gathers_the_logits(model):
    plan = nbscaler.plan(build(model), batch(model, 0), "tp", ComputeConfig(plan_ngpus=2, runtime_ngpus=2))
    loss = _loss_node(plan)
    assert loss.placement.split == "c" and loss.placement.parts == 2
    code = plan.sources[1]
    assert "vocab_cross_entropy(" in code and ", 32, g0_1, ignore_index=" in code      # rank 1 holds classes 32..63
    moved = plan.collectives[plan.collectives["tensor_bytes"] >= loss.inputs[0].nbytes]
    assert moved.empty, moved                                   # nothing of the logits' size moves
    assert plan.collectives.iloc[-1]["tensor"] == loss.name     # the devices' parts of the loss, summed


@pytest.mark.multiprocess
def test_vocab_parallel_loss_trains_like_one_process_on_two_ranks(tmp_path):
    cases = [Case("gpt", "tp", 2, 2), Case("llama", "tp", 2, 2), Case("hf_llama", "tp", 2, 2),
             Case("gpt", "tp", 2, 2, config=sequence_parallel())]
    per_rank = run_ranks(train_parallel, 2, cases, str(tmp_path), timeout=600)
    for i, case in enumerate(cases):
        check_equivalence(case, [res[i] for res in per_rank])


@pytest.mark.multiprocess
def test_vocab_parallel_loss_trains_like_one_process_on_four_ranks(tmp_path):
    """Four-way splits of the vocabulary, and two stages of two-way splits (the loss in the last)."""
    cases = [Case("gpt", "tp", 4, 4), Case("llama", "tp", 4, 4), Case("hf_llama", "tp", 4, 4),
             Case("hf_llama", "hybrid", 4, 4, config=pipeline("1f1b", 2, 4))]
    per_rank = run_ranks(train_parallel, 4, cases, str(tmp_path), timeout=600)
    for i, case in enumerate(cases):
        check_equivalence(case, [res[i] for res in per_rank])
