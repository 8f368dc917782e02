"""Compiled rank modules (``ComputeConfig(compile=True)``): they train as the eager ones do, compile
again only for new shapes and say so, time their compiles, and name the cause and the fix when the
backend cannot run.

Compiling is slow on a small CPU (inductor writes and builds C++), so the models are the tiniest of
``tests.models`` and each spawn runs all its cases.
"""

import doctest
import importlib.util
import warnings

import pytest
import torch

from nbscaler import ComputeConfig, ParallelModule, parallelize
from nbscaler.runtime import compiled as compiled_module
from nbscaler.runtime.compiled import CompileError, CompileKind, RecompileWarning
from tests.models import batch, build
from tests.multiprocess import (Case, assert_close, check_equivalence, parallel_model, pipeline, run_ranks, train_case,
                                zero)

COMPILED = (("compile", True),)

PLANS = {
    1: [("mlp", "dp", 1, ()), ("mlp", "tp", 1, ())],
    2: [("mlp", "dp", 1, ()), ("mlp", "tp", 2, ()), ("gpt", "pp", 2, pipeline("1f1b", 2, 2)),
        ("mlp", "dp", 1, zero(1, 3))],          # ZeRO-3 gathers and frees units between compiled pieces
}


def check_same_as_eager(compiled: Case, eager: Case, compiled_runs, eager_runs) -> None:
    """Every rank's losses and gradient slices of the compiled run equal the eager run's, step by step."""
    for rank, (got, want) in enumerate(zip(compiled_runs, eager_runs)):
        for step in range(compiled.steps):
            assert_close(torch.tensor(got["losses"][step]), torch.tensor(want["losses"][step]),
                         f"{compiled} step {step} rank {rank} loss against eager")
            if compiled.compute_config.use_zero:          # a rank keeps only its shard of the summed gradient
                continue
            for (spec, grad), (_, eager_grad) in zip(got["grads"][step][0], want["grads"][step][0]):
                assert_close(grad, eager_grad, f"{compiled} step {step} rank {rank} grad {spec.name} against eager")


def train_counting_compiles(cases, gen_dir):
    """On every rank: ``train_parallel``'s record of each case, with the compiles its module ran."""
    out = []
    for case in cases:
        model = parallel_model(case, gen_dir)
        record = train_case(case, model)
        events = model.compile_events if isinstance(model, ParallelModule) else []
        out.append({**record, "compiles": len([e for e in events if e["kind"] == CompileKind.FORWARD])})
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("nranks", [1, 2])
def test_compiled_ranks_train_like_eager_ranks_and_one_process(nranks, tmp_path):
    pairs = [(Case(model, policy, plan, nranks, config=extra + COMPILED),
              Case(model, policy, plan, nranks, config=extra)) for model, policy, plan, extra in PLANS[nranks]]
    cases = [case for pair in pairs for case in pair]
    per_rank = run_ranks(train_counting_compiles, nranks, cases, str(tmp_path), timeout=900)
    runs = {case: [res[i] for res in per_rank] for i, case in enumerate(cases)}
    for compiled, eager in pairs:
        # the training forward and the eval forward without gradients, at least
        assert all(run["compiles"] >= 2 for run in runs[compiled]), (compiled, [r["compiles"] for r in runs[compiled]])
        assert all(run["compiles"] == 0 for run in runs[eager])
        check_equivalence(compiled, runs[compiled])
        check_same_as_eager(compiled, eager, runs[compiled], runs[eager])


@pytest.mark.multiprocess
def test_compiled_fp8_ranks_train_like_eager_fp8_ranks_and_one_process(tmp_path):
    """fp8 products under tensor parallelism (their scales taken over the group) compiled, as torchtitan
    runs float8: equal to the eager fp8 ranks and to one process's fp8 run."""
    pairs = [(Case("mlp", "tp", 2, 2, config=COMPILED, float8="tensorwise"), Case("mlp", "tp", 2, 2, float8="tensorwise"))]
    cases = [case for pair in pairs for case in pair]
    per_rank = run_ranks(train_counting_compiles, 2, cases, str(tmp_path), timeout=900)
    runs = {case: [res[i] for res in per_rank] for i, case in enumerate(cases)}
    for compiled, eager in pairs:
        assert all(run["compiles"] >= 2 for run in runs[compiled])
        check_equivalence(compiled, runs[compiled])
        check_same_as_eager(compiled, eager, runs[compiled], runs[eager])


