"""Where a rank's weights come from: sources that hand out the slice of an original tensor that a
local one holds (its ``WeightSpec``), reading about this rank's share and never the whole model.

=====================  ==========================================================================
``TorchFile``          full tensors by name in a ``torch.save`` file: the ``weights.pt`` that
                       ``parallelize`` writes for a module with real values, or a merged checkpoint
                       (``merge_state_dicts``); memory-mapped, so a rank reads its slices' pages
``Safetensors``        a ``.safetensors`` file, or a folder of them as Hugging Face's
                       ``save_pretrained`` writes it (sharded with ``model.safetensors.index.json``),
                       read slice by slice (``safe_open(...).get_slice``)
``ModuleWeights``      a module built on the meta device: the tensors a checkpoint holds from the
                       file given, the others (all without a file; non-persistent buffers such as
                       rotary tables always) from the module's own seeded initialisation
                       (``nbscaler.runtime.initialize``) or, where it has them, its real values
=====================  ==========================================================================

``open_weights(path)`` picks the file source for a path; ``stored_names`` matches a source's names
and shapes with a module's state dict, before anything is compiled or written.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.nn as nn

from nbscaler import blocks as strided
from nbscaler.runtime.initialize import first_names, initial_tensors, owner_of, owners
from nbscaler.runtime.weight_spec import WeightSpec
from nbscaler.safeload import load_tensors

PathLike = Union[str, Path]
SAFETENSORS_INDEX = "model.safetensors.index.json"
Shape = Tuple[int, ...]


class WeightSource:
    """Hands out slices of original tensors by ``WeightSpec``. ``description`` says, in plain
    values, where they come from (``config.json`` and the generated code record it)."""

    description: Dict[str, Any] = {}

    def shapes(self) -> Dict[str, Shape]:
        """The full shape of every tensor the source holds, by original name."""
        raise NotImplementedError

    def read(self, spec: WeightSpec) -> torch.Tensor:
        """``spec``'s slice of its original tensor, on the CPU, in ``spec.dtype``."""
        raise NotImplementedError

    def read_all(self, specs: Dict[str, WeightSpec]) -> Iterator[Tuple[str, torch.Tensor]]:
        """``(attr, slice)`` for every local tensor; a source may reorder them to read less."""
        for attr, spec in specs.items():
            yield attr, self.read(spec)


class TorchFile(WeightSource):
    """Full tensors by name in a file ``torch.save`` wrote, memory-mapped."""

    def __init__(self, path: PathLike):
        self.path = Path(path)
        self.description = {"source": "torch", "path": str(self.path)}
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path} is missing: this rank has no weights file to read.")
        full = load_tensors(self.path, mmap=True, fix="pass a state dict of tensors (torch.save(module.state_dict()), "
                            "or nbscaler.runtime.checkpoint.save of merge_state_dicts(...)[0]), or a safetensors file")
        if not isinstance(full, dict) or not all(isinstance(t, torch.Tensor) for t in full.values()):
            raise ValueError(f"{self.path} does not hold a state dict (tensors by name); save the merged "
                             "module state dict alone, e.g. save(merge_state_dicts(per_rank)[0], path).")
        self.full: Dict[str, torch.Tensor] = full

    def shapes(self) -> Dict[str, Shape]:
        return {name: tuple(t.shape) for name, t in self.full.items()}

    def read(self, spec: WeightSpec) -> torch.Tensor:
        return spec.take(self.full[spec.name]).to(spec.dtype)


class Safetensors(WeightSource):
    """A ``.safetensors`` file, or a folder of shards, read by slices."""

    def __init__(self, path: PathLike):
        self.path = Path(path)
        self.description = {"source": "safetensors", "path": str(self.path)}
        self.files = _safetensors_files(self.path)
        held = {f: set(self._open(f).keys()) for f in sorted(set(self.files.values()))}
        missing = [n for n, f in self.files.items() if n not in held[f]]
        if missing:
            raise ValueError(f"{self.path / SAFETENSORS_INDEX} maps '{missing[0]}' to {self.files[missing[0]].name}, "
                             "which does not hold it: the index and the shards are from different saves.")

    def shapes(self) -> Dict[str, Shape]:
        shapes = {}
        for path in sorted(set(self.files.values())):
            file = self._open(path)
            shapes.update({name: tuple(file.get_slice(name).get_shape()) for name, f in self.files.items() if f == path})
        return shapes

    @staticmethod
    def _open(path: Path) -> Any:
        """A file opened for one read. Each opening maps the file anew and closing it unmaps it: a
        slice split along a later dimension touches every page of its tensor, and pages that stayed
        mapped would count in the rank's resident memory until loading ends (about the whole model's
        bytes over a checkpoint's row-parallel weights), though only its slices are kept."""
        from safetensors import safe_open
        return safe_open(str(path), framework="pt")

    def read(self, spec: WeightSpec) -> torch.Tensor:
        part = self._open(self.files[spec.name]).get_slice(spec.name)
        if spec.split_dim is None:
            return part[:].to(spec.dtype)
        cuts = [(dim, strided.ranges(spec.shape[dim], blocks, parts, index)) for dim, blocks, parts, index in spec.cuts]
        return _read_ranges(part, len(spec.shape), cuts, {}).to(spec.dtype)


