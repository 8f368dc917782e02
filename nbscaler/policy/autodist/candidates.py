"""The configs autodist compares: each unit size it may use, with each pipeline stage count.

A unit of fewer devices makes more data-parallel units, each trained on its own batch, so a step's
work differs between candidates; ``samples_per_step`` says how much, and the search compares them by
predicted time per batch.

>>> [(c.plan_ngpus, c.units) for c in candidate_configs(ComputeConfig(2, 2, pas_config={"autodist_plan_ngpus": "auto"}),
...                                                   AutodistOptions(autodist_plan_ngpus="auto"))]
[(1, 2), (2, 1)]
"""

from __future__ import annotations

from typing import List, Tuple

from nbscaler.config import ComputeConfig
from nbscaler.policy.autodist.options import AutodistOptions
from nbscaler.policy.primitives import PolicyError
from nbscaler.schedule import scheduler_spec


def stage_count_configs(cfg: ComputeConfig, opts: AutodistOptions) -> List[ComputeConfig]:
    """The configs to search: ``cfg`` itself, or one per pipeline stage count ``autodist_nstages`` allows
    (``'auto'``: every divisor of ``plan_ngpus`` from 2 up, so each stage gets the same devices)."""
    wanted = opts.autodist_nstages
    if wanted is None:
        return [cfg]
    if not cfg.use_pipeline:
        raise PolicyError(f"pas_config['autodist_nstages']={wanted!r} chooses pipeline stages, but the config has "
                          "no pipeline; set use_pipeline=True (with use_end2end=True and pipeline_nmicros).")
    counts = [wanted] if wanted != "auto" else [k for k in range(2, cfg.plan_ngpus + 1) if cfg.plan_ngpus % k == 0]
    fixed = scheduler_spec(cfg.scheduler).fixed_nstages         # the scheduler runs this count only
    if fixed is not None:
        counts = [k for k in counts if k == fixed]
    out = []
    for k in counts:
        try:
            out.append(cfg.with_changes(pipeline_nstages=k))
        except ValueError as err:
            raise PolicyError(f"autodist_nstages={k} does not fit this config: {err}") from None
    if not out:
        raise PolicyError(f"no pipeline stage count to try for plan_ngpus={cfg.plan_ngpus} under {cfg.scheduler}; "
                          "give autodist_nstages as a number of stages that divides plan_ngpus.")
    return out


def unit_sizes(cfg: ComputeConfig, opts: AutodistOptions) -> List[int]:
    """The devices per unit to search: ``plan_ngpus``, or as ``autodist_plan_ngpus`` says
    (``'auto'``: every count that divides ``runtime_ngpus``, from 1, which is data parallelism)."""
    wanted, total = opts.autodist_plan_ngpus, cfg.runtime_ngpus
    if wanted is None:
        return [cfg.plan_ngpus]
    if wanted == "auto":
        return [d for d in range(1, total + 1) if total % d == 0]
    if total % wanted:
        raise PolicyError(f"pas_config['autodist_plan_ngpus']={wanted} does not divide runtime_ngpus={total}; "
                          f"give one of {[d for d in range(1, total + 1) if total % d == 0]}, or 'auto'.")
    return [wanted]


def with_unit(cfg: ComputeConfig, plan_ngpus: int) -> ComputeConfig:
    try:
        return cfg.with_changes(plan_ngpus=plan_ngpus)
    except ValueError as err:
        raise PolicyError(f"autodist cannot use units of {plan_ngpus} devices with this config: {err}") from None


def scheduler_configs(cfg: ComputeConfig, opts: AutodistOptions) -> List[ComputeConfig]:
    """``cfg``, and with ``autodist_scheduler`` each scheduler it names on the same pipeline devices
    (two stages per device for ``1f1b_interleaved`` and ``zbv``, one for the others), where it fits."""
    if not opts.schedulers or not cfg.use_pipeline:
        return [cfg]
    devices = cfg.grid.pipeline.schedule.ndevices
    out = [cfg]
    for name in opts.schedulers:
        if name == cfg.scheduler:
            continue
        fixed = scheduler_spec(name).stages_per_device
        # a scheduler that takes any number of stages per device gets 2, on the same pipeline devices
        # (hence the same tensor parallelism inside each stage)
        virtual = -1 if fixed is not None or devices == cfg.plan_ngpus else 2
        try:
            out.append(cfg.with_changes(pipeline_scheduler=name, pipeline_nstages=devices * (fixed or 2),
                                        pipeline_virtual_stages=virtual))
        except ValueError:
            continue                        # e.g. micro-batches that interleaving cannot group
    return out


def candidate_configs(cfg: ComputeConfig, opts: AutodistOptions) -> List[ComputeConfig]:
    """Every config to search: each unit size (``unit_sizes``) with each stage count
    (``stage_count_configs``) under each scheduler (``scheduler_configs``). A unit size that cannot
    hold the pipeline is left out when there are others to try."""
    sizes, out, failure = unit_sizes(cfg, opts), [], None
    for size in sizes:
        try:
            for staged in stage_count_configs(with_unit(cfg, size) if size != cfg.plan_ngpus else cfg, opts):
                out += scheduler_configs(staged, opts)
        except PolicyError as err:
            failure = err
    if not out:
        raise failure
    return out


def samples_per_step(cfg: ComputeConfig) -> int:
    """Batches one training step trains: one per micro-batch, in every data-parallel unit."""
    return cfg.units * (cfg.pipeline_nmicros if cfg.use_pipeline else 1)


def config_key(cfg: ComputeConfig) -> Tuple[int, int, str]:
    """What tells two candidates apart: ``(plan_ngpus, pipeline stages, scheduler)``, 1 stage and no
    scheduler without a pipeline."""
    return (cfg.plan_ngpus, cfg.pipeline_nstages, cfg.scheduler) if cfg.use_pipeline else (cfg.plan_ngpus, 1, "")
