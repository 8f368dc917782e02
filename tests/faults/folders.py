"""Faults of the generated files: their folder deleted, or changed by another compile, while the
cluster's ranks use the module loaded from it."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch

import nbscaler
from nbscaler import ComputeConfig
from tests.faults.staging import (TP, Row, error_of, first_line, module_dir, names_rank, train_steps, usable,
                                  whole_gen_dir)
from tests.models import batch, build
from tests.multiprocess import parallelize_on


def generated_folder_deleted(cluster: Any, folder: Path) -> Row:
    """Delete the whole ``gen_savedir`` between two training calls, then compile into it again."""
    gen = folder / "gen"
    remote = parallelize_on(cluster, TP, str(gen))
    train_steps(remote, 1, optimizer_fn=torch.optim.SGD, lr=0.1)
    shutil.rmtree(gen)
    err, _ = error_of(lambda: train_steps(remote, 2))
    again, _ = error_of(lambda: parallelize_on(cluster, TP, str(gen)))
    rewritten = again is None and whole_gen_dir(module_dir(gen), TP.runtime_ngpus)
    works, why = usable(cluster, folder)
    return Row("generated-files folder deleted while in use", None,
               first_line(err) if err is not None else "no error", err is None, err is None, rewritten, works,
               why or "the ranks had loaded the module: training goes on, and the next parallelize writes the folder anew")


def generated_folder_changed(cluster: Any, folder: Path) -> Row:
    """Another compile (another policy, same instance name) replaces the folder while this cluster
    trains the module loaded from it; this cluster then asks to reuse the folder."""
    gen = folder / "gen"
    remote = parallelize_on(cluster, TP, str(gen))
    train_steps(remote, 1, optimizer_fn=torch.optim.SGD, lr=0.1)
    path = module_dir(gen)
    nbscaler.parallelize(build(TP.model), batch(TP.model, 12345), "dp", ComputeConfig(plan_ngpus=1, runtime_ngpus=2),
                         gen_savedir=str(gen), reuse="override", instance_name=path.name, load_module=False)
    trained, _ = error_of(lambda: train_steps(remote, 1))
    start = time.monotonic()
    err, ended = error_of(lambda: cluster.parallelize(build(TP.model), batch(TP.model, 12345), TP.policy,
                                                      TP.compute_config, gen_savedir=str(gen), reuse="match",
                                                      instance_name=path.name))
    works, why = usable(cluster, folder)
    cause = "reuse='override'" in str(err)
    return Row("generated-files folder changed while in use", ended - start, first_line(err), names_rank(err, 0),
               cause, trained is None and whole_gen_dir(path, TP.runtime_ngpus), works,
               why or "training goes on with the loaded module; reusing the changed folder is refused")
