"""The folder of generated files for one parallel module, written atomically.

``<gen_savedir>/_parallel_modules/<module>/<instance>/`` holds:

==================  =========================================================
``gencode{r}.py``   the readable per-rank module (one per runtime rank)
``weights.pt``      the original module's weights, from which ranks take slices
``config.json``     the compute config and the fingerprint that decides reuse
``graph.pkl``       the traced graphs, for ``reuse='graph'`` and for inspection
``plan.json``       a summary of the placements, for the widgets
==================  =========================================================

A new set of files is written to a temporary folder next to the final one and renamed into place,
so a crash leaves either the old complete folder or the new complete one, never half of each.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, Optional, Type

import torch

from nbscaler.config import ComputeConfig

CONFIG_FILE = "config.json"
GRAPH_FILE = "graph.pkl"
PLAN_FILE = "plan.json"
WEIGHTS_FILE = "weights.pt"


def gencode_file(rank: int) -> str:
    return f"gencode{rank}.py"


def module_dir(module_class: type, gen_savedir, instance_name: Optional[str]) -> Path:
    qualname = f"{module_class.__module__}.{module_class.__qualname__}".replace("<locals>", "locals")
    return Path(gen_savedir) / "_parallel_modules" / qualname / (instance_name or "_")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file and a rename."""
    atomic_write(path, lambda f: f.write(data))


def atomic_write(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Call ``write(file)`` on a temporary file next to ``path``, then rename it to ``path``: a
    crash leaves the old file or the new one, never half of the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class GenDir:
    """One parallel module's folder of generated files."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def exists(self) -> bool:
        return (self.path / CONFIG_FILE).exists()

    def read_config(self) -> Optional[Dict[str, Any]]:
        if not self.exists():
            return None
        return json.loads((self.path / CONFIG_FILE).read_text())

    def read_graphs(self):
        with open(self.path / GRAPH_FILE, "rb") as f:
            return pickle.load(f)

    def compute_config(self) -> ComputeConfig:
        return ComputeConfig.from_dict(self.read_config()["compute_config"])

    def files(self) -> Dict[str, Path]:
        return {p.name: p for p in sorted(self.path.iterdir()) if p.is_file()}

    def replace_with(self, write: "callable") -> None:
        """Build a complete new folder with ``write(tmp_path)``, then swap it in for the old one."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=self.path.parent, prefix=f".{self.path.name}.new."))
        try:
            write(tmp)
            old = None
            if self.path.exists():
                old = Path(tempfile.mkdtemp(dir=self.path.parent, prefix=f".{self.path.name}.old."))
                os.rename(self.path, old / "dir")
            os.rename(tmp, self.path)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def write_weights(self, tmp: Path, weights: Optional[Dict[str, "torch.Tensor"]]) -> None:
        """Put the weights file into the new folder ``tmp``, writing it only when it changed.

        ``weights=None`` keeps the current file. Otherwise, when the current file holds exactly
        these tensors (names, dtypes, shapes and values, compared through a memory-mapped load),
        it is hard-linked rather than written again: recompiling a large model with other
        settings then costs no weight I/O.
        """
        old = self.path / WEIGHTS_FILE
        if old.exists() and (weights is None or _same_tensors(old, weights)):
            try:
                os.link(old, tmp / WEIGHTS_FILE)
            except OSError:                   # a file system without hard links
                shutil.copyfile(old, tmp / WEIGHTS_FILE)
            return
        if weights is None:
            raise FileNotFoundError(f"{old} is missing, and no module was given to write it from")
        torch.save(weights, tmp / WEIGHTS_FILE)

    def load_class(self, rank: int) -> Type:
        """Import ``gencode{rank}.py`` and return its module class, bound to this folder."""
        path = self.path / gencode_file(rank)
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: was the module compiled for this many ranks, and are "
                                    "the generated files visible on this machine (see broadcast_strategy)?")
        name = f"nbscaler_generated_{abs(hash(str(self.path.resolve())))}_rank{rank}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        cls = module.GenModule
        cls.gen_dir = self.path
        cls.compute_config = self.compute_config()
        return cls


def _same_tensors(path: Path, weights: Dict[str, "torch.Tensor"]) -> bool:
    try:
        saved = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception:                          # unreadable or older format: write it again
        return False
    if saved.keys() != weights.keys():
        return False
    return all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
               for a, b in ((saved[k], weights[k]) for k in weights))
