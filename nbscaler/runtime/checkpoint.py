"""Checkpoints of parallel modules: per-rank files, merged ones, and moving between plans.

Every local tensor knows, through its ``WeightSpec``, which slice of which original tensor it
holds, and a parallel module saves those specs with its state dict (its ``_extra_state``). So does
the patched optimizer, for each optimizer parameter (see ``nbscaler.runtime.optimizer``). That is
enough to

- **merge** the per-rank state dicts into the state dicts of the original module and of its
  optimizer (``merge_state_dicts``): concatenate the slices of each tensor in index order, and for
  optimizer states first reassemble each local tensor from the (ZeRO) pieces that hold it;
- **load** a merged state into a parallel module of *any* plan (``load_merged_state_dicts``): every
  rank takes its own slices with ``WeightSpec.take``.

>>> save((pm.state_dict(), opt.state_dict()), f"ckpt.{rank}.pt")      # doctest: +SKIP
>>> sds, osds = zip(*(load(f"ckpt.{r}.pt") for r in range(4)))         # later, in any process
>>> sd, osd = merge_state_dicts(list(sds), list(osds))
>>> original.load_state_dict(sd); torch.optim.AdamW(original.parameters()).load_state_dict(osd)

``save`` writes atomically and ``load`` reads with ``weights_only=True`` (``nbscaler.safeload``):
checkpoints hold tensors and plain values only, so loading one runs no code from the file, and a
file that holds anything else is refused. ``load`` also checks every record of the file against the
CRC-32 that ``torch.save`` stored for it, which ``torch.load`` does not: a flipped bit in a tensor's
bytes would otherwise load as a silently different weight.
"""

from __future__ import annotations

import contextlib
import struct
import zipfile
import zlib
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import torch

from nbscaler.genfiles import atomic_write
from nbscaler.runtime.module import ParallelModule, runtime_device
from nbscaler.runtime.optimizer import MASTER_KEY, layout_of, parallel_modules
from nbscaler.runtime.statecheck import (EXTRA_STATE, MODULE_FORMAT, OPTIMIZER_FORMAT, OPTIMIZER_KEY,
                                         CheckpointError, check_no_extra, check_tensors)
from nbscaler.runtime.weight_spec import WeightSpec
from nbscaler.safeload import RefusedFile, load_tensors

StateDict = Dict[str, Any]
Device = Union[str, torch.device, None]
# What to do with a checkpoint that holds more than tensors and plain values.
REFUSED_CHECKPOINT = ("save checkpoints of state dicts with nbscaler.runtime.checkpoint.save; load a file "
                      "that holds other objects with torch.load(path, weights_only=False) yourself, and only "
                      "if you trust whoever wrote it")
DAMAGED = "the file is damaged or incomplete: use an intact copy"
# A zip archive's local file header (APPNOTE 4.3.7): signature, versions, flags, method, time,
# CRC-32, sizes, then the lengths of the name and of the extra field.
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")
_ENCRYPTED_OR_PATCHED = 0x0001 | 0x0020 | 0x0040   # general purpose flag bits 0, 5 and 6 (APPNOTE 4.4.4)
_DOS_DIRECTORY = 0x10                              # the external attributes' MS-DOS folder bit


def save(obj: Any, path: Union[str, Path]) -> None:
    """``torch.save`` to a temporary file next to ``path``, renamed into place when complete."""
    atomic_write(Path(path), lambda f: torch.save(obj, f))


def load(path: Union[str, Path], map_location: Device = "cpu") -> Any:
    """``torch.load(..., weights_only=True)`` of a file whose records match their CRC-32, with an
    error that says what to do when the file is not a readable checkpoint.

    A missing or unreadable file raises ``OSError``; a damaged, truncated or foreign one
    ``CheckpointError``.
    """
    with open(path, "rb"):           # missing, a folder, no permission: the OSError as it is
        pass
    check_records(path)
    try:
        return load_tensors(path, fix=REFUSED_CHECKPOINT, map_location=map_location)
    except RefusedFile as err:
        raise CheckpointError(f"cannot read the checkpoint {err}") from err
    except Exception as err:         # OSError too: torch reads a truncated archive as EINVAL
        raise CheckpointError(f"cannot read the checkpoint {path} ({type(err).__name__}: {err}); "
                              f"{DAMAGED}.") from err


