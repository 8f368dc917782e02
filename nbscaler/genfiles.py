"""The folder of generated files for one parallel module, written atomically.

``<gen_savedir>/_parallel_modules/<module>/<instance>/`` holds:

==================  =========================================================
``gencode{r}.py``   the readable per-rank module (one per runtime rank)
``weights.pt``      the original module's weights, from which ranks take slices; not written for
                    a module materialised per rank (built on meta, or given ``weights=``)
``constants.pt``    only then, and only if forward captured any: the traced constants
``config.json``     the compute config, the fingerprint that decides reuse, and (``weights``)
                    where the ranks' weights come from, which each gencode file also states
``graph.pkl``       the traced graphs, for ``reuse='graph'`` and for ``load_plan``, in a format
                    that names nbscaler's types only (``nbscaler.safeload``); not written when
                    the graphs hold another type (a forward that returns its own class)
``plan.json``       a summary of the placements, for the widgets
==================  =========================================================

Nothing here is unpickled without restriction: the graphs and the tensor files are read through
``nbscaler.safeload``, which refuses a file that could run code. The ``gencode{r}.py`` files are
code, imported as they are: the folder must be as private as the user's own code.

Weights files are also hard-linked into ``<gen_savedir>/_weights/`` by a key of their tensors, so
that another module folder compiled from the same weights links the file instead of writing it.

A new set of files is written to a temporary folder next to the final one and renamed into place,
so a crash leaves either the old complete folder or the new complete one, never half of each. A
writer killed half-way leaves its hidden temporary (``.<name>.<host>-<pid>.XXXX``); the next write
of the same file or folder on that host removes it once that process is gone.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib.util
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, BinaryIO, Callable, Dict, Optional, Type

import torch

from nbscaler import safeload
from nbscaler.config import ComputeConfig

CONFIG_FILE = "config.json"
GRAPH_FILE = "graph.pkl"
PLAN_FILE = "plan.json"
WEIGHTS_FILE = "weights.pt"
CONSTANTS_FILE = "constants.pt"    # constants captured by the trace, when weights.pt is not written
WEIGHTS_STORE_DIR = "_weights"     # under gen_savedir: weights files shared by key, see weights_store()
_SAMPLED_VALUES = 1024             # values per tensor in weights_key


def gencode_file(rank: int) -> str:
    return f"gencode{rank}.py"


def weights_footer(weights: Dict[str, Any]) -> str:
    """The lines appended to every ``gencode{rank}.py`` that say where its weights come from (after
    the code, so the line numbers a plan maps its nodes to stay right)."""
    return ("\n# Where this module's initial weights come from (parallelize's weights= / init_seed=); each rank\n"
            "# fills only the slices its weight_specs name (nbscaler.runtime.sources).\n"
            f"GenModule.weights_source = {dict(sorted(weights.items()))!r}\n")


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
    remove_stale_temporaries(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=temporary_prefix(path))
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as err:
        if os.path.exists(tmp):
            os.unlink(tmp)
        full = _disk_full(err, path)
        if full is None:
            raise
        raise full from err


# Write errors that mean "no room": the disk, a quota, or the process's file size limit.
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def _disk_full(err: BaseException, path: Path) -> Optional[OSError]:
    """When ``err`` says the disk is full, an ``OSError`` that names ``path`` and what to do; else None.

    ``torch.save`` to a file turns the write's ``OSError`` into a ``RuntimeError`` ("unexpected
    pos"), whose context still holds it.
    """
    full: Optional[BaseException] = err
    while full is not None and not (isinstance(full, OSError) and full.errno in _FULL):
        full = full.__context__
    if full is None:
        return None
    free = shutil.disk_usage(path.parent).free if path.parent.exists() else 0
    return OSError(full.errno, f"{full.strerror}: writing {path} failed ({free / 2**20:.1f} MiB free there); "
                   "nothing was replaced and the partial copy was removed: free some space or write elsewhere",
                   str(path))


def temporary_prefix(path: Path, kind: str = "") -> str:
    """The name prefix of this process's temporary siblings of ``path``: ``.<name>.[kind.]<host>-<pid>.``"""
    return f".{path.name}.{kind + '.' if kind else ''}{socket.gethostname()}-{os.getpid()}."


