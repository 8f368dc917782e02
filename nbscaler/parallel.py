"""``parallelize``: ``plan`` (trace -> policy -> cost), then write the files and load them, in one call.

>>> pm = parallelize(model, {'x': torch.randn(8, 64)}, 'tp',         # doctest: +SKIP
...                  ComputeConfig(plan_ngpus=2, runtime_ngpus=4))

Rank 0 compiles (or reuses an earlier compile) into ``gen_savedir``; the other ranks wait, receive
the files the broadcast strategy names, and every rank loads its own ``gencode{rank}.py``.

A module built on the meta device (``with torch.device('meta'): model = Llama(cfg)``), or any
module given ``weights=PATH``, is materialised per rank: each rank fills only the slices it holds,
from the checkpoint at ``PATH`` (safetensors, a Hugging Face folder, or a merged checkpoint) or
from the module's own seeded initialisation (``nbscaler.runtime.initialize``), and no process ever
holds the whole model; ``weights.pt`` is then neither written nor read.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple, Type, Union

import torch
import torch.distributed as dist

from nbscaler.genfiles import (CONFIG_FILE, CONSTANTS_FILE, GRAPH_FILE, PLAN_FILE, WEIGHTS_FILE, GenDir,
                               atomic_write_bytes, gencode_file, module_dir, weights_footer, write_graphs)
from nbscaler.config import BroadcastGenFilesStrategy, ComputeConfig, ReuseType, UserConfig
from nbscaler.ir.graph import IRGraph
from nbscaler.planning import planner
from nbscaler.planning.planner import Plan, Policy, build_module, cast_floats, module_name, place, policy_name, unplace
from nbscaler.policy.builtin import get_policy
from nbscaler.recipe import UNSET, Recipe
from nbscaler.runtime.checkpoint import load_merged_state_dicts, merge_state_dicts
from nbscaler.runtime.distributed import DistributedInfo, init_distributed
from nbscaler.runtime.float8 import require_torchao
from nbscaler.runtime.launch import PeerFailed
from nbscaler.runtime.module import ParallelModule
from nbscaler.runtime.optimizer import build_optimizer
from nbscaler.runtime.replicas import broadcast_weights, deduped_state_dict, load_deduped_state_dict
from nbscaler.runtime.sources import ModuleWeights, open_weights
from nbscaler.safeload import RECOMPILE, load_tensors
from nbscaler.space.autodist import plan_on_target, searches_on_target, target_module_dtype
from nbscaler.trace.tracer import has_meta_tensors

__all__ = ["BroadcastGenFilesStrategy", "ComputeConfig", "ParallelModule", "ReuseType", "UserConfig",
           "DistributedInfo", "broadcast_weights", "build_optimizer", "deduped_state_dict", "init_distributed",
           "load_deduped_state_dict", "load_merged_state_dicts", "merge_state_dicts", "parallelize"]


def _enum(kind: Type[Enum], value: Any, arg: str) -> Enum:
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{arg}={value!r} is not one of {', '.join(repr(m.value) for m in kind)}") from None


def _arg_signature(value: Any) -> Any:
    """Shapes and dtypes of tensors, values of everything else: what decides whether a trace is reusable."""
    if isinstance(value, torch.Tensor):
        return ["tensor", list(value.shape), str(value.dtype)]
    if isinstance(value, dict):
        return {str(k): _arg_signature(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_arg_signature(v) for v in value]
    return repr(value)


def parallelize(
    module_or_module_class: Union[torch.nn.Module, Type[torch.nn.Module]],
    dummy_forward_args: Dict[str, Any],
    pas_policy: Union[str, Callable[[IRGraph, ComputeConfig], IRGraph]],
    compute_config: ComputeConfig,
    *,
    gen_savedir: Union[str, Path] = "./.nbscaler",
    reuse: Union[ReuseType, str] = ReuseType.MATCH,
    instance_name: Optional[str] = None,
    load_module: bool = True,
    module_dtype: Optional[torch.dtype] = None,
    module_fn: Optional[Callable[[], torch.nn.Module]] = None,
    init_module_params: bool = True,
    broadcast_strategy: Union[str, BroadcastGenFilesStrategy] = "none",
    weights: Optional[Union[str, Path]] = None,
    init_seed: int = 0,
    recipe: Optional[Recipe] = None,
) -> Union[None, ParallelModule, Type[ParallelModule]]:
    """Turn a module (or module class) into a parallel module (or parallel module class).

    Args:
        module_or_module_class: the module to parallelize. A module object gives a
            ``ParallelModule`` object; a class gives a ``ParallelModule`` class.
        dummy_forward_args: forward's arguments by name, used to trace it once.
        pas_policy: 'dp', 'tp', 'data' (and, as they land, 'pp', 'hybrid', 'autodist'), or a
            function ``(graph, compute_config) -> graph`` that places every node.
        compute_config: devices per unit (``plan_ngpus``), ranks in all (``runtime_ngpus``), features.
        gen_savedir: where generated files go (``<gen_savedir>/_parallel_modules/...``).
        reuse: what earlier generated files may be reused (see ``ReuseType``).
        instance_name: tells several compiles of one module class apart.
        load_module: load and return the module; ``False`` only compiles, in any process.
        module_dtype: convert the module to this dtype before tracing.
        module_fn: builds the module when a class is given (default: ``cls()``).
        init_module_params: fill parameters with the traced module's values (else leave them empty).
        broadcast_strategy: which new files rank 0 sends to the other ranks.
        weights: a checkpoint each rank reads its own slices from: a ``.safetensors`` file, a folder
            of them (``save_pretrained(..., safe_serialization=True)``, sharded or not), or a merged
            checkpoint (``torch.save`` of ``merge_state_dicts(...)[0]``). Its names and shapes are
            checked against the module's before anything is written.
        init_seed: for a module on the meta device without ``weights``: the seed of its own
            initialisation, run per rank on the slices it holds; the values equal
            ``nbscaler.runtime.initialize.init_module(model, init_seed)`` sliced, whatever the plan.
        recipe: the training recipe (``nbscaler.Recipe``) the module will be trained with: its
            ``module_dtype`` is that of ``module_dtype`` (give either, or both alike), and each
            generated rank file states it in a comment. Pass the same recipe to ``build_optimizer``.
    """
    reuse = _enum(ReuseType, reuse, "reuse")
    module_dtype, recipe = module_dtype_of(module_dtype, recipe)
    if recipe is not None and recipe.float8 is not None:
        require_torchao()               # fp8 products are torchao's: fail before compiling when it is missing
    strategy = _enum(BroadcastGenFilesStrategy, broadcast_strategy, "broadcast_strategy")
    if not isinstance(compute_config, ComputeConfig):
        raise TypeError(f"compute_config must be a ComputeConfig, got {type(compute_config).__name__}")
    is_class = isinstance(module_or_module_class, type)
    module_class = module_or_module_class if is_class else type(module_or_module_class)
    if not issubclass(module_class, torch.nn.Module):
        raise TypeError(f"parallelize takes a torch.nn.Module or a subclass of it, got {module_class.__name__}")
    get_policy(pas_policy)             # an unknown policy fails here, before anything else
    gen = GenDir(module_dir(module_class, gen_savedir, instance_name))
    distributed = dist.is_available() and dist.is_initialized()
    if strategy is not BroadcastGenFilesStrategy.NONE and not distributed:
        raise RuntimeError(f"broadcast_strategy={strategy.value!r} sends files between ranks, but torch.distributed "
                           "is not initialized; use broadcast_strategy='none' in a single process.")
    rank = dist.get_rank() if distributed else 0
    per_rank = not is_class and (weights is not None or has_meta_tensors(module_or_module_class))
    if is_class and weights is not None:
        raise TypeError("weights= needs a module object (built on the meta device), not a class")

    new_files: List[str] = []
    error: Optional[BaseException] = None
    if rank == 0:
        try:
            source = None
            if per_rank:
                source = _weights_source(module_or_module_class, weights, init_seed)
            new_files = _compile(module_or_module_class, is_class, dummy_forward_args, pas_policy, compute_config,
                                 gen, reuse, module_dtype, module_fn,
                                 source.description if source is not None else {"source": WEIGHTS_FILE}, recipe)
        except BaseException as err:      # the other ranks must hear about it, not wait forever
            error = err
    if distributed:
        status = [None if error is None else f"{type(error).__name__}: {error}", new_files]
        dist.broadcast_object_list(status, src=0)
        if rank != 0 and status[0] is not None:
            raise PeerFailed(0, f"rank 0 failed to compile the parallel module: {status[0]}")
        _broadcast_files(gen, status[1], strategy, rank)
    if error is not None:
        raise error
    if not load_module:
        return None
    cls = gen.load_class(rank)
    if is_class:
        return cls
    source = None
    if per_rank and init_module_params:
        source = _weights_source(module_or_module_class, weights, init_seed, constants=gen.path / CONSTANTS_FILE)
    return cls(init_params=init_module_params, weights=source)


def _weights_source(module: torch.nn.Module, weights: Optional[Union[str, Path]], seed: int,
                    constants: Optional[Path] = None) -> ModuleWeights:
    """This rank's source of its slices: ``weights`` (its names and shapes checked against the
    module's first) for what checkpoints hold, the module's own values or seeded initialisation
    for the rest."""
    file = open_weights(weights) if weights is not None else None     # ModuleWeights checks its names
    captured = {}
    if constants is not None and constants.exists():
        captured = load_tensors(constants, fix=RECOMPILE)
    return ModuleWeights(module, file, seed, captured)


def module_dtype_of(module_dtype: Optional[torch.dtype],
                    recipe: Optional[Recipe]) -> Tuple[Optional[torch.dtype], Optional[Recipe]]:
    """The dtype to convert the module to, from ``module_dtype`` and the recipe's, and the recipe
    with it (``Recipe.of``: a ``ValueError`` where the two are given and differ)."""
    if recipe is None:
        return module_dtype, None
    recipe = Recipe.of(recipe, module_dtype=UNSET if module_dtype is None else module_dtype)
    return recipe.module_dtype, recipe


def plan(module_or_module_class: Union[torch.nn.Module, Type[torch.nn.Module]], dummy_forward_args: Dict[str, Any],
         pas_policy: Policy, compute_config: ComputeConfig, *, module_dtype: Optional[torch.dtype] = None,
         module_fn: Optional[Callable[[], torch.nn.Module]] = None, recipe: Optional[Recipe] = None) -> Plan:
    """Trace, place, check and cost a module in memory, writing nothing; see ``nbscaler.Plan``.

    Takes the first four arguments of ``parallelize`` (and its ``module_dtype`` / ``module_fn``) and
    needs no process group. ``"autodist"`` with ``pas_config['hardware']`` first chooses the config
    for that target from the plan space (``nbscaler.space.autodist``); any other policy compiles
    the config given (``nbscaler.planning.planner.plan``). ``recipe``: the training recipe
    (``nbscaler.Recipe``), whose ``module_dtype`` may stand for ``module_dtype`` (as in
    ``parallelize``); the plan keeps it (``Plan.recipe``) and its rank files state it.
    """
    module_dtype, recipe = module_dtype_of(module_dtype, recipe)
    if not searches_on_target(pas_policy, compute_config):
        result = planner.plan(module_or_module_class, dummy_forward_args, pas_policy, compute_config,
                              module_dtype=module_dtype, module_fn=module_fn)
    else:
        if not isinstance(compute_config, ComputeConfig):
            raise TypeError(f"compute_config must be a ComputeConfig, got {type(compute_config).__name__}")
        module_dtype = target_module_dtype(compute_config, module_dtype)
        module = build_module(module_or_module_class, module_fn, module_dtype)
        result = plan_on_target(module, dummy_forward_args, compute_config, module_dtype, recipe)
    result.recipe = recipe
    return result


# ------------------------------------------------------------------------------------------------
def _compile(module_or_class, is_class: bool, dummy_args: Dict[str, Any], pas_policy, cfg: ComputeConfig,
             gen: GenDir, reuse: ReuseType, module_dtype, module_fn, weights: Dict[str, Any],
             recipe: Optional[Recipe] = None) -> List[str]:
    """Generate (or reuse) the files; returns the names of newly written files. ``weights`` says
    where the ranks' weights come from: ``weights.pt`` is written only when it is that file.
    ``recipe``, where given, is stated in the rank files, so it is part of what reuse compares."""
    import nbscaler                    # for its version; the package imports this module
    module_class = module_or_class if is_class else type(module_or_class)
    fingerprint = {
        "graph": {"module": module_name(module_class),
                  "args": _arg_signature(dummy_args), "dtype": str(module_dtype),
                  "user_graph": cfg.user_config.graph, "inference_only": cfg.inference_only,
                  "dynamic_shape": cfg.dynamic_shape, "version": nbscaler.__version__},
        "code": {"compute_config": cfg.to_dict(), "policy": policy_name(pas_policy), "weights": weights},
    }
    if recipe is not None:             # absent otherwise, so that earlier compiles still match
        fingerprint["code"]["recipe"] = recipe.describe()
    fingerprint = json.loads(json.dumps(fingerprint, default=str))
    old = gen.read_config()
    if old is not None and reuse in (ReuseType.MATCH, ReuseType.MOO):
        if old["fingerprint"] == fingerprint:
            return []
        if reuse is ReuseType.MATCH:
            raise ValueError(f"{gen.path} holds a module compiled with different settings "
                             f"({_difference(old['fingerprint'], fingerprint)}); nothing was changed. Use "
                             "reuse='override' (or 'moo') to recompile, or another instance_name to keep both.")

    if (old is not None and reuse is ReuseType.GRAPH and old["fingerprint"]["graph"] == fingerprint["graph"]
            and gen.has_graphs()):            # absent when the graphs could not be stored: trace again
        result = place(unplace(gen.read_graphs()), pas_policy, cfg, fingerprint["graph"]["module"])
        result.recipe = recipe
        module = None
    else:
        module = build_module(module_or_class, module_fn, module_dtype)
        result = plan(module, cast_floats(dummy_args, module_dtype), pas_policy, cfg, recipe=recipe)

    per_rank = weights["source"] != WEIGHTS_FILE

    def write(tmp: Path) -> None:
        for r, src in result.sources.items():
            (tmp / gencode_file(r)).write_text(src + weights_footer(weights))
        if per_rank:                      # no whole copy: each rank reads its slices from the source
            constants = {n: t for g in result.graphs.values() for n, t in g.meta.get("constants", {}).items()}
            if constants:
                torch.save(constants, tmp / CONSTANTS_FILE)
        else:
            gen.write_weights(tmp, full_weights(module, result.graphs) if module is not None else None)
        write_graphs(tmp / GRAPH_FILE, result.graphs)
        (tmp / PLAN_FILE).write_text(json.dumps(result.to_json(), indent=1, default=str))
        (tmp / CONFIG_FILE).write_text(json.dumps({"fingerprint": fingerprint, "compute_config": result.config.to_dict(),
                                                   "policy": result.policy_name, "weights": weights,
                                                   "plan_seconds": result.compile_seconds},
                                                  indent=1, default=str))

    gen.replace_with(write)
    return sorted(gen.files())


def _difference(old: Dict, new: Dict, prefix: str = "") -> str:
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a != b:
            if isinstance(a, dict) and isinstance(b, dict):
                return _difference(a, b, f"{prefix}{key}.")
            return f"{prefix}{key} was {a!r}, now {b!r}"
    return "none"


def full_weights(module: torch.nn.Module, graphs: Dict[str, IRGraph]) -> Dict[str, torch.Tensor]:
    """Every parameter, buffer (persistent or not) and captured constant, by qualified name."""
    out: Dict[str, torch.Tensor] = {}
    for name, t in list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False)):
        out[name] = t.detach().cpu().contiguous()
    for graph in graphs.values():
        for name, t in graph.meta.get("constants", {}).items():
            out[name] = t.cpu().contiguous()
    return out


def _broadcast_files(gen: GenDir, names: List[str], strategy: BroadcastGenFilesStrategy, rank: int) -> None:
    """Send the newly generated files that ``strategy`` names from rank 0 to every other rank."""
    wanted = {
        BroadcastGenFilesStrategy.NONE: lambda n: False,
        BroadcastGenFilesStrategy.ALL: lambda n: True,
        BroadcastGenFilesStrategy.NO_WEIGHTS: lambda n: n != WEIGHTS_FILE,
        BroadcastGenFilesStrategy.CODE: lambda n: n.startswith("gencode"),
    }[strategy]
    names = [n for n in names if wanted(n)]
    if not names:
        return
    payload = [{n: (gen.path / n).read_bytes() for n in names} if rank == 0 else None]
    dist.broadcast_object_list(payload, src=0)
    if rank != 0:
        for name, data in payload[0].items():
            path = gen.path / name
            if not (path.exists() and path.read_bytes() == data):
                atomic_write_bytes(path, data)
