"""The Explorer's Python state, without a browser: after a compile, a knob change, an error, and a
run on a real two-engine cluster (checked against one process)."""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pandas as pd
import pytest
import torch
import torch.distributed as dist

import nbscaler.planning.planner as planner
from nbscaler.cluster import Cluster
from nbscaler.models.gpt import GPT, GPTConfig, sample_batch
from nbscaler.columns import SummaryColumn as C
from nbscaler.policy import get_policy
from nbscaler.widgets import Explorer
from nbscaler.widgets.explorer import Knobs
from nbscaler.widgets.explorer.controls import SHIPPED_GPT
from nbscaler.widgets.explorer.panes import PLACEMENT_VIEWS, ViewName
from nbscaler.widgets.explorer.losses import LossCurve
from nbscaler.widgets.plotting import PLOTLY_MIME
from tests.models import MLP, batch
from tests.widgets.offline import external_resources
from tests.widgets.svg import charts, hint, marks

REPO = str(Path(__file__).resolve().parents[2])


def megatron(graph, compute_config):
    """A user policy: the built-in tensor parallelism, under the user's own name."""
    return get_policy("tp")(graph, compute_config)


def fails_on_rank_1(output, batch):
    """A loss function with a bug that only one rank hits."""
    if dist.is_initialized() and dist.get_rank() == 1:
        raise ValueError("bad label on rank 1")
    return output


@pytest.fixture
def explorer():
    ex = Explorer(knobs=Knobs(policy="tp", plan_ngpus=2, runtime_ngpus=2))
    yield ex
    ex.close()


@pytest.mark.slow       # seconds on its own: make test runs it, the edit-test loop does not
def test_compile_draws_every_view_of_one_plan_and_records_a_run(explorer):
    plan = explorer.compile()
    assert explorer.error is None and plan is explorer.plan is explorer.compiled
    assert set(explorer.panes.views) == set(ViewName)
    assert all(view.plan is plan for view in explorer.panes.views.values())
    assert all(slot.children[0] is explorer.panes.views[name].widget for name, slot in explorer.panes.slots.items())
    runs = explorer.runs
    assert list(runs.index) == [1] and runs.loc[1, "policy"] == "tp" and runs.loc[1, "compile_s"] > 0
    summary = plan.summary(torch.optim.SGD)
    assert runs.loc[1, "peak_bytes_predicted"] == summary[C.PEAK_BYTES].tolist()
    assert runs.loc[1, "step_s_predicted"] == summary[C.STEP_TIME_S].max()
    assert runs.loc[1, ["step_s", "losses_match"]].isna().all()      # not trained yet
    assert explorer.progress.layout.visibility == "hidden"
    assert "Compiled run 1" in explorer.status.value
    graph = explorer.panes.views[ViewName.GRAPH]
    graph.select(5)                                                # the code view follows the graph
    assert explorer.panes.views[ViewName.CODE].node == 5


@pytest.mark.slow       # a second or so: make test runs it, the edit-test loop does not
def test_a_knob_change_replaces_without_tracing_and_redraws_timeline_and_memory(explorer, monkeypatch):
    explorer.compile()
    compiled = explorer.compiled

    def no_tracing(*args, **kwargs):
        raise AssertionError("a knob change must not trace the model again")

    monkeypatch.setattr(planner, "trace_modes", no_tracing)
    explorer.set(policy="pp", stages=2, nmicros=4, scheduler="gpipe")
    plan = explorer.plan
    assert explorer.error is None and plan is not compiled and explorer.compiled is compiled
    assert plan.schedule.nstages == 2 and plan.config.pipeline_nmicros == 4 and plan.config.scheduler == "gpipe"
    views = explorer.panes.views
    for name in PLACEMENT_VIEWS:
        assert views[name].plan is plan
    for name in set(ViewName) - set(PLACEMENT_VIEWS):
        assert views[name].plan is compiled                          # until the next Compile
    assert views[ViewName.MEMORY].predicted.equals(plan.memory(torch.optim.SGD))
    assert views[ViewName.TIMELINE].predicted_bubble_total == plan.timeline().bubble_fraction > 0
    assert explorer.knob_latency_s is not None and "Re-placed under pp" in explorer.status.value
    assert len(explorer.runs) == 1                                    # a knob change is not a run


