"""autodist on a target: the sweep's fastest fitting configuration, planned whole, explained against the rest."""

import dataclasses
import re

import pytest
import torch

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.models.gpt import GPT
from nbscaler.policy import PolicyError
from nbscaler.planning.target_explanation import gigabytes, seconds
from nbscaler.policy.autodist import AutodistOptions
from nbscaler.space.autodist import TargetSearch
from tests.space.test_sweep import GLOBAL_BATCH, GPT_CFG, TARGET, tokens

SPACE = {"tp": (1, 2), "pp": (1, 2, 4), "micro_batch": (1, 2)}


def on_target(hardware=TARGET, **more):
    return ComputeConfig(8, 8, pas_config={"hardware": hardware, "global_batch": GLOBAL_BATCH,
                                           "autodist_space": SPACE, **more})


@pytest.fixture(scope="module")
def chosen():
    return nbscaler.plan(GPT(GPT_CFG), tokens(1), "autodist", on_target(), module_dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def frame():
    return nbscaler.sweep(GPT(GPT_CFG), tokens(1), TARGET, global_batch=GLOBAL_BATCH, progress=False, **SPACE)


def test_the_plan_is_as_fast_as_the_sweeps_best_fitting_row_and_its_summary_says_what_autodist_claims(chosen, frame):
    s = chosen.summary(torch.optim.AdamW, hardware=TARGET, master_dtype=torch.float32)
    claimed = chosen.graph.meta["autodist"]["target"]["chosen"]
    best = frame[frame.fits].iloc[0]
    assert s.step_time_s.max() <= best.step_time_s * (1 + 1e-9)
    assert s.step_time_s.max() == pytest.approx(claimed["step_time_s"], rel=1e-9)
    assert s.peak_bytes.max() == pytest.approx(claimed["peak_bytes"], rel=1e-9) and s.fits.all()
    assert (chosen.config.plan_ngpus, chosen.config.pipeline_nstages) == (best.tp * best.pp, best.pp)
    assert chosen.policy_name == "autodist" and chosen.config.runtime_ngpus == TARGET.ngpus


def test_explain_sets_the_choice_against_runners_up_with_their_cost_and_what_binds_each(chosen, frame):
    text = str(chosen.explain())
    info = chosen.graph.meta["autodist"]["target"]
    assert f"autodist priced {info['priced']} configurations for small" in text
    assert info["priced"] + info["pruned"] == len(frame) and info["pruned"] > 0
    best = frame[frame.fits].iloc[0]
    assert f"chose tp {best.tp} x pp {best.pp} x dp {best.dp}, micro-batch {best.micro_batch}" in text
    runners = info["runners_up"]
    assert len(runners) >= 2 and all(r["tp"] != best.tp or r["pp"] != best.pp or r["recompute"] != best.recompute
                                     for r in runners)
    lines = [line for line in text.splitlines() if "binds:" in line]
    assert len(lines) == len(runners)
    for row, line in zip(runners, lines):
        assert f"tp {row['tp']} x pp {row['pp']} x dp {row['dp']}" in line
        assert f"step {seconds(row['step_time_s'])}" in line and f"peak {gigabytes(row['peak_bytes'])}" in line
        if row["fits"]:
            assert row["step_time_s"] >= best.step_time_s
            assert re.search(r"binds: (the pipeline bubble|tensor-parallel collectives|the data-parallel gradient "
                             r"reduction|pipeline sends|compute, .*) \([0-9.e-]+ m?s more a step", line), line
        else:
            assert "does not fit; binds: memory" in line and row["step_time_s"] < best.step_time_s
    assert not runners[0]["fits"]               # on this small target the fastest configuration does not fit
    assert len(chosen.explain().table) == len(runners) + 1


def test_a_bad_hardware_name_lists_the_catalogue():
    with pytest.raises(ValueError, match=r"hardware.*'H100-SXM-8GB'.*no hardware named .*known: .*H100-SXM"):
        nbscaler.plan(GPT(GPT_CFG), tokens(1), "autodist", on_target("H100-SXM-8GB"))


@pytest.mark.slow
def test_a_target_nothing_fits_on_says_what_the_leanest_needs():
    tiny = dataclasses.replace(TARGET, memory_bytes=1e5)
    with pytest.raises(PolicyError, match=r"no configuration of the space fits small's .*the leanest \(tp .*\) needs"):
        nbscaler.plan(GPT(GPT_CFG), tokens(1), "autodist", on_target(tiny), module_dtype=torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_sequence_parallel_in_the_pas_config_is_the_one_value_searched(sequence_parallel):
    plan = nbscaler.plan(GPT(GPT_CFG), tokens(1), "autodist", on_target(sequence_parallel=sequence_parallel),
                         module_dtype=torch.bfloat16)
    info = plan.graph.meta["autodist"]["target"]
    rows = [info["chosen"], *info["runners_up"]]
    assert all(r["sequence_parallel"] == (sequence_parallel and r["tp"] > 1) for r in rows)
    assert plan.config.pas_config.get("sequence_parallel", False) == info["chosen"]["sequence_parallel"]
    if info["chosen"]["sequence_parallel"]:
        assert ", sequence parallel, ZeRO" in str(plan.explain())


def test_target_keys_are_checked_with_the_fix():
    with pytest.raises(ValueError, match="global_batch.*sequences one step trains on"):
        TargetSearch(hardware="H100-SXM-80GB")
    with pytest.raises(ValueError, match="global_batch.*read only with a target"):
        AutodistOptions.from_config(ComputeConfig(2, 2, pas_config={"global_batch": 8}))
    with pytest.raises(ValueError, match="no hardware named 'H1000'; known: .*H100-SXM-80GB"):
        TargetSearch(hardware="H1000", global_batch=8)
    with pytest.raises(ValueError, match="autodist_space.*some of tp, pp, micro_batch, recompute, "
                                         "sequence_parallel, zero_stage, zero_reshard"):
        TargetSearch(hardware="H100-SXM-80GB", global_batch=8, autodist_space={"dp": (2,)})
    with pytest.raises(ValueError, match="runtime_ngpus=4.*4 GPUs are not a whole number of nodes"):
        TargetSearch(hardware="H100-SXM-80GB", global_batch=8).target(ComputeConfig(4, 4))
    with pytest.raises(ValueError, match="runtime_ngpus=16.*has 8 GPUs but the job runs 16"):
        TargetSearch(hardware=TARGET, global_batch=8).target(ComputeConfig(16, 16))


def test_a_traced_graph_cannot_be_searched_on_a_target(chosen):
    with pytest.raises(PolicyError, match="not on a traced graph"):
        chosen.replan("autodist", on_target())


class ScaledBlock(torch.nn.Module):
    """A GPT block whose output is scaled by ``1 - p`` in training and left as it is in eval, read off
    ``self.training`` as Hugging Face's Llama reads its attention dropout: with ``p = 0`` both
    modes compute the same."""

    def __init__(self, block: torch.nn.Module, p: float):
        super().__init__()
        self.block, self.p = block, p

    def forward(self, x):
        return self.block(x) * (1.0 - (self.p if self.training else 0.0))


def mode_reading_gpt(p: float) -> GPT:
    model = GPT(GPT_CFG)
    model.blocks = torch.nn.ModuleList(ScaledBlock(b, p) for b in model.blocks)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("p, modes", [(0.0, {"any"}), (0.5, {"train", "eval"})])
def test_the_full_model_is_traced_in_eval_mode_only_where_the_copy_showed_the_modes_differ(p, modes, monkeypatch):
    from nbscaler.trace import modes as trace_modes
    traced, trace = [], trace_modes.trace_module
    monkeypatch.setattr(trace_modes, "trace_module",
                        lambda module, args, mode, **kw: traced.append((len(module.blocks), mode))
                        or trace(module, args, mode, **kw))
    plan = nbscaler.plan(mode_reading_gpt(p), tokens(1), "autodist", on_target(), module_dtype=torch.bfloat16)
    assert set(plan.graphs) == modes
    full = [mode for depth, mode in traced if depth == GPT_CFG.n_layer]
    assert full == (["train"] if p == 0.0 else ["train", "eval"])
    assert ("eval" in [mode for depth, mode in traced if depth == 2])     # the copy was traced in both modes


@pytest.mark.slow       # a search and its plan: seconds
def test_a_search_over_zero3_plans_the_fully_sharded_row_it_claims():
    """Stage 3 only, both reshard settings: the plan is the row autodist chose, sharded as it says,
    and its summary is what the search claimed."""
    space = {"tp": (1, 2), "pp": (1,), "micro_batch": (1, 2), "zero_stage": (3,),
             "zero_reshard_after_forward": (True, False)}
    cfg = ComputeConfig(8, 8, pas_config={"hardware": TARGET, "global_batch": GLOBAL_BATCH, "autodist_space": space})
    plan = nbscaler.plan(GPT(GPT_CFG), tokens(1), "autodist", cfg, module_dtype=torch.bfloat16)
    claimed = plan.graph.meta["autodist"]["target"]["chosen"]
    assert plan.config.use_zero and plan.config.zero_stage == 3 and not plan.units.empty
    s = plan.summary(torch.optim.AdamW, hardware=TARGET, master_dtype=torch.float32)
    assert s.step_time_s.max() == pytest.approx(claimed["step_time_s"], rel=1e-9)
    assert s.peak_bytes.max() == pytest.approx(claimed["peak_bytes"], rel=1e-9) and (s.gathered_bytes > 0).all()


@pytest.mark.slow       # a CP sweep and the chosen plan placed whole: seconds
def test_autodist_searches_context_parallelism_when_its_space_asks_and_explain_names_the_cp_chosen():
    space = {"tp": (1,), "pp": (1, 2), "micro_batch": (1,), "cp": (2, 4), "context_parallel_kind": ("ring",),
             "zero_stage": (2,), "recompute": ("none", "full")}
    target = dataclasses.replace(TARGET, memory_bytes=20e6)       # the context-parallel rows fit
    cfg = ComputeConfig(8, 8, pas_config={"hardware": target, "global_batch": GLOBAL_BATCH, "autodist_space": space})
    chosen = nbscaler.plan(GPT(GPT_CFG), tokens(1), "autodist", cfg, module_dtype=torch.bfloat16)
    frame = nbscaler.sweep(GPT(GPT_CFG), tokens(1), target, global_batch=GLOBAL_BATCH, progress=False, **space)
    best = frame[frame.fits].iloc[0]
    claimed = chosen.graph.meta["autodist"]["target"]["chosen"]
    assert best.cp > 1 and claimed["cp"] == best.cp and claimed["step_time_s"] == best.step_time_s
    assert chosen.config.pas_config["context_parallel"] == best.cp
    assert chosen.config.pas_config["context_parallel_kind"] == "ring"
    assert chosen.config.plan_ngpus == best.cp * best.pp
    text = str(chosen.explain())
    assert f"chose tp 1 x cp {best.cp} (ring) x pp {best.pp} x dp {best.dp}" in text
    s = chosen.summary(torch.optim.AdamW, hardware=target, master_dtype=torch.float32)
    assert s.step_time_s.max() == pytest.approx(best.step_time_s, rel=1e-9)


def test_autodist_space_takes_cp_and_keeps_it_off_unless_asked(chosen):
    TargetSearch.from_config(on_target(autodist_space={"cp": (1, 2), "context_parallel_kind": ("ring",)}))
    assert chosen.graph.meta["autodist"]["target"]["chosen"]["cp"] == 1
    assert "context_parallel" not in chosen.config.pas_config


@pytest.mark.slow       # a sweep of both softwares and the chosen plan placed whole: seconds
def test_autodist_searches_fp8_and_compiled_software_and_says_how_to_train_the_choice():
    from tests.space.test_sweep import H100_SMALL
    space = {"tp": (2,), "pp": (2,), "micro_batch": (1,), "zero_stage": (1,), "recompute": ("full",),
             "sequence_parallel": (False,), "float8": ("none", "tensorwise"), "compiled": (False, True)}
    cfg = ComputeConfig(4, 8, pas_config={"hardware": H100_SMALL, "global_batch": GLOBAL_BATCH, "autodist_space": space})
    chosen = nbscaler.plan(GPT(GPT_CFG), tokens(1), "autodist", cfg, module_dtype=torch.bfloat16)
    frame = nbscaler.sweep(GPT(GPT_CFG), tokens(1), H100_SMALL, global_batch=GLOBAL_BATCH, progress=False, **space)
    best = frame[frame.fits].iloc[0]
    claimed = chosen.graph.meta["autodist"]["target"]["chosen"]
    assert (claimed["float8"], claimed["compiled"], claimed["step_time_s"]) == (best.float8, best.compiled, best.step_time_s)
    assert set(zip(frame.float8, frame.compiled)) == {(f, c) for f in ("none", "tensorwise") for c in (False, True)}
    text = str(chosen.explain())
    assert ("compiled (train with ComputeConfig(compile=True))" in text) == bool(best.compiled)
    assert ("fp8 tensorwise (train with Recipe(float8='tensorwise'))" in text) == (best.float8 == "tensorwise")
    from nbscaler.planning.target_explanation import describe
    row = {**frame.iloc[0].to_dict(), "float8": "rowwise", "compiled": True}
    assert describe(row).endswith(", fp8 rowwise (train with Recipe(float8='rowwise')), compiled (train with "
                                  "ComputeConfig(compile=True))")
