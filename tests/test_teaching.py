"""The walkthroughs' two teaching helpers."""

import pytest

from nbscaler.teaching import check, states


def test_states_passes_the_figure_the_text_gives_and_names_a_drifted_one():
    states(0.4286, 0.43, 2)
    states(171.4, 171, 0)
    with pytest.raises(AssertionError, match="0.4286 does not round to the stated 0.5 .*update the text"):
        states(0.4286, 0.5, 1)


def test_check_says_right_within_its_tolerance_and_waits_for_a_prediction(capsys):
    assert check(None, 10.0) is None
    assert "write your prediction first" in capsys.readouterr().out
    assert check(10.1, 10.0) is True
    assert "right: you said 10.1" in capsys.readouterr().out
    assert check(12, 10.0, unit="ms") is False
    assert capsys.readouterr().out.startswith("not quite: you said 12 ms, it is 10 ms")
    assert check(3_670_016, 3_670_016, rel=1e-9) is True
    capsys.readouterr()
    assert check(25_344, 25_344.0, unit="bytes") is True
    assert capsys.readouterr().out == "right: you said 25,344 bytes, it is 25,344 bytes\n"