def check_records(path: Union[str, Path]) -> None:
    """Raise ``CheckpointError`` unless every record of the archive ``path`` is stored where, and
    as, its directory says, and its bytes match the CRC-32 the archive states for it.

    ``torch.load`` reads tensor bytes without checking them, and its reader is lenient: a damaged
    directory entry can make it inflate a stored record or read from another offset, with results
    that differ from one read to the next. So each record is checked strictly here (a local header
    that names it, stored uncompressed as torch writes every record, at the offset torch's reader
    will read) and its CRC-32 computed from the file's own bytes. Files in torch's older,
    non-archive format, and records saved without a CRC (``compute_crc32=False``), are not checked.
    """
    try:
        if not zipfile.is_zipfile(path):
            with open(path, "rb") as f:
                if b"PK\x03\x04".startswith(f.read(4)):   # an archive's start (or nothing): cut short
                    raise ValueError("the archive has no central directory (the file was cut short)")
            return                   # torch's legacy format, or not a checkpoint: load says which
        with zipfile.ZipFile(path) as archive, open(path, "rb") as f:
            reader = torch._C.PyTorchFileReader(f)
            for info in archive.infolist():
                name = info.filename.split("/", 1)[-1]       # torch names records below the archive's folder
                if not _stored_plainly(info):
                    raise ValueError(f"record {name!r} is not stored as torch stores records")
                start = _data_offset(f, info)
                if reader.get_record_offset(name) != start:
                    raise ValueError(f"record {name!r} is not where the archive's directory says")
                f.seek(start)
                data = f.read(info.file_size)
                if len(data) != info.file_size or (info.CRC or not data) and zlib.crc32(data) != info.CRC:
                    raise ValueError(f"record {name!r} does not match its CRC-32")
    except Exception as err:         # zipfile's and torch's own errors: a bad header, a missing record, ...
        raise CheckpointError(f"cannot read the checkpoint {path}: {err}; {DAMAGED}.") from None


def _stored_plainly(info: zipfile.ZipInfo) -> bool:
    """Whether ``info`` is a plain file stored uncompressed, as torch writes every record. torch's
    reader extracts nothing from an entry marked as a folder (MS-DOS attribute 0x10) and leaves the
    tensor's memory as it found it, so a flipped attribute bit would load whatever was there."""
    return (info.compress_type == zipfile.ZIP_STORED and info.compress_size == info.file_size
            and not info.flag_bits & _ENCRYPTED_OR_PATCHED and not info.external_attr & _DOS_DIRECTORY
            and not info.filename.endswith("/"))


def _data_offset(f: Any, info: zipfile.ZipInfo) -> int:
    """Where the bytes of the record ``info`` start, read strictly from its local header, which
    must be one (its signature) and name the record."""
    f.seek(info.header_offset)
    header = f.read(_LOCAL_HEADER.size)
    if len(header) != _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
        raise ValueError(f"record {info.filename!r} has no local header at {info.header_offset}")
    name_length, extra_length = _LOCAL_HEADER.unpack(header)[-2:]
    if f.read(name_length) != info.filename.encode():
        raise ValueError(f"record {info.filename!r}'s local header names another record")
    return info.header_offset + _LOCAL_HEADER.size + name_length + extra_length


