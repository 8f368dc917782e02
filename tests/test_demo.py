"""The demo's table: each measured step beside the step predicted for it, then what the predictions assume."""

from nbscaler import demo


def _row(case, predicted_s, assumed):
    return {"case": case, "compile_s": 0.5, "step_s": 0.066, "predicted_s": predicted_s, "assumed": assumed,
            "match": True, "rel_err": 0.0, "gen_dir": "/tmp/x"}


def test_the_table_sets_predicted_beside_measured_and_says_what_it_assumes(capsys):
    tp, dp = demo.DemoCase("tp", 2, 4), demo.DemoCase("dp", 1, 4)
    rows = [_row(dp, 0.018, ["line a"]), _row(tp, 0.168, ["line a", "line b"])]
    demo.print_table(rows)
    out = capsys.readouterr().out
    assert "predicted s" in out.splitlines()[0]
    assert "0.066        0.168" in out
    assert out.rstrip().endswith("the predicted steps assume:\n  line a\n  line b")
    assert list(demo.runs_frame(rows).predicted_step_s) == [0.018, 0.168]
