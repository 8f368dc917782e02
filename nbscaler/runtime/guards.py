"""Checks that generated code runs for values the trace specialised on.

When forward reads a value computed from the input data into Python (``if mask.all():``), the
traced graph follows the branch taken while tracing. Generated code repeats the read and calls
``expect_traced``, which raises ``GuardError`` when an input takes the module down another path.
"""

from __future__ import annotations

from typing import Any


class GuardError(RuntimeError):
    """An input breaks an assumption the trace made about a value read from the input data."""


def expect_traced(value: Any, traced: Any, expression: str, where: str) -> None:
    """Raise ``GuardError`` unless ``value`` equals ``traced``, the value seen while tracing.

    ``expression`` is the read as generated code writes it (``bool(all_0)``) and ``where`` the
    user's line that made it.
    """
    if value == traced:
        return
    raise GuardError(
        f"{where}: the parallel module was traced with {expression} == {traced!r} and runs the code of that "
        f"branch only, but this input gives {value!r}. Call parallelize again with dummy inputs like this "
        "one, or keep the decision in tensor ops (e.g. torch.where) so one graph serves every input.")
