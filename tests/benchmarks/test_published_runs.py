"""The published-runs script runs, and every figure its sentences give follows from its rows."""

import dataclasses
import re
import statistics

import pytest

from benchmarks.published import report
from benchmarks.published.predict import predict
from benchmarks.published.runs import NARAYANAN_2021


@pytest.fixture(scope="module")
def rows():
    """Two rows of Narayanan et al. 2021, one without a pipeline and one with, micro-batches of one."""
    return [predict(run, [1], log=lambda *_: None) for run in NARAYANAN_2021 if run.params_b in (1.7, 39.1)]


@pytest.mark.slow
def test_the_table_and_the_verdict_are_computed_from_the_predictions(rows):
    text = report.megatron_section(rows)
    errors = [report.error(r) for r in rows]
    for r, e in zip(rows, errors):
        run = r["run"]
        assert run.published_step_s == pytest.approx(run.paper_flops / (run.tflops_per_gpu * 1e12 * run.gpus))
        assert e == pytest.approx(run.published_step_s / r["best"].step_s - 1, rel=1e-12)
        assert f"| {run.params_b:g} | {run.tp} | {run.pp} |" in text and f"| {e:+.1%} |" in text
    mean, worst = statistics.fmean(abs(e) for e in errors), max(abs(e) for e in errors)
    said = re.search(r"mean \|error\| is ([\d.]+)% and the largest ([\d.]+)%: the goal .* is (met|not met)", text)
    assert said and float(said[1]) == round(100 * mean, 1) and float(said[2]) == round(100 * worst, 1)
    assert said[3] == ("met" if mean <= 0.05 and worst <= 0.10 else "not met")


@pytest.mark.slow
def test_every_fact_is_undone_alone_and_its_sign_said(rows):
    for r in rows:
        assert set(r["ablation"]) == set(report.ABLATIONS)
        assert (r["ablation"]["stages balanced by FLOPs"] is None) == (r["run"].pp == 1)
        flash = r["ablation"]["FlashAttention"]
        assert flash < 0                                   # the materialised scores lengthen every row's step
    assert "so the fact lengthens it: FlashAttention" in report.megatron_section(rows)


def test_the_paper_flops_are_its_equation_3():
    run = next(r for r in NARAYANAN_2021 if r.params_b == 145.6)
    b, s, l, h, v = 2304, 2048, 80, 12288, 51200
    assert run.paper_flops == 96 * b * s * l * h ** 2 * (1 + s / (6 * h) + v / (16 * l * h))
    assert run.published_step_s == pytest.approx(24.8, abs=0.1)


# -- torchtitan's Llama row, at a small shape ----------------------------------------------------
@pytest.fixture(scope="module")
def small_llama():
    """torchtitan's row at a small Llama (2 layers, hidden 256) on its 8 GPUs, with its published figures."""
    from benchmarks.published.torchtitan import LLAMA_RUNS, predict_llama
    run = dataclasses.replace(LLAMA_RUNS[0], hidden=256, intermediate=512, layers=2, heads=8, seq=256)
    return run, predict_llama(run, log=lambda *_: None)


@pytest.mark.slow
def test_the_llama_row_is_planned_as_torchtitan_shards_it(small_llama):
    import torch
    import nbscaler
    from benchmarks.published import torchtitan
    run, _ = small_llama
    cfg = torchtitan.config(run, {"recompute": "none"})
    assert (cfg.use_zero, cfg.zero_stage, cfg.zero_reshard_after_forward) == (True, 3, True)
    ids = torch.zeros(run.local_batch, run.seq, dtype=torch.long)
    plan = nbscaler.plan(torchtitan.hf_llama(run), {"input_ids": ids, "labels": ids.clone()}, "data", cfg)
    units = plan.units
    assert sorted(units["unit"]) == ["(rest)"] + [f"model.layers.{i}" for i in range(run.layers)]
    assert units.set_index("unit")["freed_after_forward"].to_dict() == {
        "(rest)": False, **{f"model.layers.{i}": True for i in range(run.layers)}}


