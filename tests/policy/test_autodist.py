"""autodist: plans that train like one process, a deterministic search, limits, pins and plan files."""

import json

import pytest
import torch

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.policy import PolicyError
from nbscaler.policy.autodist import AutodistOptions, balanced_cuts
from tests.models import batch, build
from tests.multiprocess import Case, check_equivalence, pipeline, run_ranks, train_parallel

AUTODIST = {
    1: [Case(m, "autodist", 1, 1) for m in ("mlp", "llama", "cnn")],
    2: [Case(m, "autodist", 2, 2) for m in ("mlp", "llama", "cnn")] +
       [Case("gpt", "autodist", 2, 2, config=pipeline("1f1b", 2, 4)),
        Case("llama", "autodist", 2, 2, config=(("pas_config", {"autodist_plan_ngpus": 1}),))],
    4: [Case("mlp", "autodist", 4, 4), Case("llama", "autodist", 2, 4), Case("cnn", "autodist", 4, 4),
        Case("gpt", "autodist", 4, 4, config=pipeline("1f1b", 2, 4)),
        Case("gpt", "autodist", 4, 4, config=pipeline("1f1b", 2, 4) + (("pas_config", {"autodist_nstages": "auto"}),)),
        Case("cnn", "autodist", 4, 4, config=(("pas_config", {"autodist_plan_ngpus": 2}),))],
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("nranks", [1, 2, 4])
def test_autodist_trains_like_one_process(nranks, tmp_path):
    cases = AUTODIST[nranks]
    per_rank = run_ranks(train_parallel, nranks, cases, str(tmp_path))
    for i, case in enumerate(cases):
        check_equivalence(case, [res[i] for res in per_rank])


def splits(p):
    """Each op's (name, split, stage), of a plan's graph or of one graph."""
    return [(n.name, n.placement.split, n.stage) for n in (p.nodes if hasattr(p, "nodes") else p.graph.nodes)]


@pytest.mark.slow       # a second or so: make test runs it, the edit-test loop does not
def test_same_model_config_and_profile_give_the_same_plan():
    # A tight memory limit makes the search split (unlimited, this tiny model is fastest replicated).
    model, args = build("mlp"), batch("mlp", 0)
    whole = nbscaler.plan(model, args, "dp", ComputeConfig(1, 1)).memory(torch.optim.AdamW).peak_bytes.max()
    cfg = ComputeConfig(2, 2, pas_config={"memory_limit_bytes": int(whole * 0.75)})
    first, again = nbscaler.plan(model, args, "autodist", cfg), nbscaler.plan(model, args, "autodist", cfg)
    assert splits(first) == splits(again)
    assert any(split is not None for _, split, _ in splits(first))


@pytest.mark.slow
def test_explain_gives_the_search_the_prediction_and_the_reasons():
    p = nbscaler.plan(build("mlp"), batch("mlp", 0), "autodist", ComputeConfig(2, 2))
    text = p.explain()
    assert "autodist searched in" in text and "predicted per device: step" in text
    assert "against the runner-up" in text and " over " in text
    table = text.table
    assert len(table) == len(p.graph) and {"choice", "runner_up", "op_s", "comm_s", "margin_s"} <= set(table.columns)
    assert (table.margin_s.dropna() >= -1e-12).all()        # the chosen one is never beaten locally


@pytest.mark.slow                      # seven searches over the Llama's placements
def test_a_memory_limit_dp_cannot_meet_gives_a_plan_that_fits():
    model, args = build("llama"), batch("llama", 0)
    whole = nbscaler.plan(model, args, "dp", ComputeConfig(1, 1)).memory(torch.optim.AdamW).peak_bytes.max()
    limit = int(whole * 0.75)
    cfg = ComputeConfig(2, 2, pas_config={"memory_limit_bytes": limit})
    p = nbscaler.plan(model, args, "autodist", cfg)
    assert p.memory(torch.optim.AdamW).peak_bytes.max() <= limit < whole
    with pytest.raises(PolicyError, match="no plan that fits memory_limit_bytes=1,000"):
        nbscaler.plan(model, args, "autodist", ComputeConfig(2, 2, pas_config={"memory_limit_bytes": 1000}))


def test_constraints_pin_modules():
    cfg = ComputeConfig(2, 2, pas_config={"autodist_constraints": {"blocks.*": "replicate"}})
    p = nbscaler.plan(build("llama"), batch("llama", 0), "autodist", cfg)
    assert all(n.placement.split is None for n in p.graph.nodes if n.module_path.startswith("blocks."))


def test_saved_plan_loads_back_and_edits_take_effect(tmp_path):
    path = tmp_path / "plan.json"
    cfg = ComputeConfig(2, 2, pas_config={"save_plan_path": str(path)})
    p = nbscaler.plan(build("mlp"), batch("mlp", 0), "autodist", cfg)
    saved = json.loads(path.read_text())
    ops = saved["modes"][p.graph.mode]
    assert [op["name"] for op in ops] == [n.name for n in p.graph.nodes]
    for op in ops:
        op["split"] = "replicate"
    path.write_text(json.dumps(saved))
    loaded = nbscaler.plan(build("mlp"), batch("mlp", 0), "autodist",
                           ComputeConfig(2, 2, pas_config={"load_plan_path": str(path)}))
    assert all(n.placement.split is None for n in loaded.graph.nodes)
    with pytest.raises(PolicyError, match="saved for another model"):
        nbscaler.plan(build("llama"), batch("llama", 0), "autodist",
                      ComputeConfig(2, 2, pas_config={"load_plan_path": str(path)}))


@pytest.mark.slow       # seconds on its own: make test runs it, the edit-test loop does not
def test_auto_stage_count_keeps_the_fastest_predicted_and_the_plan_adopts_it():
    cfg = ComputeConfig(4, 4, use_end2end=True, use_pipeline=True, pipeline_nmicros=4,
                        pas_config={"autodist_nstages": "auto"})
    p = nbscaler.plan(build("gpt"), batch("gpt", 0), "autodist", cfg)
    scores = p.graph.meta["autodist"]["nstages_scores"]
    assert set(scores) == {2, 4}
    best = min(scores, key=scores.get)
    assert p.config.pipeline_nstages == best == p.schedule.nstages
    assert sorted({n.stage for n in p.graph.nodes}) == list(range(best))
    fixed = nbscaler.plan(build("gpt"), batch("gpt", 0), "autodist", cfg.with_changes(pas_config={"autodist_nstages": 2}))
    assert fixed.config.pipeline_nstages == 2 and "nstages_scores" not in fixed.graph.meta["autodist"]
    with pytest.raises(PolicyError, match="autodist_nstages.*no pipeline; set use_pipeline=True"):
        nbscaler.plan(build("mlp"), batch("mlp", 0), "autodist", ComputeConfig(2, 2, pas_config={"autodist_nstages": "auto"}))


@pytest.mark.slow       # seconds on its own: make test runs it, the edit-test loop does not
def test_auto_unit_size_keeps_the_fastest_per_sample_and_the_plan_adopts_it(tmp_path):
    path = tmp_path / "plan.json"
    cfg = ComputeConfig(2, 2, pas_config={"autodist_plan_ngpus": "auto", "save_plan_path": str(path)})
    p = nbscaler.plan(build("cnn"), batch("cnn", 0), "autodist", cfg)
    scores = p.graph.meta["autodist"]["unit_scores"]
    assert set(scores) == {1, 2}
    best = min(scores, key=lambda d: (scores[d], -d))      # autodist's rule: a tie goes to the larger unit
    assert p.config.plan_ngpus == best and p.config.units == 2 // best
    assert all(n.placement.devices == tuple(range(best)) for n in p.graph.nodes)
    assert f"chose units of {best} device(s)" in p.explain()
    # the saved plan loads back with its unit size where autodist may choose it, and not otherwise
    again = nbscaler.plan(build("cnn"), batch("cnn", 0), "autodist",
                          ComputeConfig(2, 2, pas_config={"autodist_plan_ngpus": "auto", "load_plan_path": str(path)}))
    assert again.config.plan_ngpus == best and splits(again) == splits(p)
    # BatchNorm makes the train and eval graphs differ: the file holds each, and each loads back
    assert set(json.loads(path.read_text())["modes"]) == {g.mode for g in p.graphs.values()} == {"train", "eval"}
    assert [splits(g) for g in again.graphs.values()] == [splits(g) for g in p.graphs.values()]
    if best != 2:
        with pytest.raises(PolicyError, match=f"plan for plan_ngpus={best}, not 2.*autodist_plan_ngpus='auto'"):
            nbscaler.plan(build("cnn"), batch("cnn", 0), "autodist",
                          ComputeConfig(2, 2, pas_config={"load_plan_path": str(path)}))
    with pytest.raises(PolicyError, match="autodist_plan_ngpus'\\]=3 does not divide runtime_ngpus=2"):
        nbscaler.plan(build("mlp"), batch("mlp", 0), "autodist", ComputeConfig(2, 2, pas_config={"autodist_plan_ngpus": 3}))


def test_bad_options_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="autodist_plan_ngpus.*divides runtime_ngpus, or 'auto'"):
        AutodistOptions(autodist_plan_ngpus=0)
    with pytest.raises(ValueError, match="memory_limit_bytes.*positive number of bytes"):
        AutodistOptions(memory_limit_bytes=-5)
    with pytest.raises(ValueError, match="memory_optimizer.*use one of sgd, adam, adamw"):
        AutodistOptions(memory_optimizer="lamb")
    with pytest.raises(ValueError, match="autodist_nstages.*give a number of pipeline stages, or 'auto'"):
        AutodistOptions(autodist_nstages="many")
    with pytest.raises(PolicyError, match="pipeline_pivots .*'nowhere'.* name no module"):
        nbscaler.plan(build("gpt"), batch("gpt", 0), "autodist",
                      ComputeConfig(2, 2, use_end2end=True, use_pipeline=True, pipeline_nmicros=4,
                                    pas_config={"pipeline_pivots": ["nowhere"]}))