def merge_slices(pieces: Iterable[Tuple[WeightSpec, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Full tensors by original name from ``(spec, local tensor)`` pairs gathered from all ranks.

    Raises ``ValueError`` naming the tensor when some slice is missing.
    """
    by_name: Dict[str, Dict[int, torch.Tensor]] = {}
    specs: Dict[str, WeightSpec] = {}
    for spec, t in pieces:
        specs.setdefault(spec.name, spec)
        by_name.setdefault(spec.name, {}).setdefault(spec.index if spec.split_dim is not None else 0, t)
    full: Dict[str, torch.Tensor] = {}
    for name, slices in by_name.items():
        spec = specs[name]
        if spec.split_dim is None:
            full[name] = slices[0]
            continue
        missing = sorted(set(range(spec.parts)) - set(slices))
        if missing:
            raise ValueError(f"cannot rebuild '{name}': slices {missing} of {spec.parts} are missing; "
                             "pass the state of every rank of one unit.")
        full[name] = spec.join([slices[i] for i in range(spec.parts)])
    return full


def local_pieces(module: torch.nn.Module, grads: bool = False) -> List[Tuple[WeightSpec, torch.Tensor]]:
    """``(spec, tensor)`` for every local weight of every parallel module in ``module``
    (its gradient with ``grads=True``; parameters without a gradient are left out)."""
    out = []
    for m in module.modules():
        if isinstance(m, ParallelModule):
            with m.whole_parameters():
                for attr, spec in m.weight_specs.items():
                    t = getattr(m, attr)
                    t = t.grad if grads else t
                    if t is not None:
                        out.append((spec, t.detach().cpu().clone()))
    return out


# -- merging ------------------------------------------------------------------------------------
def layout_records(state_dict: StateDict) -> Dict[str, Dict[str, Any]]:
    """The layout record of every parallel module in a per-rank state dict, by state-dict prefix."""
    return {key[:-len(EXTRA_STATE)]: value for key, value in state_dict.items()
            if key.endswith(EXTRA_STATE) and isinstance(value, dict) and value.get("format") == MODULE_FORMAT}


def merge_state_dicts(module_state_dicts: List[StateDict], optimizer_state_dicts: Optional[List[StateDict]] = None
                      ) -> Tuple[StateDict, Optional[StateDict]]:
    """Merge per-rank state dicts (one per rank, any order) into the original module's state dict
    and, when given, its optimizer's (Adam-like: states shaped like their parameter are merged like
    the parameter, the others, such as ``step``, are taken from any rank holding the parameter).

    The results load into the original, non-parallel module and a torch optimizer built on its
    ``parameters()``. Deduped state dicts merge too. Tensors stay on the devices they were saved on.
    """
    if not module_state_dicts:
        raise ValueError("merge_state_dicts needs the state dicts of the ranks, got none.")
    records = [layout_records(sd) for sd in module_state_dicts]
    if not records[0]:
        raise CheckpointError("the first state dict has no nbscaler layout record: pass per-rank state dicts "
                              "of a parallel module (module.state_dict() on each rank).")
    for rank, found in enumerate(records):
        if set(found) != set(records[0]):
            raise CheckpointError(f"state dict {rank} has parallel modules at {sorted(found)}, state dict 0 at "
                                  f"{sorted(records[0])}: pass the state dicts of one model.")
    plans = {(r["plan_ngpus"], r["runtime_ngpus"]) for found in records for r in found.values()}
    if len(plans) > 1:
        raise CheckpointError(f"the state dicts come from different plans (plan_ngpus, runtime_ngpus) = "
                              f"{sorted(plans)}: pass the ones that the ranks of one run saved together.")
    specs = [{prefix: {attr: WeightSpec.from_dict(d) for attr, d in r["weights"].items()} for prefix, r in found.items()}
             for found in records]
    owned = {prefix + key for found in specs for prefix, attrs in found.items() for key in [*attrs, EXTRA_STATE]}
    merged: StateDict = {}
    for sd in module_state_dicts:           # a deduped one keeps the plain entries on one rank only
        for key, value in sd.items():
            if key not in owned:
                merged.setdefault(key, value)
    for prefix in specs[0]:
        pieces = [(spec, sd[prefix + attr]) for sd, found in zip(module_state_dicts, specs)
                  for attr, spec in found[prefix].items() if spec.saved and prefix + attr in sd]
        merged.update({prefix + name: t for name, t in merge_slices(pieces).items()})
    if optimizer_state_dicts is None:
        return merged, None
    if len(optimizer_state_dicts) != len(module_state_dicts):
        raise ValueError(f"got {len(module_state_dicts)} module state dicts but {len(optimizer_state_dicts)} "
                         "optimizer state dicts: pass one of each per rank, in the same order.")
    return merged, _merge_optimizer(optimizer_state_dicts, specs)


def _optimizer_record(state_dict: StateDict, rank: int) -> Dict[str, Any]:
    record = state_dict.get(OPTIMIZER_KEY)
    if not isinstance(record, dict) or record.get("format") != OPTIMIZER_FORMAT:
        raise CheckpointError(f"optimizer state dict {rank} has no nbscaler layout record: save optimizers made "
                              "by build_optimizer, with optimizer.state_dict() on every rank.")
    if len(state_dict["param_groups"]) != 1:
        raise CheckpointError(f"optimizer state dict {rank} has {len(state_dict['param_groups'])} parameter groups; "
                              "merging supports the single group that build_optimizer creates.")
    return record


def _is_elementwise(value: Any, shape: Iterable[int]) -> bool:
    """Whether an optimizer state value holds one number per parameter element (exp_avg, ...)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) == tuple(shape)


def _copy(value: Any) -> Any:
    """A scalar state (``step``) of its own: a ZeRO shard's one tensor serves all its parameters,
    and optimizers update such tensors in place, once per parameter."""
    return value.clone() if isinstance(value, torch.Tensor) else value


def _merge_optimizer(state_dicts: List[StateDict], specs: List[Dict[str, Dict[str, WeightSpec]]]) -> StateDict:
    records = [_optimizer_record(sd, r) for r, sd in enumerate(state_dicts)]
    order = records[0]["original_params"]
    whole: Dict[str, Dict[str, Any]] = {}            # original name -> state key -> value
    local: Dict[Tuple[str, WeightSpec, str], Tuple[torch.Tensor, torch.Tensor]] = {}   # -> (values, covered)
    for sd, record, found in zip(state_dicts, records, specs):
        for index, slot in enumerate(record["slots"]):
            values = sd["state"].get(index)
            if not values:
                continue
            if slot["module"] is None:
                whole.setdefault(slot["param"], dict(values))
                continue
            prefix = slot["module"]
            for seg in slot["segments"]:
                spec = found[prefix][seg["attr"]]
                for key, value in values.items():
                    if not _is_elementwise(value, slot["shape"]):
                        whole.setdefault(prefix + spec.name, {}).setdefault(key, _copy(value))
                        continue
                    numel = int(torch.Size(spec.local_shape).numel())
                    flat, covered = local.setdefault(
                        (prefix, spec, key), (value.new_empty(numel), torch.zeros(numel, dtype=torch.bool)))
                    span = slice(seg["start"], seg["start"] + seg["length"])
                    flat[span] = value.reshape(-1)[seg["offset"]:seg["offset"] + seg["length"]]
                    covered[span] = True
    pieces: Dict[Tuple[str, str], List[Tuple[WeightSpec, torch.Tensor]]] = {}
    for (prefix, spec, key), (flat, covered) in local.items():
        if not bool(covered.all()):
            raise CheckpointError(f"optimizer state '{key}' of '{prefix}{spec.name}' is incomplete: pass the "
                                  "optimizer state dicts of every rank.")
        pieces.setdefault((prefix, key), []).append((spec, flat.view(spec.local_shape)))
    for (prefix, key), parts in pieces.items():
        for name, full in merge_slices(parts).items():
            whole.setdefault(prefix + name, {})[key] = full
    index_of = {name: i for i, name in enumerate(order)}
    unknown = sorted(set(whole) - set(index_of))
    if unknown:
        raise CheckpointError(f"optimizer state for '{unknown[0]}', which the original model does not have.")
    hyper = {k: v for k, v in state_dicts[0]["param_groups"][0].items() if k != "params"}
    return {"state": {index_of[name]: values for name, values in sorted(whole.items(), key=lambda kv: index_of[kv[0]])},
            "param_groups": [{**hyper, "params": list(range(len(order)))}]}


@torch.no_grad()
def load_master_weights(module: torch.nn.Module, optimizer_state_dict: StateDict) -> int:
    """Copy the master weights of a merged optimizer state (a mixed-precision run's fp32 copies,
    each saved as its parameter's state ``master``) into the original module's parameters, which
    the merged module state dict holds only rounded to the module's dtype. Returns how many it
    copied. Load the module state dict first; a module in fp32 then holds the masters exactly.
    """
    params = list(module.parameters())
    state = optimizer_state_dict["state"]
    if state and max(state) >= len(params):
        raise CheckpointError(f"the optimizer state has parameter {max(state)}, the module {len(params)} parameters: "
                              "pass the merged optimizer state of this module (merge_state_dicts).")
    masters = {index: values for index, values in state.items() if MASTER_KEY in values}
    for index, values in masters.items():           # all checked before anything is copied
        check_tensors([(MASTER_KEY, f"the master of parameter {index}", tuple(params[index].shape))], values)
    for index, values in masters.items():
        params[index].copy_(values[MASTER_KEY])
    return len(masters)


# -- loading ------------------------------------------------------------------------------------
def plain_state(module: torch.nn.Module, parallel: Dict[str, ParallelModule]) -> Dict[str, torch.Tensor]:
    """The state-dict entries of ``module`` outside its parallel modules (as live tensors)."""
    inside = {prefix + key for prefix, m in parallel.items() for key in m.state_dict(keep_vars=True)}
    return {k: v for k, v in module.state_dict(keep_vars=True).items() if k not in inside}


def check_model_state(module: torch.nn.Module, state_dict: StateDict) -> None:
    """Raise ``CheckpointError`` unless ``state_dict`` is a per-rank state dict that fits ``module``
    as a whole (parallel modules and the plain parts around them)."""
    parallel = parallel_modules(module)
    for prefix, m in parallel.items():
        m.check_state_dict(state_dict, prefix)
    plain = plain_state(module, parallel)
    check_tensors([(k, f"'{k}'", tuple(v.shape)) for k, v in plain.items()], state_dict)
    check_no_extra([k for k in state_dict if not any(k.startswith(p) for p in parallel)], plain)


def load_merged_state_dicts(module: torch.nn.Module, module_state_dict: StateDict,
                            optimizer: Optional[torch.optim.Optimizer] = None,
                            optimizer_state_dict: Optional[StateDict] = None, *, device: Device = None) -> None:
    """Load merged (original-module) state dicts into a parallel model of any plan, and optionally
    its optimizer (made by ``build_optimizer``), staging optimizer state on ``device`` (default:
    this rank's device).

    Everything is checked before anything is copied: a missing or wrongly shaped tensor raises
    ``CheckpointError`` naming it, and leaves the module and optimizer as they were. Entries this
    rank does not hold are ignored (a pipeline stage holds only its own). Non-persistent buffers are
    not in a state dict and keep their values.
    """
    device = torch.device(device) if device is not None else runtime_device()
    parallel = parallel_modules(module)
    copies: List[Tuple[torch.Tensor, torch.Tensor]] = []
    for prefix, m in parallel.items():
        for attr, spec in m.weight_specs.items():
            if spec.saved:
                key = prefix + spec.name
                check_tensors([(key, f"'{key}'", spec.shape)], module_state_dict)
                copies.append((getattr(m, attr), spec.take(module_state_dict[key])))
    plain = plain_state(module, parallel)
    check_tensors([(k, f"'{k}'", tuple(v.shape)) for k, v in plain.items()], module_state_dict)
    copies += [(v, module_state_dict[k]) for k, v in plain.items()]
    local_state = None
    if optimizer is not None:
        if optimizer_state_dict is None:
            raise ValueError("an optimizer was given without optimizer_state_dict to load into it.")
        local_state = _localize_optimizer_state(optimizer, optimizer_state_dict, parallel, device)
    with contextlib.ExitStack() as whole, torch.no_grad():
        for m in parallel.values():
            whole.enter_context(m.whole_parameters(write=True))
        for dst, src in copies:
            dst.copy_(src)
    if local_state is not None:
        optimizer.load_state_dict(local_state)


def _localize_optimizer_state(optimizer: torch.optim.Optimizer, merged: StateDict,
                              parallel: Dict[str, ParallelModule], device: torch.device) -> StateDict:
    """This rank's optimizer state dict, cut from a merged one through the optimizer's layout."""
    layout = layout_of(optimizer)
    order = layout["original_params"]
    groups = merged["param_groups"]
    if len(groups) != 1 or len(groups[0]["params"]) != len(order):
        raise CheckpointError(f"the merged optimizer state has {[len(g['params']) for g in groups]} parameters in "
                              f"its groups; the original model has one group of {len(order)}: it belongs to "
                              "another model, or was not written by merge_state_dicts.")
    index_of = {name: i for i, name in enumerate(order)}
    state: Dict[int, Dict[str, Any]] = {}
    for index, slot in enumerate(layout["slots"]):
        if slot["module"] is None:
            shapes = [(slot["param"], torch.Size(slot["shape"]), None)]
        else:
            m = parallel[slot["module"]]
            shapes = [(slot["module"] + m.weight_specs[seg["attr"]].name, m.weight_specs[seg["attr"]].shape, seg)
                      for seg in slot["segments"]]
        tensors: Dict[str, torch.Tensor] = {}
        scalars: Dict[str, Any] = {}
        for name, shape, seg in shapes:
            for key, value in merged["state"].get(index_of[name], {}).items():
                if not (isinstance(value, torch.Tensor) and value.dim() > 0):
                    scalars.setdefault(key, _copy(value))
                    continue
                check_tensors([(key, f"optimizer state '{key}' of '{name}'", tuple(shape))], {key: value})
                if seg is None:
                    tensors[key] = value
                    continue
                spec = parallel[slot["module"]].weight_specs[seg["attr"]]
                if key not in tensors:
                    tensors[key] = torch.zeros(slot["shape"], dtype=value.dtype, device=device)
                flat = tensors[key].view(-1)
                flat[seg["offset"]:seg["offset"] + seg["length"]] = \
                    spec.take(value).reshape(-1)[seg["start"]:seg["start"] + seg["length"]]
        if tensors or scalars:
            state[index] = {**scalars, **tensors}
    hyper = {k: v for k, v in groups[0].items() if k != "params"}
    param_groups, start = [], 0
    for group in optimizer.param_groups:
        param_groups.append({**hyper, "params": list(range(start, start + len(group["params"])))})
        start += len(group["params"])
    return {"state": state, "param_groups": param_groups, OPTIMIZER_KEY: layout}