def _read_ranges(part: Any, ndim: int, cuts: List[Tuple[int, List[Tuple[int, int]]]],
                 chosen: Dict[int, slice]) -> torch.Tensor:
    """The pieces of a safetensors slice ``part`` that ``cuts`` (each a dim and its ``[start, stop)``
    ranges) select, read one box at a time and joined: only this rank's bytes are read."""
    if not cuts:
        return part[tuple(chosen.get(d, slice(None)) for d in range(ndim))]
    (dim, spans), rest = cuts[0], cuts[1:]
    pieces = [_read_ranges(part, ndim, rest, {**chosen, dim: slice(lo, hi)}) for lo, hi in spans]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def _safetensors_files(path: Path) -> Dict[str, Path]:
    """Tensor name -> the file holding it, for a file or a folder (with or without an index)."""
    from safetensors import safe_open
    if path.is_file():
        files = [path]
    elif (path / SAFETENSORS_INDEX).is_file():
        weight_map = json.loads((path / SAFETENSORS_INDEX).read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    else:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{path} holds no .safetensors file: pass a safetensors file, a folder that "
                                    "save_pretrained(..., safe_serialization=True) wrote, or a merged checkpoint.")
    out: Dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                out.setdefault(name, file)
    return out


def open_weights(path: PathLike) -> WeightSource:
    """The source for ``path``: safetensors (a file or a folder of them) or a ``torch.save`` file."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"weights={str(path)!r} does not exist.")
    if path.is_dir() or path.suffix == ".safetensors":
        return Safetensors(path)
    return TorchFile(path)


def stored_names(module: nn.Module, source: WeightSource) -> Dict[str, str]:
    """The name ``source`` stores each tensor of ``module``'s state dict under, by the tensor's
    first name; a ``ValueError`` names the first tensor missing or in another shape, or the first
    stored tensor the module lacks, before anything is read.

    A tied tensor may be stored under any of its names. Names may lack a leading module path that
    they all share: a folder that ``save_pretrained`` wrote for ``model`` fits ``Wrapper(model)``,
    whose names start with ``'model.'``.
    """
    shapes = source.shapes()
    state = module.state_dict(keep_vars=True)
    saved = [[n for n in aliases if n in state] for aliases in first_names(module).values()]
    saved = [names for names in saved if names]           # non-persistent buffers are in no checkpoint
    where = source.description.get("path")
    prefix = _common_prefix(saved[0] if saved else [], shapes)
    out: Dict[str, str] = {}
    for names in saved:
        found = next((n[len(prefix):] for n in names if n.startswith(prefix) and n[len(prefix):] in shapes), None)
        if found is None:
            raise ValueError(f"weights: '{names[0][len(prefix):]}' is missing from {where} ({len(shapes)} tensors, "
                             f"e.g. '{next(iter(shapes), '')}'); it is a checkpoint of another model. Nothing was written.")
        expected = tuple(state[names[0]].shape)
        if shapes[found] != expected:
            raise ValueError(f"weights: '{found}' has shape {shapes[found]} in {where}, the module has {expected}; "
                             "it is a checkpoint of another configuration. Nothing was written.")
        out[names[0]] = found
    extra = sorted(set(shapes) - set(out.values()))
    if extra:
        raise ValueError(f"weights: {where} holds '{extra[0]}', which the module does not have ({len(extra)} such "
                         "tensors); it is a checkpoint of another model. Nothing was written.")
    return out


def _common_prefix(names: List[str], stored: Dict[str, Shape]) -> str:
    """The leading module path (``''`` or ``'model.'``, ...) to drop from the module's names so that
    the first tensor's name is one the source stores."""
    for name in names:
        parts = name.split(".")
        for depth in range(len(parts)):
            prefix = ".".join(parts[:depth]) + ("." if depth else "")
            if name[len(prefix):] in stored:
                return prefix
    return ""


class ModuleWeights(WeightSource):
    """The weights of a module built on the meta device, per rank: ``file`` for what checkpoints
    hold, the module's real values where it has them, its seeded initialisation for the rest."""

    def __init__(self, module: nn.Module, file: Optional[WeightSource], seed: int,
                 constants: Optional[Dict[str, torch.Tensor]] = None):
        self.module, self.file, self.seed = module, file, seed
        self.constants = constants or {}
        self.tensors = {name: t for name, t in (*module.named_parameters(remove_duplicate=False),
                                                 *module.named_buffers(remove_duplicate=False))}
        self.stored = stored_names(module, file) if file is not None else {}
        self.description = describe(file, seed)

    def shapes(self) -> Dict[str, Shape]:
        return {name: tuple(t.shape) for name, t in self.tensors.items()}

    def read_all(self, specs: Dict[str, WeightSpec]) -> Iterator[Tuple[str, torch.Tensor]]:
        to_init: List[str] = []
        for attr, spec in specs.items():
            if spec.kind == "constant":
                yield attr, spec.take(self.constants[spec.name]).to(spec.dtype)
            elif spec.name in self.stored:
                yield attr, self.file.read(dataclasses.replace(spec, name=self.stored[spec.name]))
            elif not self.tensors[spec.name].is_meta:
                yield attr, spec.take(self.tensors[spec.name].detach().cpu()).to(spec.dtype)
            else:
                to_init.append(attr)
        by_name = {specs[attr].name: attr for attr in to_init}
        for path, names in owners(list(by_name)).items():       # one owning module in memory at a time
            values = initial_tensors(self.module, path, self.seed)
            for name in names:
                spec = specs[by_name[name]]
                yield by_name[name], spec.take(values[owner_of(name)[1]]).to(spec.dtype)
            del values


def describe(file: Optional[WeightSource], seed: int) -> Dict[str, Any]:
    """Where a meta module's weights come from, in plain values."""
    if file is None:
        return {"source": "init", "seed": seed}
    return {**file.description, "rest": "init", "seed": seed}