@pytest.mark.slow       # seconds on its own: make test runs it, the edit-test loop does not
def test_the_why_pane_follows_the_policy(explorer):
    explorer.compile()
    why = explorer.panes.views[ViewName.WHY]
    assert "under 'tp'" in why.text and "autodist searched in" not in why.text
    explorer.set(policy="autodist")
    assert explorer.error is None and why.plan is explorer.plan
    assert "autodist searched in" in why.text and "autodist searched in" in why.widget.value


@pytest.mark.slow
def test_a_bad_knob_is_a_message_and_the_explorer_keeps_working(explorer):
    explorer.compile()
    before = explorer.plan
    explorer.set(plan_ngpus=4, runtime_ngpus=2)
    assert "runtime_ngpus" in explorer.error and "multiple of plan_ngpus=4" in explorer.error
    assert "nbscaler-error" in explorer.status.value and "Could not re-place" in explorer.status.value
    assert explorer.plan is before and explorer.panes.views[ViewName.MEMORY].plan is before
    explorer.set(policy="dp", plan_ngpus=2, runtime_ngpus=2)          # a policy that refuses the config
    assert explorer.error.startswith("PolicyError") and "plan_ngpus=1" in explorer.error
    explorer.set(plan_ngpus=1, runtime_ngpus=2)
    assert explorer.error is None and explorer.plan.config.plan_ngpus == 1
    assert explorer.panes.views[ViewName.MEMORY].plan is explorer.plan
    explorer.set(bogus=3)
    assert "unknown knob" in explorer.error
    assert explorer.compile() is not None and explorer.error is None


@pytest.mark.slow       # seconds on its own: make test runs it, the edit-test loop does not
def test_a_user_module_and_a_user_policy():
    model = MLP()
    ex = Explorer(model, batch("mlp", 0), policies=[megatron], knobs=Knobs(policy=megatron, plan_ngpus=2))
    try:
        assert "megatron" in ex.controls.policy.options and not ex.spec.end2end
        plan = ex.compile()
        assert ex.error is None and plan.policy is megatron and ex.runs.loc[1, "policy"] == "megatron"
        ex.set(policy="pp")                                           # pipelines need an end2end module
        assert "end2end" in ex.error and ex.plan is plan
        ex.set(model=SHIPPED_GPT, n_layer=1)                          # back to the GPT: a new trace
        assert ex.compiled is None and ex.spec.end2end
        ex.set(policy="tp")
        assert ex.compile() is not None and ex.runs.loc[2, "model"].startswith("GPT (1 layers")
    finally:
        ex.close()


@pytest.mark.slow       # seconds on its own: make test runs it, the edit-test loop does not
def test_after_a_compile_the_knobs_read_the_plans_own_configuration(explorer):
    knobs = explorer.controls
    explorer.set(policy="pp")                       # stages 1: pp stages over every plan device
    plan = explorer.compile()
    assert explorer.error is None and plan.schedule.nstages == 2
    assert knobs.stages.value == 2 and knobs.knobs().compute_config().pipeline_nstages == 2
    assert (knobs.nmicros.value, knobs.scheduler.value) == (plan.config.pipeline_nmicros, plan.config.scheduler)
    assert not knobs.nmicros.disabled and not knobs.scheduler.disabled
    explorer.set(policy="tp")                       # leaving the pipeline policy leaves its stages too
    assert explorer.error is None and explorer.plan.schedule is None and knobs.stages.value == 1
    assert knobs.nmicros.disabled and knobs.scheduler.disabled   # no pipeline: they do not apply
    explorer.set(policy="hybrid", plan_ngpus=4, runtime_ngpus=4)  # a re-placement reads its plan too
    assert explorer.error is None and knobs.stages.value == explorer.plan.schedule.ndevices == 4


@pytest.mark.slow       # a second or so: make test runs it, the edit-test loop does not
def test_the_sequence_parallel_knob_applies_to_the_policies_that_read_it(explorer):
    knobs = explorer.controls
    assert not knobs.sequence_parallel.value and not knobs.sequence_parallel.disabled       # tp reads it
    plain = explorer.compile()
    explorer.set(sequence_parallel=True)                          # a re-placement of the same trace
    sp = explorer.plan
    assert explorer.error is None and sp.config.pas_config["sequence_parallel"] is True
    assert {"reduce_scatter", "all_gather_sum_grad"} <= set(sp.collectives.collective)
    assert (sp.memory()[C.ACTIVATION_BYTES] < plain.memory()[C.ACTIVATION_BYTES]).all()
    explorer.set(policy="dp", plan_ngpus=1)                       # dp does not read it: no refusal, and
    assert explorer.error is None and knobs.sequence_parallel.disabled     # the knob reads the dp plan: off
    assert "sequence_parallel" not in explorer.plan.config.pas_config and not knobs.sequence_parallel.value
    explorer.set(policy="hybrid", plan_ngpus=4, runtime_ngpus=4, sequence_parallel=True)    # per stage
    assert explorer.error is None and not knobs.sequence_parallel.disabled and knobs.sequence_parallel.value
    assert explorer.plan.config.pas_config["sequence_parallel"] is True
    assert Knobs(policy="pp", sequence_parallel=True).row()["sequence_parallel"] is False


