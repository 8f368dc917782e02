"""Under ``tp`` (and ``hybrid``) the output head and the cross-entropy are split by vocabulary, as
Megatron-LM splits them: the head's column-parallel logits go straight into
``nbscaler.runtime.vocab.vocab_cross_entropy`` and are never gathered, so each device keeps only
its share of the largest activation of a language model. Training still equals one process
(``tests.multiprocess.check_equivalence``: losses, merged gradients and parameters over 3 steps).
"""

import pytest

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
             Case("hf_llama", "hybrid", 4, 4, config=pipeline("1f1b", 2, 4)),
             Case("hf_gpt2", "hybrid", 4, 4, config=pipeline("1f1b", 2, 4))]     # its position table whole
    per_rank = run_ranks(train_parallel, 4, cases, str(tmp_path), timeout=600)
    for i, case in enumerate(cases):
        check_equivalence(case, [res[i] for res in per_rank])


def _embedding_collectives(plan):
    """The collectives on the outputs of the plan's embeddings (forward and backward)."""
    made_by_lookup = plan.collectives.producer.astype(str).str.startswith("embedding")
    return plan.collectives[made_by_lookup]


VOCABULARY = {"gpt": ["gpt.tok.weight"], "hf_gpt2": ["model.transformer.wte.weight"], "llama": ["embed.weight"],
              "hf_llama": ["model.model.embed_tokens.weight"],
              "hf_bert": []}         # its word table has a padding_idx, whose lookup stays whole


@pytest.mark.parametrize("model", VOCABULARY)
@pytest.mark.parametrize("policy, config", [("tp", {}), ("hybrid", dict(use_end2end=True, use_pipeline=True,
                                                                          pipeline_nmicros=2, pipeline_nstages=2))])
def test_only_the_vocabulary_is_split_so_the_embeddings_output_is_summed_once(model, policy, config):
    """Only the table the token ids index is split by rows; a table the model indexes itself
    (GPT-2's and BERT's learned positions, BERT's token types) stays whole, as Megatron-LM keeps its
    position embedding, so the residual stream starts with one all-reduce of its partial sums
    instead of one per table (and none where no table is split)."""
    ngpus = 4 if config else 2
    plan = nbscaler.plan(build(model), batch(model, 0), policy, ComputeConfig(ngpus, ngpus, **config))
    split = [n.inputs[1].name for n in plan.graph.nodes if n.op == "embedding" and n.placement.split == "v"]
    assert split == VOCABULARY[model]
    collectives = _embedding_collectives(plan)
    assert collectives[["collective", "phase"]].values.tolist() == [["all_reduce", "F"]] * len(split), collectives
    forwards = len(plan.graphs)                                   # training and evaluation
    assert plan.sources[0].count("comm.all_reduce(embedding_") == forwards * len(split)


@pytest.mark.parametrize("policy, ngpus, config", [("tp", 2, {}), ("tp", 4, {}),
                                                   ("hybrid", 4, dict(use_end2end=True, use_pipeline=True,
                                                                      pipeline_nmicros=2, pipeline_nstages=2))])
def test_a_lookup_read_whole_by_several_consumers_is_all_reduced_once(policy, ngpus, config):
    """A post-norm model's first attention reads the embedding directly: its column-parallel
    projection wants the partial sums whole with summed gradients (``R*``), the residual add wants
    them whole (``R``). One all-reduce makes the whole and ``sum_grad`` marks the projection's
    copy, rather than an all-reduce for each (a second collective of the whole activation)."""
    plan = nbscaler.plan(build("post_norm"), batch("post_norm", 0), policy, ComputeConfig(ngpus, ngpus, **config))
    collectives = _embedding_collectives(plan)
    assert collectives[["collective", "phase"]].values.tolist() == [["all_reduce", "F"], ["sum_grad", "F"],
                                                                    ["all_reduce", "B"]], collectives
    code = plan.sources[0]                                        # training and evaluation forwards
    assert code.count("comm.all_reduce(embedding_0") == len(plan.graphs)
    assert code.count("comm.sum_grad(embedding_0_full") == 1      # evaluation sums no gradient


@pytest.mark.multiprocess
@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_a_lookup_read_by_several_consumers_trains_like_one_process(nranks, tmp_path):
    """The one all-reduce of the lookup serves both consumers, forward and backward, on 1, 2 and 4
    ranks, sequence parallelism included (its slice of the residual is then a chunk of that whole)."""
    cases = {1: [Case("post_norm", "tp", 1, 1)],
             2: [Case("post_norm", "tp", 2, 2), Case("post_norm", "tp", 2, 2, config=sequence_parallel())],
             4: [Case("post_norm", "tp", 4, 4), Case("post_norm", "hybrid", 4, 4, config=pipeline("1f1b", 2, 4)),
                 Case("post_norm", "tp", 2, 4, config=sequence_parallel())]}[nranks]
    per_rank = run_ranks(train_parallel, nranks, cases, str(tmp_path), timeout=600)
    for i, case in enumerate(cases):
        check_equivalence(case, [res[i] for res in per_rank])
