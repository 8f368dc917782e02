"""Checks made before a checkpoint is loaded, so that a wrong one fails before anything is copied.

A parallel module's per-rank state dict carries a *layout record* (its ``_extra_state``): which
slice of which original tensor each local tensor is. Loading compares that record with the
module's own, then every tensor's shape, and only then copies. The errors name the first tensor
that does not fit, both shapes, and what to do instead.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping, Tuple

import torch

from nbscaler.blocks import describe, is_strided, normalize

MODULE_FORMAT = "nbscaler.parallel_module/1"
OPTIMIZER_FORMAT = "nbscaler.optimizer/1"
EXTRA_STATE = "_extra_state"          # where a parallel module's layout record sits in its state dict
OPTIMIZER_KEY = "nbscaler"            # where the optimizer's layout record sits in its state dict
OTHER_PLAN_FIX = ("it was saved under a different plan; merge the per-rank state dicts with merge_state_dicts "
                  "and load the result with load_merged_state_dicts")
OTHER_MODEL_FIX = "the checkpoint belongs to another model, or the file is damaged"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, or does not fit the module or optimizer it is loaded into."""


def _shape(value: Any) -> Any:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def check_tensors(expected: Iterable[Tuple[str, str, Tuple[int, ...]]], given: Mapping[str, Any],
                  strict: bool = True) -> None:
    """Raise for the first ``(key, label, shape)`` that ``given`` lacks (when ``strict``) or holds
    with another shape."""
    for key, label, shape in expected:
        if key not in given:
            if strict:
                raise CheckpointError(f"the checkpoint has no {label} (shape {tuple(shape)}): {OTHER_MODEL_FIX}.")
            continue
        if _shape(given[key]) != tuple(shape):
            raise CheckpointError(f"{label} has shape {_shape(given[key])} in the checkpoint, but "
                                          f"{tuple(shape)} here: {OTHER_MODEL_FIX}.")


def check_no_extra(keys: Iterable[str], known: Iterable[str]) -> None:
    """Raise for the first key that the module does not have."""
    known = set(known)
    extra = [k for k in keys if k not in known]
    if extra:
        raise CheckpointError(f"the checkpoint holds '{extra[0]}', which this module does not have "
                                      f"({len(extra)} such keys): {OTHER_MODEL_FIX}.")


def check_record(own: Dict[str, Any], saved: Any, where: str) -> None:
    """Raise unless ``saved`` is a layout record whose local tensors are the same slices as in ``own``."""
    if not isinstance(saved, dict) or saved.get("format") != own["format"]:
        raise CheckpointError(
            f"{where} has no nbscaler layout record, so it is not a per-rank state dict of a parallel module. "
            "A merged state dict loads with load_merged_state_dicts; a plain torch one into the original module.")
    mine, theirs = own["weights"], saved.get("weights", {})
    for attr, spec in mine.items():
        got = theirs.get(attr)
        if got is None or _slice_identity(got) != _slice_identity(spec):
            held = "nothing" if got is None else f"'{got['name']}' {_slice(got)}"
            same_tensor = got is not None and (got["name"], got["shape"]) == (spec["name"], spec["shape"])
            raise CheckpointError(
                f"{where}: local tensor '{attr}' is '{spec['name']}' {_slice(spec)} here, but {held} in the "
                f"checkpoint: {OTHER_PLAN_FIX if same_tensor else OTHER_MODEL_FIX}.")
    extra = sorted(set(theirs) - set(mine))
    if extra:
        raise CheckpointError(f"{where}: the checkpoint holds '{extra[0]}', which this plan does not: "
                                      f"{OTHER_PLAN_FIX}.")


def _slice_identity(spec: Dict[str, Any]) -> Tuple[Any, ...]:
    """What decides whether a saved tensor fits a local one: the same slice of the same tensor
    (which devices hold it does not matter, and torch's copy converts the dtype)."""
    return (spec["name"], spec["kind"], tuple(spec["shape"]), spec["split_dim"], spec["parts"], spec["index"],
            normalize(spec.get("blocks", 1)), spec.get("inner_dim"), spec.get("inner_parts", 1),
            normalize(spec.get("inner_blocks", 1)))


def _slice(spec: Dict[str, Any]) -> str:
    shape = tuple(spec["shape"])
    if spec["split_dim"] is None:
        return f"(whole, shape {shape})"
    blocks = normalize(spec.get("blocks", 1))
    strided = f", strided in {describe(blocks)}" if is_strided(blocks) else ""
    inner = (f", cut again along dim {spec['inner_dim']} in {spec.get('inner_parts', 1)}"
             if spec.get("inner_dim") is not None else "")
    return f"(part {spec['index']} of {spec['parts']} along dim {spec['split_dim']}{strided}{inner} of shape {shape})"


def describe_slot(slot: Dict[str, Any]) -> str:
    """An optimizer parameter in words: the original parameters (and slices) it holds."""
    if slot["module"] is None:
        return f"'{slot['param']}'"
    parts = []
    for seg in slot["segments"]:
        split_dim, n, index = seg["slice"]
        where = "" if split_dim is None else f" part {index}/{n} along dim {split_dim}"
        parts.append(f"'{slot['module']}{seg['param']}'{where} [{seg['start']}:{seg['start'] + seg['length']}]")
    return ", ".join(parts) or "nothing"


def check_optimizer_state(own: Dict[str, Any], state_dict: Dict[str, Any]) -> None:
    """Raise unless an optimizer state dict was saved under the same layout as ``own`` and every
    per-element state tensor has its parameter's shape."""
    saved = state_dict.get(OPTIMIZER_KEY)
    if not isinstance(saved, dict) or saved.get("format") != own["format"]:
        raise CheckpointError(
            "the optimizer state dict has no nbscaler layout record, so it is not a per-rank one of this optimizer; "
            "a merged optimizer state loads with load_merged_state_dicts.")
    mine, theirs = own["slots"], saved["slots"]
    for i, slot in enumerate(mine):
        if i >= len(theirs) or theirs[i] != slot:
            held = describe_slot(theirs[i]) if i < len(theirs) else "nothing"
            raise CheckpointError(f"optimizer parameter {i} holds {describe_slot(slot)} here, but {held} "
                                          f"in the checkpoint: {OTHER_PLAN_FIX}.")
    if len(theirs) > len(mine):
        raise CheckpointError(f"the optimizer checkpoint has {len(theirs)} parameters, this optimizer "
                                      f"{len(mine)}: {OTHER_PLAN_FIX}.")
    for index, values in state_dict.get("state", {}).items():
        shape = tuple(mine[index]["shape"])
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and tuple(value.shape) != shape:
                raise CheckpointError(
                    f"optimizer state '{key}' of {describe_slot(mine[index])} has shape {tuple(value.shape)} in the "
                    f"checkpoint, but the parameter has shape {shape}: {OTHER_MODEL_FIX}.")
