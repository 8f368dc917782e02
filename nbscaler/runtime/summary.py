"""A parallel module described as a small HTML card, for notebooks (``ParallelModule._repr_html_``).

It says which rank this is, how the compile splits the work, and what this rank holds: each local
parameter and buffer with the slice of the original tensor it is. Plain HTML, no scripts, so a
saved notebook shows it anywhere.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import TYPE_CHECKING, List

from nbscaler.units import fmt_bytes

if TYPE_CHECKING:
    from nbscaler.runtime.module import ParallelModule

MAX_WEIGHT_ROWS = 40


def config_line(module: "ParallelModule") -> str:
    """The compute config in one line: devices, units, pipeline and ZeRO settings, and whether the
    rank runs compiled (with the seconds its compiles took so far)."""
    cfg = module.compute_config
    parts = [f"plan_ngpus={cfg.plan_ngpus}", f"runtime_ngpus={cfg.runtime_ngpus}"]
    if cfg.use_pipeline:
        parts.append(f"pipeline {cfg.pipeline_scheduler}: {cfg.pipeline_nstages} stages x {cfg.pipeline_nmicros} micro-batches")
    if cfg.use_zero:
        parts.append(zero_line(module))
    if cfg.inference_only:
        parts.append("inference only")
    if cfg.compile:
        seconds = module.compile_seconds
        parts.append(f"torch.compile ({cfg.compile_backend}, {seconds:.1f} s so far)")
    return ", ".join(parts)


def zero_line(module: "ParallelModule") -> str:
    """ZeRO's stage and the ranks this rank splits its state with: ``zero_units`` units of its plan
    device, and the devices of its context-parallel group where ZeRO spans them too."""
    cfg, grid = module.compute_config, module.compute_config.grid
    over = f"{grid.zero_units} unit(s)"
    if grid.zero_over_stage:
        over += f" x {len(grid.same_weight_devices(module.plan_device))} context-parallel devices"
    return (f"ZeRO stage {cfg.zero_stage}: state split over ranks {list(grid.zero_ranks(module.world_rank))} "
            f"({over}), {cfg.zero_ngroups} group(s)")


def weight_rows(module: "ParallelModule") -> List[str]:
    """One ``<tr>`` per local parameter or buffer: its original name, kind, shapes and slice."""
    rows = []
    for attr, spec in list(module.weight_specs.items())[:MAX_WEIGHT_ROWS]:
        local = getattr(module, attr, None)
        size = local.numel() * local.element_size() if local is not None else 0
        where = "whole" if spec.split_dim is None else f"part {spec.index + 1}/{spec.parts} of dim {spec.split_dim}"
        where += f" and dim {spec.inner_dim}" if spec.inner_dim is not None else ""
        cells = [spec.name, spec.kind, tuple(spec.shape), spec.local_shape, where, fmt_bytes(size)]
        rows.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in cells) + "</tr>")
    if len(module.weight_specs) > MAX_WEIGHT_ROWS:
        rows.append(f"<tr><td colspan=6>... {len(module.weight_specs) - MAX_WEIGHT_ROWS} more</td></tr>")
    return rows


def module_html(module: "ParallelModule") -> str:
    """The card: who this rank is, the config, the totals and the table of local weights."""
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    buffers = sum(b.numel() * b.element_size() for b in module.buffers())
    original = Path(module.gen_dir).parent.name         # <gen_savedir>/_parallel_modules/<module>/<instance>
    title = html.escape(f"ParallelModule of {original}: rank {module.world_rank} of "
                        f"{module.compute_config.runtime_ngpus} (plan device {module.plan_device}, unit {module.unit}) "
                        f"on {module.device}")
    head = "".join(f"<th>{h}</th>" for h in ("original tensor", "kind", "shape", "local shape", "slice", "bytes"))
    return (f"<div class='nbs-parallel-module'><b>{title}</b><br><code>{html.escape(config_line(module))}</code><br>"
            f"parameters {fmt_bytes(params)}, buffers {fmt_bytes(buffers)}; generated in "
            f"<code>{html.escape(str(module.gen_dir))}</code>"
            f"<table style='border-collapse:collapse;font-size:12px'><tr>{head}</tr>{''.join(weight_rows(module))}"
            f"</table></div>")