def one_rank_mlp(tmp_path, **config):
    return parallelize(build("mlp"), batch("mlp", 0), "dp", ComputeConfig(1, 1, compile=True, **config),
                       gen_savedir=tmp_path)


def train_step(module, rows: int, seed: int):
    module(**batch("mlp", seed, n=rows)).backward()


def forward_compiles(module):
    """The inputs of each forward compile the module ran. (A backward graph is compiled when the first
    backward reaches it, or loaded with the forward from inductor's cache, which times it with the forward.)"""
    return [e["inputs"] for e in module.compile_events if e["kind"] == CompileKind.FORWARD]


@pytest.mark.slow
def test_same_shapes_compile_once_and_a_new_batch_size_compiles_again_and_says_so(tmp_path):
    module = one_rank_mlp(tmp_path)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        train_step(module, 8, seed=1)
        train_step(module, 8, seed=2)               # other values, same shapes
    assert forward_compiles(module) == ["float32[8, 16], int64[8]"]
    assert not [w for w in said if issubclass(w.category, RecompileWarning)]
    first = module.compile_seconds
    assert first > 0

    with pytest.warns(RecompileWarning, match=r"rank 0 compiled _forward again for new inputs float32\[4, 16\], "
                                              r"int64\[4\] \(before: float32\[8, 16\], int64\[8\]\)"):
        train_step(module, 4, seed=3)
    assert forward_compiles(module) == ["float32[8, 16], int64[8]", "float32[4, 16], int64[4]"]
    assert module.compile_seconds > first

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        train_step(module, 8, seed=4)               # a shape it has a graph for already
    assert len(forward_compiles(module)) == 2 and not said


@pytest.mark.slow
def test_a_backend_that_cannot_run_here_names_the_cause_and_the_fix(tmp_path):
    assert importlib.util.find_spec("tvm") is None, "this test needs a listed backend whose package is missing"
    module = one_rank_mlp(tmp_path, compile_backend="tvm")
    with pytest.raises(CompileError, match=r"rank 0: torch.compile\(backend='tvm'\) could not compile _forward: "
                                           r"ImportError: .*tvm.*compile_backend.*compile=False"):
        train_step(module, 8, seed=1)


@pytest.mark.slow
def test_more_shapes_than_dynamo_keeps_graphs_for_is_an_error_not_a_quiet_eager_run(tmp_path):
    module = one_rank_mlp(tmp_path)
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings():
        warnings.simplefilter("ignore", RecompileWarning)
        train_step(module, 8, seed=1)
        train_step(module, 4, seed=2)
        limit_hit = (r"rank 0: _forward has compiled .*config.recompile_limit = 2\) and would run eagerly for "
                     r"inputs float32\[2, 16\], int64\[2\]\. .*pad batches")
        with pytest.raises(CompileError, match=limit_hit):
            train_step(module, 2, seed=3)


def test_eager_modules_report_no_compile_time(tmp_path):
    module = parallelize(build("mlp"), batch("mlp", 0), "dp", ComputeConfig(1, 1), gen_savedir=tmp_path)
    assert module.compile_seconds is None and module.compile_events == [] and module.compiled_methods == {}


def test_turning_compile_on_changes_the_saved_config_which_match_refuses(tmp_path):
    """The loaded module reads ``compile`` from the saved config, so reuse compares it."""
    parallelize(build("mlp"), batch("mlp", 0), "dp", ComputeConfig(1, 1), gen_savedir=tmp_path, load_module=False)
    with pytest.raises(ValueError, match="compute_config.compile was False, now True"):
        parallelize(build("mlp"), batch("mlp", 0), "dp", ComputeConfig(1, 1, compile=True), gen_savedir=tmp_path,
                    load_module=False)


def test_doctests():
    assert doctest.testmod(compiled_module).failed == 0