@pytest.mark.slow
def test_the_llama_tables_and_verdict_are_computed_from_the_rows(small_llama):
    from benchmarks.published import torchtitan
    run, rows = small_llama
    text = torchtitan.section(run, rows)
    assert "no FSDP" not in text
    for r in rows:
        step = r["step"]
        tokens = step.tokens_per_s / run.gpus
        assert r["tokens_error"] == pytest.approx(tokens / run.tokens_per_s_per_gpu - 1, rel=1e-12)
        assert r["memory_error"] == pytest.approx(step.peak_bytes / 2 ** 30 / run.peak_memory_gib - 1, rel=1e-12)
        assert (f"| {r['recompute']} | {r['peak']} | {step.step_time_s:.2f} | {tokens:,.0f} | "
                f"{run.tokens_per_s_per_gpu:,.0f} | {r['tokens_error']:+.1%} | {step.peak_bytes / 2 ** 30:.1f} | "
                f"{run.peak_memory_gib:.1f} | {r['memory_error']:+.1%} |") in text
        assert sum(r["parts"].values()) == pytest.approx(step.step_time_s, rel=1e-9)   # the parts are the whole step
        assert sum(r["memory"].values()) == pytest.approx(step.peak_bytes, rel=1e-12)  # and the whole peak
    met = [r for r in rows if abs(r["tokens_error"]) <= 0.10 and abs(r["memory_error"]) <= 0.10]
    said = re.search(r"is met by (none|\d+) of the (\d+) rows", text)
    assert said and int(said[2]) == len(rows) and said[1] == (str(len(met)) if met else "none")


@pytest.mark.slow
def test_the_ladder_prices_each_rungs_facts_and_computes_its_verdict(small_llama):
    from benchmarks.published import torchtitan_ladder as L
    run, _ = small_llama
    rows = L.predict_ladder(run, log=lambda *_: None)
    from benchmarks.published import torchtitan
    assert len(rows) == len(torchtitan.BRACKET) * 2 * len(L.RUNGS)      # two recomputations, two peaks
    compiled, fp8 = L.RUNGS[1], L.RUNGS[2]
    assert compiled.hardware(torchtitan.grand_teton_h100(1)).software.compiled_modules == ("layers",)
    assert fp8.recipe().float8 == "tensorwise" and fp8.recipe().float8_skip == ("lm_head",)
    text = L.section(run, rows)
    for r in rows:
        rung = r["rung"]
        assert r["tokens_error"] == pytest.approx(r["tokens_per_s_per_gpu"] / rung.tokens_per_s_per_gpu - 1, rel=1e-12)
        assert f"| {rung.name} | {r['recompute']} | {r['peak']} | {r['step'].step_time_s:.2f} | " in text
    by_place = {}
    for r in rows:
        by_place.setdefault((r["recompute"], r["peak"]), []).append(r["tokens_per_s_per_gpu"])
    assert all(eager < compiled for eager, compiled, _ in by_place.values())   # compiling shortens the step
    # (at this small shape fp8's casts can cost more than its products save: no order asserted there)
    ups = L.step_ups(rows)
    assert [u["published"] for u in ups[:2]] == pytest.approx([6667 / 5762, 8532 / 6667])
    met = sum(abs(u["error"]) <= L.STEP_GOAL for u in ups)
    assert f"Each step up within 5% of the published: {met} of {len(ups)}" in text
    block = L.summary_block(rows)                      # the README's summary: the step ups and the same verdict
    assert L.verdict(rows, ups) in block and all(f"| {u['predicted']:.3f} | {u['published']:.3f} |" in block for u in ups)


# -- torchtitan's context-parallel table, at a small shape ---------------------------------------
@pytest.fixture(scope="module")
def small_context():
    """The table's four layouts at a small Llama (2 layers, hidden 256), 256 tokens a device, with the
    published figures."""
    from benchmarks.published import torchtitan, torchtitan_context as C
    shape = dataclasses.replace(torchtitan.LLAMA_RUNS[0], hidden=256, intermediate=512, layers=2, heads=8)
    rows = [dataclasses.replace(r, seq=256 * r.cp) for r in C.ROWS]
    return rows, C.predict_context(rows, shape, log=lambda *_: None)


