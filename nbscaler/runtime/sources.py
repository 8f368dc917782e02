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

``open_weights(path)`` picks the file source for a path; ``check_names`` compares a source with a
module's state dict before anything is compiled or written.
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
from nbscaler.runtime.module import WeightSpec

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
        full = torch.load(self.path, map_location="cpu", mmap=True, weights_only=True)
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
        from safetensors import safe_open
        self.path = Path(path)
        self.description = {"source": "safetensors", "path": str(self.path)}
        self.files = _safetensors_files(self.path)
        self._open = {f: safe_open(str(f), framework="pt") for f in sorted(set(self.files.values()))}
        missing = [n for n, f in self.files.items() if n not in self._open[f].keys()]
        if missing:
            raise ValueError(f"{self.path / SAFETENSORS_INDEX} maps '{missing[0]}' to {self.files[missing[0]].name}, "
                             "which does not hold it: the index and the shards are from different saves.")

    def shapes(self) -> Dict[str, Shape]:
        return {name: tuple(self._open[f].get_slice(name).get_shape()) for name, f in self.files.items()}

    def read(self, spec: WeightSpec) -> torch.Tensor:
        part = self._open[self.files[spec.name]].get_slice(spec.name)
        if spec.split_dim is None:
            return part[:].to(spec.dtype)
        d = spec.split_dim
        pieces = [part[(slice(None),) * d + (slice(lo, hi),)]
                  for lo, hi in strided.ranges(spec.shape[d], spec.blocks, spec.parts, spec.index)]
        out = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=d)
        return out.to(spec.dtype)


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


def check_names(module: nn.Module, source: WeightSource) -> None:
    """Raise ``ValueError`` naming the first tensor of ``module``'s state dict that ``source``
    lacks or holds in another shape, or the first one it holds that the module does not have.
    Tied tensors may be stored under any one of their names."""
    shapes = source.shapes()
    state = module.state_dict(keep_vars=True)
    seen = set()
    for aliases in first_names(module).values():
        saved = [n for n in aliases if n in state]
        if not saved:
            continue                                  # a non-persistent buffer: not in checkpoints
        found = next((n for n in saved if n in shapes), None)
        where = source.description.get("path")
        if found is None:
            raise ValueError(f"weights: '{saved[0]}' is missing from {where} ({len(shapes)} tensors, e.g. "
                             f"'{next(iter(shapes), '')}'); it is a checkpoint of another model. Nothing was written.")
        expected = tuple(state[saved[0]].shape)
        if shapes[found] != expected:
            raise ValueError(f"weights: '{found}' has shape {shapes[found]} in {where}, the module has "
                             f"{expected}; it is a checkpoint of another configuration. Nothing was written.")
        seen.update(aliases)
    extra = [n for n in shapes if n not in seen]
    if extra:
        raise ValueError(f"weights: {source.description.get('path')} holds '{extra[0]}', which the module does "
                         f"not have ({len(extra)} such tensors); it is a checkpoint of another model. Nothing was written.")


class ModuleWeights(WeightSource):
    """The weights of a module built on the meta device, per rank: ``file`` for what checkpoints
    hold, the module's real values where it has them, its seeded initialisation for the rest."""

    def __init__(self, module: nn.Module, file: Optional[WeightSource], seed: int,
                 constants: Optional[Dict[str, torch.Tensor]] = None):
        self.module, self.file, self.seed = module, file, seed
        self.constants = constants or {}
        self.tensors = {name: t for name, t in (*module.named_parameters(remove_duplicate=False),
                                                 *module.named_buffers(remove_duplicate=False))}
        self.aliases = {alias: aliases for aliases in first_names(module).values() for alias in aliases}
        self.file_names = set(file.shapes()) if file is not None else set()
        self.description = describe(file, seed)

    def shapes(self) -> Dict[str, Shape]:
        return {name: tuple(t.shape) for name, t in self.tensors.items()}

    def read_all(self, specs: Dict[str, WeightSpec]) -> Iterator[Tuple[str, torch.Tensor]]:
        to_init: List[str] = []
        for attr, spec in specs.items():
            if spec.kind == "constant":
                yield attr, spec.take(self.constants[spec.name]).to(spec.dtype)
            elif spec.saved and self.file is not None:
                yield attr, self.file.read(self._stored_as(spec))
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

    def _stored_as(self, spec: WeightSpec) -> WeightSpec:
        """``spec`` under the name the file stores its tensor by (a tied tensor's other name)."""
        name = next((n for n in self.aliases.get(spec.name, [spec.name]) if n in self.file_names), spec.name)
        return spec if name == spec.name else dataclasses.replace(spec, name=name)


def describe(file: Optional[WeightSource], seed: int) -> Dict[str, Any]:
    """Where a meta module's weights come from, in plain values."""
    if file is None:
        return {"source": "init", "seed": seed}
    return {**file.description, "rest": "init", "seed": seed}