def test_balanced_cuts_minimise_the_slowest_stage():
    stages = balanced_cuts(None, 2, [1.0, 1.0, 1.0, 5.0, 1.0, 1.0], points=[1, 2, 3, 4, 5])
    assert stages == [0, 0, 0, 1, 1, 1]          # 3 | 7 beats 2 | 8 and 8 | 2 ...
    assert balanced_cuts(None, 2, [1.0, 1.0, 1.0, 5.0, 1.0, 1.0], points=[4]) == [0, 0, 0, 0, 1, 1]
    with pytest.raises(PolicyError, match="has 0 places to cut it into pipeline stages, but 3 stages need 2"):
        balanced_cuts(None, 3, [1.0] * 6, points=[])


def test_stage_counts_to_search_keep_to_a_scheduler_with_a_fixed_count():
    """``autodist_nstages='auto'`` tries every divisor of plan_ngpus, except where the scheduler
    registered the one count it runs (chimera_direct: 4)."""
    from nbscaler.policy.autodist.candidates import stage_count_configs
    base = dict(plan_ngpus=8, runtime_ngpus=8, use_end2end=True, use_pipeline=True, pipeline_nmicros=4)
    opts = AutodistOptions(autodist_nstages="auto")
    assert [c.pipeline_nstages for c in stage_count_configs(ComputeConfig(**base), opts)] == [2, 4, 8]
    chimera = ComputeConfig(**base, pipeline_scheduler="chimera_direct", pipeline_nstages=4)
    assert [c.pipeline_nstages for c in stage_count_configs(chimera, opts)] == [4]


