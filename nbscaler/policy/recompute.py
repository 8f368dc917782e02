"""Activation recomputation: modules whose ops run again in the backward instead of keeping what they save.

``ComputeConfig(pas_config={'recompute_modules': [...]})`` names the modules in the vocabulary of
``nbscaler.policy.modules``: ``'blocks.3'``, ``'blocks'`` (a ModuleList: each of its layers on its
own), ``'blocks.*.mlp'`` or a class name such as ``'Block'``. Where names nest, the outermost wins.

The pass ``mark_recompute`` runs after placement under every policy and writes one fact per op,
``node.meta['recompute']``: the name of the *region* the op belongs to, one per module instance (a
module called twice, or cut by a pipeline stage boundary, gives one region per contiguous run of its
ops: ``'blocks.0'``, then ``'blocks.0#2'``). Everything downstream reads that fact only:

- code generation writes each region as one local function, called through
  ``torch.utils.checkpoint.checkpoint(fn, *inputs, use_reentrant=False)``: the forward keeps the
  region's inputs and drops what its ops saved; the backward runs the function again (with the
  random state of the first run, so a dropout draws the same mask) and then differentiates it;
- the memory model counts the region's inputs instead of its saved tensors (``cost.local``);
- the time model adds the region's forward to its backward (``cost.timing``).

An in-place op that writes a tensor made before its region is left out of the region (running it
twice would apply it twice).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

from nbscaler.config import RECOMPUTE_MODULES as RECOMPUTE_KEY, ComputeConfig
from nbscaler.ir.graph import RECOMPUTE_REGION as REGION, IRGraph, IRNode
from nbscaler.policy.modules import describe_modules, module_classes, named_prefix, prefixes, unknown_names
from nbscaler.policy.primitives import PolicyError



def recompute_names(cfg: ComputeConfig) -> List[str]:
    """The module names ``cfg`` asks to recompute (checked by ``ComputeConfig`` itself)."""
    return list(cfg.pas_config.get(RECOMPUTE_KEY) or ())


def region_module(path: str, names: Sequence[str], classes: Dict[str, str], containers: Sequence[str]) -> Optional[str]:
    """The module instance an op at ``path`` is recomputed as part of, or ``None``.

    The outermost module any name names; a container (ModuleList, ModuleDict, Sequential) stands for
    its children, so ``'blocks'`` recomputes ``blocks.0``, ``blocks.1``, ... each on its own.
    """
    found = [p for p in (named_prefix(path, name, classes) for name in names) if p is not None]
    if not found:
        return None
    outer = min(found, key=len)
    if outer in containers and path != outer:
        return prefixes(path)[outer.count(".") + 1]
    return outer


def mark_recompute(graph: IRGraph, cfg: ComputeConfig) -> None:
    """The pass: ``node.meta['recompute'] = region`` for every op of a recomputed module (see above).

    Raises ``PolicyError`` naming the modules that exist when a name names none of them.
    """
    for node in graph.nodes:
        node.meta.pop(REGION, None)
    names = recompute_names(cfg)
    if not names or cfg.inference_only:
        return
    missing = unknown_names(graph, names)
    if missing:
        raise PolicyError(f"pas_config['{RECOMPUTE_KEY}'] names {missing}, which name no module the model runs; "
                          f"name modules by path (e.g. 'blocks', 'blocks.3', 'blocks.*.mlp') or by class name. "
                          f"The model has: {describe_modules(graph)}.")
    classes, containers = module_classes(graph), set(graph.meta.get("module_containers", ()))
    runs: Dict[str, int] = {}
    current: Optional[tuple] = None
    made: set = set()                                  # tensors the current region made
    for node in graph.nodes:
        module = region_module(node.module_path, names, classes, containers)
        key = (module, node.stage)
        if module is not None and _writes_outside(node, made if key == current else set()):
            module, key = None, (None, node.stage)
        if key != current:
            made = set()
            if module is not None:
                runs[module] = runs.get(module, 0) + 1
        current = key
        if module is None:
            continue
        node.meta[REGION] = module if runs[module] == 1 else f"{module}#{runs[module]}"
        made |= {id(t) for t in node.output_tensors}


def _writes_outside(node: IRNode, made: set) -> bool:
    """An in-place op on a tensor its region did not make."""
    return node.inplace and bool(node.inputs) and id(node.inputs[0]) not in made


def recomputed_regions(graph: IRGraph) -> Dict[str, List[IRNode]]:
    """Region name -> its ops, in graph order."""
    out: Dict[str, List[IRNode]] = {}
    for node in graph.nodes:
        if REGION in node.meta:
            out.setdefault(node.meta[REGION], []).append(node)
    return out