@pytest.mark.slow       # seconds: two re-placements and their memory
def test_zero_stage_3_and_its_reshard_knob_shard_the_parameters_and_gather_units(explorer):
    knobs = explorer.controls
    assert knobs.zero_reshard_after_forward.disabled                  # only stage 3 gathers
    explorer.compile()
    explorer.set(policy="dp", plan_ngpus=1, runtime_ngpus=2, use_zero=True, zero_stage=3)
    sharded = explorer.plan
    assert explorer.error is None and sharded.config.zero_stage == 3 and not knobs.zero_reshard_after_forward.disabled
    assert "self.shards.unshard(" in sharded.sources[0]
    assert (sharded.memory()[C.GATHERED_BYTES] > 0).all()
    explorer.set(zero_reshard_after_forward=False)                    # units kept from forward to backward
    kept = explorer.plan
    assert kept.config.zero_reshard_after_forward is False and "self.shards.reshard(" not in kept.sources[0]
    assert (kept.memory()[C.GATHERED_BYTES] >= sharded.memory()[C.GATHERED_BYTES]).all()
    assert Knobs(use_zero=True, zero_stage=3).row()["zero"] == 3


@pytest.mark.slow       # a second or so: make test runs it, the edit-test loop does not
def test_the_recompute_knob_is_a_granularity_and_a_re_placement_recomputes_that(explorer):
    knobs = explorer.controls
    assert knobs.recompute.options == ("none", "selective", "full") and knobs.recompute.value == "none"
    plain = explorer.compile()
    explorer.set(recompute="selective")            # each attention core: pas_config['recompute']
    selective = explorer.plan
    assert explorer.error is None and knobs.recompute.value == knobs.knobs().recompute == "selective"
    assert selective.config.pas_config["recompute"] == "selective"
    assert "recompute_modules" not in selective.config.pas_config
    cores = {n.meta["recompute"] for n in selective.graph.nodes if n.meta.get("recompute")}
    assert cores == {"blocks.0.attn:core", "blocks.1.attn:core"}, cores
    explorer.set(recompute="full")                 # each repeated layer, named as the space tab names it
    full = explorer.plan
    assert explorer.error is None and knobs.recompute.value == "full"
    assert full.config.pas_config["recompute_modules"] == ["blocks"] and "recompute" not in full.config.pas_config
    activations = [p.memory()[C.ACTIVATION_BYTES].max() for p in (plain, selective, full)]
    assert activations[0] > activations[1] > activations[2], activations
    explorer.set(recompute=True)                   # the checkbox it was: True is full, False none
    assert explorer.error is None and knobs.recompute.value == "full"
    explorer.set(recompute=False)
    assert explorer.error is None and knobs.recompute.value == "none"
    assert not {"recompute", "recompute_modules"} & set(explorer.plan.config.pas_config)
    explorer.set(recompute="selective")
    explorer.compile()                             # a compile reads the knob too, and its run says so
    assert explorer.error is None and explorer.plan.config.pas_config["recompute"] == "selective"
    assert explorer.runs["recompute"].tolist() == ["none", "selective"]
    assert knobs.recompute.value == "selective"
    explorer.set(recompute="some")
    assert explorer.error is not None and knobs.recompute.value == "selective"
    with pytest.raises(ValueError, match="none, selective, full"):
        Knobs(recompute="layers")
    assert Knobs(recompute="full").compute_config().pas_config["recompute"] == "full"   # no names: the stack


