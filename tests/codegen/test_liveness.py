"""Generated forwards free each local after its last use, so a rank holds no more during its forward
than the user's module does: what autograd saved plus what later ops still read."""

import pytest
import torch

from nbscaler import ComputeConfig, parallelize
from nbscaler.codegen.liveness import release_dead
from tests.models import batch, build


def forward_peak(module, data) -> int:
    """The most bytes the forward held at once beyond the module's parameters and buffers, as
    PyTorch's MemTracker counts them (the instrument the native benchmark uses for both sides)."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    tracker = MemTracker()
    tracker.track_external(module)
    with tracker:
        module(**data)
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return peak["Total"] - peak[_MemRefType.PARAM] - peak[_MemRefType.BUFFER]


@pytest.mark.parametrize("name, dtype", [("gpt", torch.float32), ("llama", torch.bfloat16)])
def test_compiled_forward_holds_no_more_than_the_module(tmp_path, name, dtype):
    model = build(name).to(dtype)
    pm = parallelize(build(name), batch(name, 0), "dp", ComputeConfig(1, 1), gen_savedir=tmp_path,
                     module_dtype=dtype)
    data = batch(name, 1)
    ours, plain = forward_peak(pm, data), forward_peak(model, data)
    # Dead intermediates held to the end of the flat forward (a residual branch's output, an
    # embedding's lookup) made the compiled forward's peak larger than the module's.
    assert 0 < ours <= plain


def test_release_dead_keeps_lines_and_what_later_statements_read():
    lines = ["# a comment", "a = f(x)  # why", "b = g(a)", "def recompute_r(b):", "    t = h(b, g01)", "    return t",
             "c = checkpoint(recompute_r, b)", "d = (a +", "     c)", "x += d", "return x"]
    assert release_dead(lines) == [
        "# a comment", "a = f(x)  # why", "b = g(a)", "def recompute_r(b):", "    t = h(b, g01)", "    return t",
        "c = checkpoint(recompute_r, b);  del b", "d = (a +", "     c);  del a, c", "x += d;  del d", "return x"]