def remove_stale_temporaries(path: Path) -> None:
    """Remove the temporary siblings of ``path`` that writers on this host left when they were killed
    (their process is gone); those of live writers, and of other hosts, stay."""
    own = re.compile(rf"\.{re.escape(path.name)}\.(?:[a-z]+\.)?{re.escape(socket.gethostname())}-(\d+)\.")
    with os.scandir(path.parent) as entries:
        stale = [e.path for e in entries if (m := own.match(e.name)) and not _alive(int(m.group(1)))]
    for entry in stale:
        if os.path.isdir(entry) and not os.path.islink(entry):
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:          # another user's process
        return True
    return True


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

    def has_graphs(self) -> bool:
        return (self.path / GRAPH_FILE).exists()

    def read_graphs(self) -> Dict[str, Any]:
        """The traced graphs (``safeload.load_graphs``: a foreign or older file is refused)."""
        return safeload.load_graphs(self.path / GRAPH_FILE)

    def compute_config(self) -> ComputeConfig:
        return ComputeConfig.from_dict(self.read_config()["compute_config"])

    def files(self) -> Dict[str, Path]:
        return {p.name: p for p in sorted(self.path.iterdir()) if p.is_file()}

    def replace_with(self, write: "callable") -> None:
        """Build a complete new folder with ``write(tmp_path)``, then swap it in for the old one."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(self.path)
        tmp = Path(tempfile.mkdtemp(dir=self.path.parent, prefix=temporary_prefix(self.path, "new")))
        try:
            write(tmp)
            old = None
            if self.path.exists():
                old = Path(tempfile.mkdtemp(dir=self.path.parent, prefix=temporary_prefix(self.path, "old")))
                os.rename(self.path, old / "dir")
            os.rename(tmp, self.path)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
            _prune_store(weights_store(self.path))        # entries of folders replaced or deleted
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            full = _disk_full(err, self.path)
            if full is None:
                raise
            raise full from err

    def write_weights(self, tmp: Path, weights: Optional[Dict[str, "torch.Tensor"]]) -> None:
        """Put the weights file into the new folder ``tmp``, writing it only when no file holds them.

        ``weights=None`` keeps the current file. Otherwise the weights store of the save folder
        (see :func:`weights_store`) is looked up by a key sampled from the tensors, and a file found
        there or in the current folder that holds exactly these tensors (names, dtypes, shapes and
        values, compared through a memory-mapped load) is hard-linked instead of written again:
        recompiling a large model with other settings, or under another ``instance_name`` (each
        Explorer run), costs no weight I/O. A new file is written once and linked into the store.
        """
        old = self.path / WEIGHTS_FILE
        if weights is None:
            if not old.exists():
                raise FileNotFoundError(f"{old} is missing, and no module was given to write it from")
            _link_or_copy(old, tmp / WEIGHTS_FILE)
            return
        stored = weights_store(self.path) / f"{weights_key(weights)}.pt"
        for candidate in (stored, old):
            if candidate.exists() and _same_tensors(candidate, weights):
                _link_or_copy(candidate, tmp / WEIGHTS_FILE)
                if candidate is old:
                    _store(old, stored)
                return
        save_weights(weights, tmp / WEIGHTS_FILE)
        _store(tmp / WEIGHTS_FILE, stored)

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


def write_graphs(path: Path, graphs: Dict[str, Any]) -> bool:
    """Write ``graphs`` to ``path`` for ``reuse='graph'`` and ``load_plan``; returns whether it did.

    Graphs holding a type a graph file may not name are not written, with a warning: the
    compile is complete without them, and a later ``reuse='graph'`` traces again.
    """
    try:
        data = safeload.dump_graphs(graphs)
    except safeload.UnstorableGraphs as err:
        warnings.warn(f"{path.name} was not written: {err}. The module is compiled; reuse='graph' will trace it "
                      "again and load_plan cannot read this folder. Return tensors, tuples, lists or dicts from "
                      "forward to keep the graphs.", stacklevel=3)
        return False
    path.write_bytes(data)
    return True


def weights_store(module_path: Path) -> Path:
    """The folder where every weights file written under one ``gen_savedir`` is also linked, by
    key, so that other module folders can share it (``<gen_savedir>/_weights/``; a module folder
    is three levels below ``gen_savedir``, see :func:`module_dir`)."""
    return Path(module_path).parents[2] / WEIGHTS_STORE_DIR


def weights_key(weights: Dict[str, "torch.Tensor"]) -> str:
    """A key for a set of tensors that is cheap to compute (names, dtypes, shapes and about a
    thousand values sampled from each tensor): equal tensors always get the same key, and two sets
    with one key are compared in full before a file is shared, so a collision only costs a write."""
    digest = hashlib.sha1()
    for name in sorted(weights):
        t = weights[name]
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        flat = t.detach().reshape(-1)
        sample = flat[::max(1, flat.numel() // _SAMPLED_VALUES)].contiguous()
        digest.update(sample.view(torch.uint8).numpy().tobytes() if sample.numel() else b"")
    return digest.hexdigest()


def save_weights(weights: Dict[str, "torch.Tensor"], path: Path) -> None:
    """``torch.save`` without the per-record CRC-32, which costs several times the write itself
    for large weights; the file is still read with ``torch.load``."""
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(weights, path)
    finally:
        torch.serialization.set_crc32_options(crc)


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:                   # a file system without hard links
        shutil.copyfile(src, dst)


def _store(path: Path, stored: Path) -> None:
    """Link ``path`` into the weights store as ``stored``, atomically replacing an entry with the
    same key. Without hard links there is no store: a copy would only double the disk used."""
    stored.parent.mkdir(parents=True, exist_ok=True)
    tmp = stored.with_name(f".{stored.name}.{os.getpid()}.new")
    try:
        os.link(path, tmp)
        os.replace(tmp, stored)
    except OSError:
        if tmp.exists():
            tmp.unlink()


def _prune_store(store: Path) -> None:
    """Drop the store's entries that no module folder links to any more."""
    for entry in store.glob("*.pt"):
        try:
            if entry.stat().st_nlink == 1:
                entry.unlink()
        except OSError:               # another process removed it first
            pass


def _same_tensors(path: Path, weights: Dict[str, "torch.Tensor"]) -> bool:
    try:
        saved = safeload.load_tensors(path, fix=safeload.RECOMPILE, mmap=True)
    except Exception:                          # unreadable or refused: not the same, write ours again
        return False
    if saved.keys() != weights.keys():
        return False
    return all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
               for a, b in ((saved[k], weights[k]) for k in weights))
