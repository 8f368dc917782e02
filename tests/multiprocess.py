"""The one place where tests start several ranks.

Every multi-process test goes through ``run_ranks``, which always has a timeout: a hung collective
fails the test with the ranks that never finished instead of stalling the suite.
"""

from typing import Any, Callable, List

from nbscaler.runtime.launch import spawn

DEFAULT_TIMEOUT = 240.0


def run_ranks(fn: Callable[..., Any], nranks: int, *args: Any, timeout: float = DEFAULT_TIMEOUT) -> List[Any]:
    """Run ``fn(*args)`` on ``nranks`` gloo ranks and return their results in rank order."""
    return spawn(fn, nranks, *args, timeout=timeout)
