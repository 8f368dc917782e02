"""Replicated state: save each copy once, and fill copies in from the ranks that have them.

Parallel training keeps many identical copies: every data-parallel unit holds the whole model,
replicated tensors sit on several devices of a unit, and without ZeRO every unit keeps the same
optimizer state. Each such tensor is an *item* with an identity that says which original tensor
(and which slice, or which ZeRO segments) it is, so equal identities mean equal values:

- ``deduped_state_dict`` keeps each item only on the lowest rank that holds it;
- ``load_deduped_state_dict`` sends every rank the items it lacks from the lowest rank that has
  them, then loads complete per-rank state dicts (checked before anything is copied);
- ``broadcast_weights`` copies all parameters and buffers from ranks ``0 .. stride-1`` to the ranks
  that play the same part (the ``no_weights`` broadcast strategy leaves the other ranks without
  initial weights).

All three are collective: every rank calls them.
"""

from __future__ import annotations

import contextlib

from typing import Any, Dict, Hashable, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from nbscaler.runtime.checkpoint import Device, StateDict, check_model_state
from nbscaler.runtime.groups import get_group, strided_ranks
from nbscaler.runtime.optimizer import layout_of, parallel_modules
from nbscaler.runtime.statecheck import EXTRA_STATE, CheckpointError, check_optimizer_state, check_record

Item = Tuple[Hashable, ...]            # (tag, ...): tags 'tensor' and 'plain' for module entries,
MODULE_TAGS = ("tensor", "plain")     # 'slot' and 'plain slot' for optimizer parameters


def _rank_world() -> Tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _all_gather(obj: Any) -> List[Any]:
    if not dist.is_initialized():
        return [obj]
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def module_items(module: torch.nn.Module) -> Dict[Item, str]:
    """Each entry of ``module``'s per-rank state dict (but the layout records) by its identity."""
    items: Dict[Item, str] = {}
    parallel = parallel_modules(module)
    inside = set()
    for prefix, m in parallel.items():
        inside |= {prefix + key for key in m.state_dict(keep_vars=True)}
        for attr, spec in m.weight_specs.items():
            if spec.persistent:
                items[("tensor", prefix, spec.name, spec.split_dim, spec.parts, spec.index, spec.inner_dim)] = prefix + attr
    for key in module.state_dict(keep_vars=True):
        if key not in inside:
            items[("plain", key)] = key
    return items


def optimizer_items(optimizer: torch.optim.Optimizer) -> Dict[Item, int]:
    """Each optimizer parameter's index by the identity of what it holds."""
    items: Dict[Item, int] = {}
    for index, slot in enumerate(layout_of(optimizer)["slots"]):
        if slot["module"] is None:
            items[("plain slot", slot["param"])] = index
        else:
            held = tuple((seg["param"], *seg["slice"], seg["start"], seg["length"], seg["offset"])
                         for seg in slot["segments"])
            items[("slot", slot["module"], held, tuple(slot["shape"]))] = index
    return items


def deduped_state_dict(module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer] = None
                       ) -> Tuple[StateDict, Optional[StateDict]]:
    """This rank's state dicts with every entry that a lower rank also holds left out.

    The layout records stay, so the result still loads with ``load_deduped_state_dict`` and merges
    with ``merge_state_dicts``. Collective.
    """
    module_state = module.state_dict()
    optimizer_state = optimizer.state_dict() if optimizer is not None else None
    mine = module_items(module)
    slots = optimizer_items(optimizer) if optimizer is not None else {}
    owner: Dict[Item, int] = {}
    for rank, held in enumerate(_all_gather([*mine, *slots])):
        for item in held:
            owner.setdefault(item, rank)
    rank, _ = _rank_world()
    for item, key in mine.items():
        if owner[item] != rank:
            del module_state[key]
    for item, index in slots.items():
        if owner[item] != rank:
            optimizer_state["state"].pop(index, None)
    return module_state, optimizer_state