@pytest.mark.slow       # seconds on its own: make test runs it, the edit-test loop does not
def test_knobs_that_do_not_apply_to_a_user_module_are_hidden_or_disabled():
    cfg = GPTConfig(vocab_size=128, seq_len=32, n_layer=4, d_model=64, n_head=4)
    ex = Explorer(GPT(cfg), {"batch": sample_batch(cfg, 4)}, knobs=Knobs(policy="pp"))
    mlp = Explorer(MLP(), batch("mlp", 0))
    try:
        knobs = ex.controls
        assert knobs.n_layer.disabled and knobs.n_layer.layout.display == "none"   # not this model's size
        assert knobs.policy.layout.display is None and knobs.stages.layout.display is None   # the rest shows
        assert ex.compile().schedule.nstages == 2 and knobs.stages.value == 2
        ex.set(model=SHIPPED_GPT)
        assert not knobs.n_layer.disabled and knobs.n_layer.layout.display is None
        assert mlp.controls.n_layer.disabled and mlp.controls.n_layer.layout.display == "none"
        # a module that is not end2end cannot be pipelined: no pipeline knob applies
        assert all(getattr(mlp.controls, name).disabled for name in ("stages", "nmicros", "scheduler"))
        # no repeated layers: recompute full is not offered (selective is: the planner says if it finds no core)
        assert mlp.controls.recompute.options == ("none", "selective") and ex.controls.recompute.options[-1] == "full"
    finally:
        ex.close()
        mlp.close()


@pytest.mark.slow
def test_the_explorer_saves_its_knobs_charts_and_runs_as_html_without_scripts(explorer):
    assert "press <b>Compile</b>" in explorer._repr_mimebundle_()["text/html"]
    explorer.set(policy="pp")
    explorer.compile()
    bundle = explorer._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle                  # live, in a kernel
    page = bundle["text/html"]
    assert "<script" not in page and external_resources(page) == []
    timeline, memory = charts(page)
    assert len(marks(timeline, "rect", "nbs-block")) == 2 * 2 * 4 and marks(memory, "rect", "nbs-bar")
    assert "<th style='text-align:left'>pipeline stages</th><td>2</td>" in page and "nbscaler-runs" in page


def test_the_loss_curve_draws_each_ranks_line_in_the_figures_colour():
    curve = LossCurve()
    curve.start(2, "run 1: loss per rank")
    curve.finish(pd.DataFrame({"rank": [0, 0, 1, 1], "step": [0, 1, 0, 1], "loss": [2.0, 1.5, 2.2, 1.25]}), "run 1")
    (chart,) = charts(curve.svg())
    lines = marks(chart, "polyline")
    assert [line.get("stroke") for line in lines] == [trace.line.color for trace in curve.figure.data]
    assert len(set(line.get("stroke") for line in lines)) == 2
    assert [hint(dot) for dot in marks(chart, "circle")] == [
        "rank 0, step 0: 2", "rank 0, step 1: 1.5", "rank 1, step 0: 2.2", "rank 1, step 1: 1.25"]
    assert PLOTLY_MIME in curve.widget.outputs[0]["data"]                     # plotly's MIME type, no plotly.js


def test_explorer_needs_the_dummy_args_of_a_user_model():
    with pytest.raises(ValueError, match="forward arguments"):
        Explorer(MLP())


@pytest.fixture(scope="module")
def cluster():
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    with Cluster(n=2, timeout=20, name="explorer-tests") as cl:
        yield cl


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_runs_on_a_two_engine_cluster_match_one_process_and_compare(cluster):
    ex = Explorer(cluster=cluster, knobs=Knobs(policy="tp", plan_ngpus=2, runtime_ngpus=2))
    try:
        first = ex.train(steps=3)                                      # compiles first: nothing compiled yet
        assert ex.error is None and first.id == 1 and first.outcome.losses_match
        steps = first.outcome.result.steps
        assert sorted(steps["rank"].unique()) == [0, 1] and len(steps) == 6
        curve = ex.losses.figure.data
        assert [list(t.y) for t in curve] == [steps[steps["rank"] == r]["loss"].tolist() for r in (0, 1)]
        memory = ex.panes.views[ViewName.MEMORY]
        assert memory.measured.memory is first.outcome.result.memory and memory.gap is not None

        ex.set(policy="pp", stages=2, nmicros=4)
        second = ex.train(steps=3)
        assert ex.error is None and second.id == 2 and second.outcome.losses_match
        timeline = ex.panes.views[ViewName.TIMELINE]
        measured = timeline.measured.timeline
        assert len(measured) == 2 * 2 * 4 and measured["t_start"].min() == 0    # ranks x (F, B) x micro-batches
        runs = ex.runs
        assert runs["losses_match"].tolist() == [True, True] and (runs["step_s"] > 0).all()
        assert runs.loc[2, "stages"] == 2 and 0 <= runs.loc[2, "bubble"] < 1 and pd_isna(runs.loc[1, "bubble"])
        assert len(runs.loc[2, "peak_rss_bytes"]) == 2
        for run_id in (1, 2):                       # measured in the plan's categories: to the byte
            assert runs.loc[run_id, "peak_bytes"] == runs.loc[run_id, "peak_bytes_predicted"]
        assert "activations" in memory.gap.kinds.iloc[0]

        comparison = ex.compare(1, 2)
        assert ex.error is None and set(comparison.views) == {1, 2}
        for run_id, run in ((1, first), (2, second)):
            assert set(comparison.views[run_id]) == set(ViewName)
            assert all(view.plan is run.plan for view in comparison.views[run_id].values())
        assert comparison.views[2][ViewName.TIMELINE].measured.timeline is second.outcome.measured.timeline
        assert ex.compare_slot.children[0] is comparison.widget
    finally:
        ex.close()