@pytest.mark.slow
def test_each_context_row_is_planned_as_the_table_ran_it(small_context):
    from benchmarks.published import torchtitan_context as C
    rows, priced = small_context
    assert len(priced) == 2 * (1 + 2 * (len(rows) - 1))          # two peaks; both kinds where cp > 1
    for row in rows:
        cfg = C.config(row, "ring")
        assert (cfg.plan_ngpus, cfg.runtime_ngpus, cfg.zero_stage) == (row.cp, 8, 3)
        assert cfg.pas_config.get("context_parallel", 1) == row.cp and cfg.pas_config["recompute"] == "full"
    for r in priced:
        assert r["step"].hardware.software.compiled and r["tokens_error"] == pytest.approx(
            r["step"].tokens_per_s / 8 / r["row"].tokens_per_s_per_gpu - 1, rel=1e-12)
        assert sum(r["parts"].values()) == pytest.approx(r["step"].step_time_s, rel=1e-9)
        assert ("context-parallel collectives" in r["shares"]) == (r["row"].cp > 1)


@pytest.mark.slow
def test_the_context_tables_and_verdict_are_computed_from_the_rows(small_context):
    from benchmarks.published import torchtitan_context as C
    _, priced = small_context
    text = C.section(priced)
    for r in priced:
        row = r["row"]
        assert (f"| FSDP {row.fsdp}, CP {row.cp} | {row.seq:,} | {r['kind']} | {r['peak']} | "
                f"{r['step'].step_time_s:.2f} | {r['tokens_per_s_per_gpu']:,.0f} | {row.tokens_per_s_per_gpu:,.0f} | "
                f"{r['tokens_error']:+.1%} |") in text
    for s in C.scaling(priced):
        assert s["published"] == pytest.approx(s["row"].tokens_per_s_per_gpu / 3890)
        assert f"| {s['predicted']:.3f} | {s['published']:.3f} | {s['error']:+.1%} |" in text
    met = sum(abs(r["tokens_error"]) <= C.GOAL for r in priced)
    assert f"Within 10% of the published tokens/s per GPU: {met} of {len(priced)} priced rows" in text
    assert C.verdict(priced) in C.summary_block(priced)


# -- Megatron-Bridge's GPT-OSS 120B, at a small shape ---------------------------------------------
SMALL_MOE = dict(vocab_size=256, n_layer=4, d_model=64, n_head=4, n_kv_head=2, head_dim=16, n_experts=8,
                 expert_hidden=32, top_k=2)


@pytest.fixture(scope="module")
def small_moe():
    """The GPT-OSS row's layout (64 GPUs: 4 stages of 8 expert-parallel devices) at a small MoE."""
    from benchmarks.published import megatron_bridge as M
    run = dataclasses.replace(M.GPT_OSS_120B, seq=64)
    return run, M.predict_moe(run, log=lambda *_: None, **SMALL_MOE, sliding_window=16)


@pytest.mark.slow
def test_the_moe_row_is_planned_with_its_layout_and_priced_from_its_rows(small_moe):
    from benchmarks.published import megatron_bridge as M
    run, rows = small_moe
    assert (run.units, run.micro_batches) == (2, 8)            # 64 / (4 x 8); 512 / (2 x 8 x 4)
    cfg = M.config(run, "full")
    assert (cfg.plan_ngpus, cfg.runtime_ngpus, cfg.pipeline_nstages, cfg.pipeline_nmicros) == (32, 64, 4, 8)
    assert cfg.pas_config["expert_parallel"] == 8
    assert rows[0]["step"].hardware.software.attention == "cudnn"        # Transformer Engine's attention
    net = M.model(run, **{**SMALL_MOE, "sliding_window": 16})
    assert [b.attn.window for b in net.blocks] == [16, None, 16, None]  # GPT-OSS's alternating window
    text = M.section(run, rows)
    assert [r["recompute"] for r in rows] == list(M.RECOMPUTE)
    for r in rows:
        step = r["step"]
        assert r["tokens_error"] == pytest.approx(step.tokens_per_s / 64 / run.tokens_per_s_per_gpu - 1, rel=1e-12)
        assert (f"| {r['recompute']} | {step.step_time_s:.2f} | {r['tokens_per_s_per_gpu']:,.0f} | 5,630 | "
                f"{r['tokens_error']:+.1%} |") in text
        assert r["shares"]["expert all-to-alls"] > 0            # the exchanges are priced
    assert rows[1]["step"].step_time_s > rows[0]["step"].step_time_s      # recomputing every layer costs time
    met = [r["recompute"] for r in rows if abs(r["tokens_error"]) <= M.GOAL]
    assert ("Within 15%: " + (", ".join(met) if met else "neither row")) in text
    assert M.verdict(run, rows) in M.summary_block(run, rows)
