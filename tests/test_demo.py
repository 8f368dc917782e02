"""The demo's table: each measured step beside the step predicted for it, then what the predictions assume."""

from nbscaler import demo


def _row(case, predicted_s, assumed, torch_compile_s=None):
    return {"case": case, "compile_s": 0.5, "step_s": 0.066, "predicted_s": predicted_s, "assumed": assumed,
            "match": True, "rel_err": 0.0, "gen_dir": "/tmp/x", "torch_compile_s": torch_compile_s}


def test_the_table_sets_predicted_beside_measured_and_says_what_it_assumes(capsys):
    tp, dp = demo.DemoCase("tp", 2, 4), demo.DemoCase("dp", 1, 4)
    rows = [_row(dp, 0.018, ["line a"]), _row(tp, 0.168, ["line a", "line b"])]
    demo.print_table(rows)
    out = capsys.readouterr().out
    assert "predicted s" in out.splitlines()[0]
    assert "0.066        0.168" in out
    assert out.rstrip().endswith("the predicted steps assume:\n  line a\n  line b")
    assert list(demo.runs_frame(rows).predicted_step_s) == [0.018, 0.168]


def test_compiled_runs_add_a_torch_compile_column_and_the_cases_ask_for_it(capsys):
    tp = demo.DemoCase("tp", 2, 2, (("compile", True),))
    demo.print_table([_row(tp, 0.168, [], torch_compile_s=12.345)])
    header, _, line = capsys.readouterr().out.splitlines()[:3]
    assert "compile s torch.compile s   step s" in header and "0.50           12.35    0.066" in line
    assert all(case.config.compile for case in demo.cases(2, compile=True))
    assert not any(case.config.compile for case in demo.cases(2))
    assert list(demo.runs_frame([_row(tp, 0.168, [], torch_compile_s=1.5)]).torch_compile_s) == [1.5]