@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_a_failing_rank_is_a_message_and_the_explorer_trains_again(cluster):
    ex = Explorer(MLP(), batch("mlp", 0), cluster=cluster, loss_fn=fails_on_rank_1,
                  knobs=Knobs(policy="tp", plan_ngpus=2, runtime_ngpus=2))
    try:
        assert ex.train(steps=2) is None
        assert ex.error.startswith("RankError") and "rank 1" in ex.error and "bad label on rank 1" in ex.error
        assert "traceback on rank 1" in ex.status.value
        assert pd_isna(ex.runs.loc[1, "losses_match"])
        ex.set(model=SHIPPED_GPT)
        run = ex.train(steps=2)
        assert ex.error is None, "".join(traceback.format_exception(ex.last_exception))
        assert run.outcome.losses_match
    finally:
        ex.close()


def the_output(output, batch):
    """The loss of a module that returns its loss."""
    return output


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_a_run_with_torch_compile_reports_its_compile_seconds_in_the_runs_table(cluster):
    ex = Explorer(MLP(), batch("mlp", 0), cluster=cluster, loss_fn=the_output,
                  knobs=Knobs(policy="tp", plan_ngpus=2, runtime_ngpus=2, torch_compile=True))
    try:
        run = ex.train(steps=3)
        assert ex.error is None, "".join(traceback.format_exception(ex.last_exception))
        assert run.outcome.losses_match and run.plan.config.compile
        steps = run.outcome.result.steps
        assert (steps[steps["step"] == 0]["compile_s"] > 0).all()
        assert (steps[steps["step"] > 0]["compile_s"] == 0).all()        # the same shapes: no compile again
        runs = ex.runs
        assert runs.loc[1, "torch_compile"] and runs.loc[1, "torch_compile_s"] == steps["compile_s"].groupby(
            steps["rank"]).sum().max() > 0
        assert "torch.compile took" in ex.status.value

        ex.set(torch_compile=False)
        ex.train(steps=2)
        assert ex.error is None and not ex.runs.loc[2, "torch_compile"] and pd_isna(ex.runs.loc[2, "torch_compile_s"])
    finally:
        ex.close()


def test_the_torch_compile_knob_is_the_configs_compile_and_reads_back_from_a_plan():
    from nbscaler import ComputeConfig
    from nbscaler.widgets.explorer.controls import Controls
    knobs = Knobs(policy="dp", plan_ngpus=1, runtime_ngpus=2, torch_compile=True)
    assert knobs.compute_config().compile and knobs.row()["torch_compile"] is True
    assert not Knobs().compute_config().compile
    controls = Controls(Knobs())
    controls.show_plan(ComputeConfig(1, 2, compile=True), None)
    assert controls.knobs().torch_compile and "torch.compile the ranks</th><td>True" in controls.as_table()


def pd_isna(value) -> bool:
    return value is None or value != value


def test_on_a_target_the_explorers_timeline_and_memory_draw_it():
    from nbscaler import Hardware
    from nbscaler.widgets.explorer.panes import build_views, view_options
    from tests.widgets.compiled import gpt_on_meta_pp

    t4 = Hardware.named("T4")
    from nbscaler import Recipe
    from nbscaler.widgets.explorer.runs import EXPLORER_RECIPE

    assert EXPLORER_RECIPE == Recipe(torch.optim.SGD)
    assert Explorer(hardware=t4).panes.options == view_options(EXPLORER_RECIPE, t4)
    views = build_views(gpt_on_meta_pp(), names=PLACEMENT_VIEWS[:2],
                        options=view_options(Recipe(torch.optim.AdamW, master_dtype=None), t4))
    assert views[ViewName.MEMORY].over_capacity == {0}
    assert views[ViewName.TIMELINE]._title().startswith("Timeline of one training step: pp on T4 x 8: step")


