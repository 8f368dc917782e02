"""Reading back what nbscaler wrote, without running code that a file could carry.

A pickle can name any importable callable and have it called while it loads, so a file that
someone else could write (a shared or group-writable ``gen_savedir``, a checkpoint from elsewhere)
would run their code in the notebook. Every reader in nbscaler asks this module instead:

- tensor files (``weights.pt``, ``constants.pt``, checkpoints, a ``weights=`` file) go through
  :func:`load_tensors`: ``torch.load(..., weights_only=True)``, which admits tensors and plain
  values only;
- traced graphs (``graph.pkl``) go through :func:`load_graphs`: a stamped header, then a pickle
  that may name only what ``_admitted`` lets through: the types listed in ``_ADMITTED``
  (nbscaler's IR and the few nbscaler, torch and builtin types its ``meta`` holds), the
  vocabularies of ``nbscaler.layouts`` (enums: a value is looked up, never built), torch's
  dtypes, the named tuples torch ops return, and torch's optimizer classes; tensors in it are
  raw bytes, rebuilt by :func:`_tensor`.

A file that fails either check raises :class:`RefusedFile`, which names the file, why, and what
to do; nothing falls back to an unrestricted load.
"""

from __future__ import annotations

import enum
import io
import json
import pickle
import sys
import warnings
from pathlib import Path
from typing import Any, Dict, FrozenSet, Optional, Set, Tuple, Union

import torch

PathLike = Union[str, Path]

#: The first line of a graph file; the JSON line after it says which format the pickle is in.
GRAPH_MAGIC = b"nbscaler graphs\n"
#: The graph file format: add one whenever what a graph file holds, or how, changes. Files of
#: another format are refused.
GRAPH_FORMAT = 1
RECOMPILE = "compile again with reuse='override' (or delete the folder)"

# (module, name) pairs a graph file may name. Each is a data type that only stores what it is
# given (a dataclass, an enum, a container); no function and no class with side effects.
_ADMITTED: FrozenSet[Tuple[str, str]] = frozenset({
    ("nbscaler.ir.graph", "IRGraph"), ("nbscaler.ir.graph", "IRNode"), ("nbscaler.ir.graph", "IRTensor"),
    ("nbscaler.ir.graph", "Placement"), ("nbscaler.ir.graph", "InnerSplit"), ("nbscaler.ir.annotation", "OpAnnotation"),
    ("nbscaler.ir.backward_split", "BackwardPart"),
    ("nbscaler.cost.hardware", "Hardware"), ("nbscaler.cost.hardware", "NumberFormat"),
    ("nbscaler.cost.hardware", "Link"), ("nbscaler.cost.software", "Software"),
    ("nbscaler.cost.software", "AttentionKind"),
    ("nbscaler.recipe", "Recipe"), ("nbscaler.recipe", "LossScaling"), ("nbscaler.recipe", "Float8Scaling"),
    ("nbscaler.recipe", "Unset"),
    ("nbscaler.safeload", "_tensor"),
    ("builtins", "tuple"), ("builtins", "list"), ("builtins", "dict"), ("builtins", "set"),
    ("builtins", "frozenset"), ("builtins", "slice"), ("builtins", "Ellipsis"), ("builtins", "NotImplemented"),
    # what numpy scalars become (_GraphPickler)
    ("builtins", "int"), ("builtins", "float"), ("builtins", "bool"), ("builtins", "str"), ("builtins", "complex"),
    ("collections", "OrderedDict"),
    ("torch", "device"), ("torch", "Size"),
    ("torch.utils._pytree", "TreeSpec"), ("torch.utils._pytree", "LeafSpec"),
    ("torch.utils._pytree", "MappingKey"), ("torch.utils._pytree", "SequenceKey"),
    ("torch.utils._pytree", "GetAttrKey"),
})
# ``torch.float32``, ``torch.channels_last``, ...: values, admitted by their type (never called).
_TORCH_VALUE_TYPES = (torch.dtype, torch.layout, torch.memory_format)


class RefusedFile(ValueError):
    """A file nbscaler will not read back: written by something else or another version of
    nbscaler, damaged, or holding objects whose loading could run code."""

    def __init__(self, path: PathLike, reason: str, fix: str):
        super().__init__(f"{path} {reason}; {fix}.")
        self.path, self.reason, self.fix = Path(path), reason, fix


class UnstorableGraphs(TypeError):
    """Graphs holding objects of a type a graph file may not name (a user's output class, say)."""