def test_auto_scheduler_tries_interleaving_on_the_same_tensor_parallel_pipeline_devices():
    """On 2 pipeline devices of 2 plan devices each, the interleaved candidate keeps them: 4 stages,
    2 virtual stages a device (before, its stages spread over every plan device and it was dropped)."""
    from nbscaler.policy.autodist.candidates import scheduler_configs
    cfg = ComputeConfig(4, 4, use_end2end=True, use_pipeline=True, pipeline_nstages=2, pipeline_nmicros=4)
    found = {c.scheduler: c for c in scheduler_configs(cfg, AutodistOptions(autodist_scheduler="auto"))}
    assert set(found) == {"1f1b", "1f1b_interleaved", "zb_h1", "zbv"}
    interleaved = found["1f1b_interleaved"]
    assert interleaved.pipeline_nstages == 4 and interleaved.virtual_stages == 2 and interleaved.grid.pipeline.tp == 2
    assert {c.grid.pipeline.tp for c in found.values()} == {2} and found["zbv"].virtual_stages is None


@pytest.mark.slow
def test_auto_scheduler_keeps_the_fastest_predicted_and_the_plan_adopts_it():
    """``autodist_scheduler='auto'`` tries 1f1b, 1f1b_interleaved, zb_h1 and zbv on the config's two
    pipeline devices (four stages for the two-chunk ones) and keeps the one the simulator predicts
    fastest; the plan's config and schedule are that one's."""
    cfg = ComputeConfig(2, 2, use_end2end=True, use_pipeline=True, pipeline_nstages=2, pipeline_nmicros=4,
                        pipeline_scheduler="gpipe", pas_config={"autodist_scheduler": "auto"})
    p = nbscaler.plan(build("gpt"), batch("gpt", 0), "autodist", cfg)
    scores = p.graph.meta["autodist"]["scheduler_scores"]
    assert set(scores) == {"gpipe", "1f1b", "1f1b_interleaved", "zb_h1", "zbv"}
    best = min(scores, key=scores.get)
    assert p.config.pipeline_scheduler == p.schedule.name == best
    assert p.config.pipeline_nstages == p.schedule.nstages == (4 if best in ("1f1b_interleaved", "zbv") else 2)
    assert sorted({n.stage for n in p.graph.nodes}) == list(range(p.schedule.nstages))
    with pytest.raises(ValueError, match="autodist_scheduler.*training schedulers"):
        nbscaler.plan(build("gpt"), batch("gpt", 0), "autodist", cfg.with_changes(pas_config={"autodist_scheduler": ["infer_pipe"]}))


def test_a_saved_plan_whose_loss_is_split_by_batch_loads_back(tmp_path):
    """A batch split's mean loss runs a call of its own (each device's part): a saved plan holding it
    loads back so, though its ``n`` is frozen to ``partition``."""
    from nbscaler.policy.autodist.planfile import save_plan
    placed = nbscaler.plan(build("llama"), batch("llama", 0), "data", ComputeConfig(2, 2))
    path = tmp_path / "plan.json"
    save_plan(placed.graph, 2, str(path))
    loaded = nbscaler.plan(build("llama"), batch("llama", 0), "autodist",
                           ComputeConfig(2, 2, pas_config={"load_plan_path": str(path)}))
    loss = next(n for n in loaded.graph.nodes if n.op == "loss")
    assert loss.placement.split == "n" and "split_cross_entropy(" in loaded.sources[0]
    assert [n.placement.split for n in loaded.graph.nodes] == [n.placement.split for n in placed.graph.nodes]
