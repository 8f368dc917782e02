"""Two helpers the walkthroughs teach with: ``states`` ties a figure in the prose to the value a
cell computed, and ``check`` tells a learner whether the prediction of an exercise was right.

A walkthrough's text states figures ("the bubble is 0.43 of the step"). Each is asserted in the cell
that computes it, so that a change to nbscaler which moves the figure fails the notebook suite
instead of leaving the prose wrong.
"""

from __future__ import annotations

from typing import Optional


def states(value: float, stated: float, digits: int) -> None:
    """Raise ``AssertionError`` unless ``value`` rounds to ``stated`` at ``digits`` after the point.

    >>> states(0.4286, 0.43, 2)
    """
    if round(float(value), digits) != stated:
        raise AssertionError(f"{value} does not round to the stated {stated} ({digits} digits): "
                             "the text states a figure this cell no longer computes; update the text.")


def check(prediction: Optional[float], actual: float, rel: float = 0.02, unit: str = "") -> Optional[bool]:
    """Compare a learner's ``prediction`` with what the cell measured or computed, and say so.

    Right means within ``rel`` of ``actual`` (2% by default: a prediction worked out by hand from the
    formulas of the notebook lands there; a wrong idea lands far off). Returns ``None`` while the
    prediction is still ``None`` (the exercise not yet tried), else whether it was right.
    """
    suffix = f" {unit}" if unit else ""
    if prediction is None:
        print("write your prediction first (the answer is in the collapsed cell at the end)")
        return None
    right = abs(float(prediction) - float(actual)) <= rel * max(abs(float(actual)), 1e-12)
    print(f"{'right' if right else 'not quite'}: you said {figure(prediction)}{suffix}, "
          f"it is {figure(actual)}{suffix}")
    return right


def figure(value: float) -> str:
    """A number as ``check`` writes it: from a thousand up, whole with separators (``25,344``, not
    ``2.534e+04``); below, four significant digits (``0.1111``, ``40.32``)."""
    value = float(value)
    return f"{value:,.0f}" if 1e3 <= abs(value) < 1e18 else f"{value:.4g}"