# -- tensor files ---------------------------------------------------------------------------------
def load_tensors(path: PathLike, *, fix: str, map_location: Any = "cpu", mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``: tensors and plain values only.

    A file holding anything else raises :class:`RefusedFile` with ``fix`` (what the caller's user
    should do). A damaged file raises what ``torch.load`` raises; a missing one, ``OSError``.
    """
    try:
        return torch.load(path, map_location=map_location, mmap=mmap, weights_only=True)
    except pickle.UnpicklingError as err:    # torch's weights-only unpickler refused an object
        detail = str(err).strip().splitlines()
        raise RefusedFile(path, "holds objects other than tensors and plain values, which nbscaler does not "
                          "load because unpickling them could run code (torch.load with weights_only=True: "
                          f"{detail[0] if detail else type(err).__name__})", fix) from None


# -- graph files ----------------------------------------------------------------------------------
def dump_graphs(graphs: Dict[str, Any]) -> bytes:
    """The bytes of a graph file for ``graphs``; :func:`load_graphs` reads them back.

    Raises :class:`UnstorableGraphs` naming the types a graph file may not hold, so that a file
    that could not be read back is never written.
    """
    buf = io.BytesIO()
    try:
        _GraphPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(graphs)
    except (pickle.PicklingError, AttributeError, TypeError) as err:    # a class defined in a function, say
        raise UnstorableGraphs(f"the graphs hold an object pickle cannot write ({err})") from err
    data = buf.getvalue()
    refused = _refused_names(data)
    if refused:
        raise UnstorableGraphs(f"the graphs hold objects of {', '.join(sorted(refused))}, which a graph file "
                               "may not name (it admits nbscaler's IR, tensors and plain values)")
    header = json.dumps({"format": GRAPH_FORMAT}).encode() + b"\n"
    return GRAPH_MAGIC + header + data


def load_graphs(path: PathLike) -> Dict[str, Any]:
    """The graphs in a file :func:`dump_graphs` wrote; :class:`RefusedFile` for any other file."""
    with open(path, "rb") as f:
        if f.readline() != GRAPH_MAGIC:
            raise RefusedFile(path, "is not a graph file of this nbscaler (an older nbscaler pickled graphs "
                              "without a header, and nbscaler does not unpickle such a file)", RECOMPILE)
        _check_header(path, f.readline())
        try:
            return _GraphUnpickler(f, path).load()
        except RefusedFile:
            raise
        except Exception as err:             # truncated or otherwise damaged
            raise RefusedFile(path, f"is damaged ({type(err).__name__}: {err})", RECOMPILE) from None


def _check_header(path: PathLike, line: bytes) -> None:
    try:
        header = json.loads(line)
        fmt = header["format"]
    except (ValueError, TypeError, KeyError):
        raise RefusedFile(path, "has a damaged header", RECOMPILE) from None
    if fmt != GRAPH_FORMAT:
        raise RefusedFile(path, f"is in graph format {fmt!r}, written by another version of nbscaler; this one "
                          f"reads format {GRAPH_FORMAT} only", RECOMPILE)


def _admitted(module: str, name: str) -> bool:
    if (module, name) in _ADMITTED:
        return True
    if module == "torch":
        return isinstance(getattr(torch, name, None), _TORCH_VALUE_TYPES)

    if module == "nbscaler.layouts":         # the vocabularies (ContextKind, Collective, ...): enum values
        from nbscaler import layouts
        found = getattr(layouts, name, None)
        return isinstance(found, type) and issubclass(found, enum.Enum)
    if module == "torch.return_types":      # topk, sort, ...: the named tuples ops return, nothing else there
        found = getattr(torch.return_types, name, None)
        return isinstance(found, type) and issubclass(found, tuple)
    if module.startswith("torch.optim."):    # a recipe's optimizer class (autodist's search on a target)
        found = getattr(sys.modules.get(module), name, None)
        return isinstance(found, type) and issubclass(found, torch.optim.Optimizer)
    return False


class _GraphUnpickler(pickle.Unpickler):
    """An unpickler that resolves only admitted names: nothing else can be called while loading."""

    def __init__(self, file: Any, path: PathLike = "a graph file"):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if not _admitted(module, name):
            raise RefusedFile(self.path,
                              f"names {module}.{name}, which a graph file may not hold (it could run code)",
                              RECOMPILE)
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a graph file holds no persistent ids")


class _GraphPickler(pickle.Pickler):
    """Writes tensors as raw bytes (``_tensor``) and numpy scalars as Python ones, so that the
    file names neither torch's storage loaders nor numpy."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            t = obj.detach()
            dtype = str(t.dtype).removeprefix("torch.")
            if t.is_meta:                    # a shape without values
                return _tensor, (dtype, tuple(t.shape), None)
            raw = t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            return _tensor, (dtype, tuple(t.shape), raw)
        if type(obj).__module__ == "numpy" and hasattr(obj, "item") and getattr(obj, "ndim", None) == 0:
            value = obj.item()
            return type(value), (value,)
        return NotImplemented


def _tensor(dtype: str, shape: Tuple[int, ...], data: Optional[bytes]) -> torch.Tensor:
    """A tensor rebuilt from the bytes ``_GraphPickler`` wrote (``None``: on the meta device)."""
    kind = getattr(torch, dtype, None)
    if not isinstance(kind, torch.dtype):
        raise pickle.UnpicklingError(f"{dtype!r} is not a torch dtype")
    if data is None:
        return torch.empty(shape, dtype=kind, device="meta")
    if not data:
        return torch.empty(shape, dtype=kind)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(kind).reshape(shape)


def _refused_names(data: bytes) -> Set[str]:
    """The names a pickle refers to that a graph file may not hold."""
    names: Set[str] = set()

    class Probe(_GraphUnpickler):
        def find_class(self, module: str, name: str) -> Any:
            if not _admitted(module, name):
                names.add(f"{module}.{name}")
                return _Placeholder
            return super().find_class(module, name)

    try:
        with warnings.catch_warnings():      # torch's own deprecations, said again by the real load
            warnings.simplefilter("ignore")
            Probe(io.BytesIO(data)).load()
    except Exception as err:                 # a placeholder used in a way a real class is not
        if not names:
            names.add(f"an object that does not read back ({type(err).__name__}: {err})")
    return names


class _Placeholder:
    """Stands in for a refused name while ``_refused_names`` reads a pickle through."""

    def __new__(cls, *args: Any, **kwargs: Any) -> "_Placeholder":
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass
