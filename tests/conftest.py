"""What every test session shares: a cost-model cache of its own.

Plans time their ops from a profile, and clusters calibrate their collectives, into the cost
model's cache (``nbscaler.cost.cache``). The suite keeps those in a folder of its own, made for the
session and removed after it, so that it neither reads what an earlier run or a user's notebook
left in ``~/.cache/nbscaler`` nor writes there. Set ``NBSCALER_CACHE_DIR`` yourself to keep one
across runs (a faster edit-test loop); it is then left as it is.
"""

import os
import shutil
import tempfile

if "NBSCALER_CACHE_DIR" not in os.environ:
    # Set at import, before any test starts a rank, an engine or a kernel: they inherit it.
    _SESSION_CACHE = tempfile.mkdtemp(prefix="nbscaler-test-cache-")
    os.environ["NBSCALER_CACHE_DIR"] = _SESSION_CACHE
else:
    _SESSION_CACHE = None


def pytest_unconfigure(config):
    if _SESSION_CACHE is not None:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)