def load_deduped_state_dict(module: torch.nn.Module, module_state_dict: StateDict,
                            optimizer: Optional[torch.optim.Optimizer] = None,
                            optimizer_state_dict: Optional[StateDict] = None, *, device: Device = None) -> None:
    """Load the deduped state dicts this rank saved, receiving what it left out from the ranks that
    kept it. The plan must be the one that saved them (to change plans, merge). Collective.

    ``device``: where received tensors are put before loading (default: where they were saved).
    """
    if optimizer is not None and optimizer_state_dict is None:
        raise ValueError("an optimizer was given without optimizer_state_dict to load into it.")
    problem = None            # found before the collective below, raised by every rank after it
    try:
        for prefix, m in parallel_modules(module).items():
            where = f"the deduped state dict at '{prefix}'" if prefix else "the deduped state dict"
            check_record(m.get_extra_state(), module_state_dict.get(prefix + EXTRA_STATE), where)
        if optimizer is not None:
            check_optimizer_state(layout_of(optimizer), optimizer_state_dict)
    except CheckpointError as err:
        problem = str(err)
    module_state = dict(module_state_dict)
    mine = module_items(module)
    have = [item for item, key in mine.items() if key in module_state]
    slots: Dict[Item, int] = {}
    optimizer_state: StateDict = {"state": {}}
    if optimizer is not None:
        slots = optimizer_items(optimizer)
        optimizer_state = {**optimizer_state_dict, "state": dict(optimizer_state_dict["state"])}
        have += [item for item, index in slots.items() if index in optimizer_state["state"]]
    table = _all_gather(([*mine, *slots], have, problem))
    failed = [(rank, error) for rank, (_, _, error) in enumerate(table) if error]
    if failed:
        raise CheckpointError(f"rank {failed[0][0]}: {failed[0][1]}")

    def get(item: Item) -> Any:
        return module_state[mine[item]] if item in mine else optimizer_state["state"][slots[item]]

    def put(item: Item, value: Any) -> None:
        if device is not None:
            value = tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)
        if item in mine:
            module_state[mine[item]] = value
        else:
            optimizer_state["state"][slots[item]] = value

    _exchange(table, get, put)
    check_model_state(module, module_state)
    if optimizer is not None:
        check_optimizer_state(layout_of(optimizer), optimizer_state)
    module.load_state_dict(module_state)
    if optimizer is not None:
        optimizer.load_state_dict(optimizer_state)


def _exchange(table: List[Tuple[List[Item], List[Item], Any]], get, put) -> None:
    """Send each rank the items it holds but lacks, from the lowest rank that has them.

    ``table[r]`` starts with the items rank ``r`` holds and the items it has values for. Every rank
    computes the same list of (source, destination) transfers and walks it in order, so blocking
    point-to-point messages cannot deadlock: the first unfinished transfer always has both ends
    waiting on it.
    """
    first_with: Dict[Item, int] = {}
    for rank, (_, has, _) in enumerate(table):
        for item in has:
            first_with.setdefault(item, rank)
    transfers: Dict[Tuple[int, int], List[Item]] = {}
    for dst, (held, has, _) in enumerate(table):
        present = set(has)
        for item in held:
            if item in present:
                continue
            if item in first_with:
                transfers.setdefault((first_with[item], dst), []).append(item)
            elif item[0] in MODULE_TAGS:        # optimizer parameters may have no state yet
                raise CheckpointError(f"no rank has {_describe(item)} in its deduped state dict: load the deduped "
                                      "state dicts that all ranks saved together.")
    rank, _ = _rank_world()
    for (src, dst), items in sorted(transfers.items()):
        if rank == src:
            payload = {item: tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, get(item))
                       for item in items}
            dist.send_object_list([payload], dst=dst)
        elif rank == dst:
            box: List[Any] = [None]
            dist.recv_object_list(box, src=src)
            for item, value in box[0].items():
                put(item, value)


def _describe(item: Item) -> str:
    if item[0] == "tensor":
        _, prefix, name, split_dim, parts, index, _ = item
        return f"'{prefix}{name}'" + ("" if split_dim is None else f" (part {index} of {parts} along dim {split_dim})")
    return f"'{item[1]}'"


def broadcast_weights(module: torch.nn.Module, stride: int) -> None:
    """Copy every parameter and buffer of rank ``r % stride`` to rank ``r``, for all ranks.

    Use it after ``parallelize(..., broadcast_strategy='no_weights',
    init_module_params=rank < stride)``: ranks ``0 .. stride-1`` have the initial weights, the
    others receive them. ``stride`` must be a multiple of ``plan_ngpus`` (so that source and
    destination play the same part of the plan) and divide the number of ranks. Collective.
    Master copies an optimizer already keeps (``build_optimizer(master_dtype=...)``) take the
    received values too.
    """
    rank, world = _rank_world()
    plans = sorted({m.compute_config.plan_ngpus for m in parallel_modules(module).values()})
    if stride < 1 or world % stride or any(stride % plan for plan in plans):
        raise ValueError(f"broadcast_weights(stride={stride}) needs a stride that divides the {world} ranks and "
                         f"is a multiple of plan_ngpus ({plans}); use stride=plan_ngpus.")
    for start in range(stride):                 # creating a group is collective: all of them, in order
        get_group(strided_ranks(start, stride, world))
    group = get_group(strided_ranks(rank, stride, world))
    if group is None:
        return
    with contextlib.ExitStack() as whole, torch.no_grad():
        for m in parallel_modules(module).values():     # master copies and ZeRO-3's shards follow
            whole.enter_context(m.whole_parameters(write=True))
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.detach(), src=rank % stride, group=group)