def test_the_context_parallel_knobs_build_the_config_the_policy_reads():
    knobs = Knobs(policy="tp", plan_ngpus=2, runtime_ngpus=2, context_parallel=2, context_parallel_kind="ring")
    pas = knobs.compute_config().pas_config
    assert pas["context_parallel"] == 2 and pas["context_parallel_kind"] == "ring"
    assert "context_parallel" not in Knobs(policy="tp").compute_config().pas_config             # 1: none
    assert "context_parallel" not in Knobs(policy="dp", context_parallel=2).compute_config().pas_config
    with pytest.raises(ValueError, match="context_parallel_kind='all_to_all'"):
        Knobs(context_parallel_kind="all_to_all")
    assert knobs.row()["context_parallel"] == "2 ring"
    assert Knobs(policy="dp", context_parallel=2).row()["context_parallel"] == ""           # dp: none


def test_the_expert_parallel_knob_builds_the_config_the_policy_reads():
    knobs = Knobs(policy="hybrid", plan_ngpus=2, runtime_ngpus=2, expert_parallel=2)
    assert knobs.compute_config().pas_config["expert_parallel"] == 2 and knobs.row()["expert_parallel"] == 2
    assert "expert_parallel" not in Knobs(policy="tp").compute_config().pas_config              # 1: none
    off = Knobs(policy="dp", expert_parallel=2)                                                # dp does not read it
    assert "expert_parallel" not in off.compute_config().pas_config and off.row()["expert_parallel"] == 1


def test_the_expert_groups_knob_is_read_only_beside_expert_parallel():
    knobs = Knobs(policy="tp", plan_ngpus=4, runtime_ngpus=4, expert_parallel=2, expert_tensor_parallel=2)
    pas = knobs.compute_config().pas_config
    assert pas["expert_parallel"] == 2 and pas["expert_tensor_parallel"] == 2
    assert knobs.row()["expert_tensor_parallel"] == 2
    alone = Knobs(policy="tp", expert_tensor_parallel=2)                      # no expert parallelism: not read
    assert "expert_tensor_parallel" not in alone.compute_config().pas_config and alone.row()["expert_tensor_parallel"] == 1


@pytest.mark.slow       # seconds: a compile, a re-placement under context parallelism and a refusal
def test_the_context_parallel_knob_compiles_a_cp_plan_and_a_refusal_shows_as_an_error(explorer):
    knobs = explorer.controls
    assert knobs.context_parallel.value == 1 and not knobs.context_parallel.disabled     # tp reads it
    assert knobs.context_parallel_kind.disabled                                          # nothing to pass at 1
    explorer.compile()
    explorer.set(context_parallel=2, context_parallel_kind="ring")
    cp = explorer.plan
    assert explorer.error is None and not knobs.context_parallel_kind.disabled
    assert cp.config.pas_config["context_parallel"] == 2 and cp.config.pas_config["context_parallel_kind"] == "ring"
    assert "context_attention(" in cp.sources[0] and "kind='ring'" in cp.sources[0]
    explorer.compile()                                        # a run of its own: the runs table names it
    assert explorer.runs["context_parallel"].tolist()[-2:] == ["", "2 ring"]
    explorer.set(plan_ngpus=4, runtime_ngpus=4)              # 4 devices a stage: tp 2 inside each cp place
    assert explorer.error is None and "tensor parallel inside: devices [0, 1]" in explorer.plan.sources[0]
    cp = explorer.plan
    explorer.set(plan_ngpus=2, runtime_ngpus=2, context_parallel=4)     # 2 devices a stage: cp 4 is refused
    assert explorer.error is not None and "PolicyError" in explorer.error and "context_parallel=4" in explorer.error
    assert explorer.plan is cp                                # the last good plan stays on screen
    explorer.set(plan_ngpus=4, runtime_ngpus=4)
    assert explorer.error is None and explorer.plan.config.pas_config["context_parallel"] == 4
    explorer.set(policy="dp", plan_ngpus=1)                   # dp does not read it: no refusal
    assert explorer.error is None and knobs.context_parallel.disabled
    assert "context_parallel" not in explorer.plan.config.pas_config
