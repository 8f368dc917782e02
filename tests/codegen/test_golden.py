"""Generated code is a contract: these rank files must come out exactly as saved.

A change to what code generation prints (a layout rule, a name, a comment) shows up here as a diff
of the files under ``tests/codegen/golden/``, to be read and accepted on purpose. After a deliberate
change, write them anew and review the diff::

    python -m tests.codegen.test_golden            # rewrites tests/codegen/golden/*.txt
    git diff tests/codegen/golden
"""

from pathlib import Path

import pytest

import nbscaler
from tests.models import batch, build
from tests.multiprocess import Case, pipeline, recompute, zero

GOLDEN = Path(__file__).parent / "golden"

# name -> (case, rank whose file is kept)
CASES = {
    "llama_tp_rank1": (Case("llama", "tp", 2, 2), 1),                                 # split heads, sum_grad, vocab rows
    "gpt_pp_stage1": (Case("gpt", "pp", 2, 2, config=pipeline("1f1b", 2, 4)), 1),     # receives its carry, returns the loss
    "gpt_tp_recompute_rank0": (Case("gpt", "tp", 2, 2, config=recompute("Block")), 0),  # checkpointed blocks
    "mlp_data_zero2_rank3": (Case("mlp", "data", 2, 4, config=zero(stage=2)), 3),     # ZeRO 2: weights' sum_grad in the code
    "gpt_tp_zero3_rank2": (Case("gpt", "tp", 2, 4, config=zero(stage=3) + recompute("Block")), 2),  # units gathered, freed
    "llama_tp_fp8_rank1": (Case("llama", "tp", 2, 2, float8="rowwise"), 1),           # float8_linear, scales' groups
}


def generated(case: Case, rank: int) -> str:
    plan = nbscaler.plan(build(case.model), batch(case.model, 0), case.policy, case.compute_config,
                         recipe=case.recipe)
    return plan.sources[rank]


@pytest.mark.parametrize("name", sorted(CASES))
def test_generated_code_is_exactly_the_golden_file(name):
    case, rank = CASES[name]
    expected = (GOLDEN / f"{name}.txt").read_text()
    assert generated(case, rank) == expected, (
        f"gencode{rank}.py of {case} changed; if on purpose, run `python -m tests.codegen.test_golden` "
        "and review `git diff tests/codegen/golden`")


if __name__ == "__main__":
    for name, (case, rank) in CASES.items():
        (GOLDEN / f"{name}.txt").write_text(generated(case, rank))
        print("wrote", GOLDEN / f"{name}.txt")


def test_each_line_shows_its_local_shape_and_each_source_line_is_quoted_once():
    """The MLP's ``h = F.gelu(self.fc1(x))`` runs two nodes in two modules: one quote of the line,
    then only the second module's name. Under tp on 2 devices fc1's output is half its width here."""
    code = generated(Case("mlp", "tp", 2, 2), 1)
    assert code.count("(__init__.py:29)") == 1 and "\n        # (top level)\n" in code
    assert 'linear_0: "f32[8, 16]" = F.linear(x_sum_grad, self.fc1_weight, self.fc1_bias)' in code
    assert 'linear_1_full: "f32[8, 32]" = comm.all_reduce(linear_1, group=g0_1)' in code
