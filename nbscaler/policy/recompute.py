"""Activation recomputation: ops that run again in the backward instead of keeping what they save.

``ComputeConfig(pas_config={'recompute': 'none' | 'selective' | 'full'})`` says how much of each layer
(``RecomputeGranularity``, as Megatron-LM's ``--recompute-granularity``):

- ``'full'``: each layer of the model's repeated layers (``stack_path``: the largest ModuleList of two
  or more layers of one class, the one ``nbscaler.sweep`` reads the depth from), as
  ``recompute_modules=[that list]`` would;
- ``'selective'``: the attention core of each layer only (``attention_cores``), found in the graph
  whatever the modules are called: a product of two activations (the scores, Q·Kᵀ) followed through
  scale, mask, softmax and dropout to the next product of two activations (with V), or one
  ``scaled_dot_product_attention``. Its region is named after the module it runs in, with ``:core``
  (``'blocks.0.attn:core'``). It keeps Q, K and V and drops the scores, the probabilities and the
  dropout mask, which grow with the square of the sequence and cost few FLOPs to make again.

Or ``ComputeConfig(pas_config={'recompute_modules': [...]})`` names the modules in the vocabulary of
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

from nbscaler.config import RECOMPUTE, RECOMPUTE_MODULES as RECOMPUTE_KEY, ComputeConfig, RecomputeGranularity
from nbscaler.ir.graph import RECOMPUTE_CORE as CORE, RECOMPUTE_REGION as REGION, IRGraph, IRNode, fed_by_inputs
from nbscaler.policy.modules import describe_modules, module_classes, named_prefix, prefixes, unknown_names
from nbscaler.policy.primitives import PolicyError



#: Ops that multiply two tensors as matrices: the two products of an attention core.
PRODUCTS = ("matmul",)
#: Ops that may lie between the two products: scale, mask, softmax, dropout, casts, views.
BETWEEN = ("elementwise", "softmax", "reshape", "transpose", "expand", "getitem")


def recompute_names(cfg: ComputeConfig) -> List[str]:
    """The module names ``cfg`` asks to recompute (checked by ``ComputeConfig`` itself)."""
    return list(cfg.pas_config.get(RECOMPUTE_KEY) or ())


def granularity(cfg: ComputeConfig) -> Optional[RecomputeGranularity]:
    """``pas_config['recompute']``, or ``None`` where the config does not say."""
    value = cfg.pas_config.get(RECOMPUTE)
    return None if value is None else RecomputeGranularity(value)


def stack_path(graph: IRGraph) -> Optional[str]:
    """The path of the model's repeated layers in a traced graph: the largest container (by
    parameters) of two or more layers of one class that the model runs, as
    ``nbscaler.planning.stack.find_stack`` finds it on the module; ``None`` when there is none."""
    classes = module_classes(graph)
    ran = {p for n in graph.nodes for p in prefixes(n.module_path)}
    best = None
    for path in graph.meta.get("module_containers", ()):
        children = [k for k in classes if k.startswith(path + ".") and "." not in k[len(path) + 1:]]
        if len(children) < 2 or len({classes[c] for c in children}) != 1 or path not in ran:
            continue
        size = sum(_numel(t.shape) for name, t in graph.weights.items()
                   if t.kind == "param" and name.startswith(path + "."))
        if best is None or size > best[0]:
            best = (size, path)
    return None if best is None else best[1]


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def attention_cores(graph: IRGraph) -> List[List[IRNode]]:
    """The attention cores of ``graph``, each as the run of ops (in graph order) it spans.

    A core is either one ``scaled_dot_product_attention``, or a product of two activations (tensors
    computed from the forward's arguments, not weights: the scores Q·Kᵀ) whose result is followed,
    through element-wise ops (scale, mask, dropout, casts), views and at least one softmax, to the
    next product of two activations (the probabilities times V). The run holds every op between
    the two products (a mask made there, say), so that it is one region.
    """
    data = fed_by_inputs(graph)
    cores: List[List[IRNode]] = []
    taken = -1
    for i, node in enumerate(graph.nodes):
        if i <= taken:
            continue
        if node.op == "attention":
            cores.append([node])
            taken = i
            continue
        if not _activation_product(node, data):
            continue
        end = _core_end(graph.nodes, i, data)
        if end is not None:
            cores.append(graph.nodes[i:end + 1])
            taken = end
    return cores


def _activation_product(node: IRNode, data: set) -> bool:
    """A matrix product whose two operands are both computed from the data (no weight)."""
    ins = node.inputs
    return (node.op in PRODUCTS and len(ins) == 2
            and all(t.kind == "activation" and id(t) in data for t in ins))


def _core_end(nodes: Sequence[IRNode], start: int, data: set) -> Optional[int]:
    """The index of the product that closes the attention core opened by the scores at
    ``nodes[start]``, or ``None`` where what follows the scores is not softmax attention."""
    reach = {id(t) for t in nodes[start].output_tensors}
    softmax = False
    for j in range(start + 1, len(nodes)):
        node = nodes[j]
        reads = [t for t in node.inputs if id(t) in reach]
        if not reads:
            continue
        if _activation_product(node, data):
            others = [t for t in node.inputs if id(t) not in reach]
            return j if softmax and len(others) == 1 else None
        if node.op not in BETWEEN:
            return None
        softmax = softmax or node.op == "softmax"
        reach |= {id(t) for t in node.output_tensors}
    return None


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
    """The pass: ``node.meta['recompute'] = region`` for every op of a recomputed region (see above).

    Raises ``PolicyError`` naming the modules that exist when a name names none of them, and when
    ``recompute`` asks for layers or attention cores the model does not have.
    """
    for node in graph.nodes:
        node.meta.pop(REGION, None)
    if cfg.inference_only:
        return
    chosen = granularity(cfg)
    if chosen is RecomputeGranularity.SELECTIVE:
        _mark_regions(graph, selective_regions(graph))
        return
    if chosen is RecomputeGranularity.FULL:
        names = [full_stack(graph)]
    else:
        names = recompute_names(cfg)
    if not names:
        return
    missing = unknown_names(graph, names)
    if missing:
        raise PolicyError(f"pas_config['{RECOMPUTE_KEY}'] names {missing}, which name no module the model runs; "
                          f"name modules by path (e.g. 'blocks', 'blocks.3', 'blocks.*.mlp') or by class name. "
                          f"The model has: {describe_modules(graph)}.")
    classes, containers = module_classes(graph), set(graph.meta.get("module_containers", ()))
    _mark_regions(graph, {id(n): region_module(n.module_path, names, classes, containers) for n in graph.nodes})


def full_stack(graph: IRGraph) -> str:
    """The repeated layers ``recompute='full'`` recomputes, each on its own; ``PolicyError`` when none."""
    path = stack_path(graph)
    if path is None:
        raise PolicyError("pas_config['recompute']='full' recomputes each layer of the model's repeated layers "
                          "(an nn.ModuleList of two or more layers of one class), and this model has none; name "
                          "the modules to recompute with pas_config['recompute_modules'] instead. The model has: "
                          f"{describe_modules(graph)}.")
    return path


def selective_regions(graph: IRGraph) -> Dict[int, Optional[str]]:
    """``id(node)`` -> the attention core it belongs to (``'<module>:core'``) for ``recompute='selective'``;
    ``PolicyError`` when the graph has no attention core."""
    cores = attention_cores(graph)
    if not cores:
        raise PolicyError("pas_config['recompute']='selective' recomputes the attention core of each layer (the "
                          "scores Q·Kᵀ through softmax to the product with V, or a scaled_dot_product_attention), "
                          "and this model has none: no product of two activations leads through a softmax to "
                          "another. Use recompute='full' (each repeated layer), name modules with "
                          "pas_config['recompute_modules'], or recompute nothing.")
    return {id(n): (core[0].module_path + CORE) for core in cores for n in core}


def _mark_regions(graph: IRGraph, base: Dict[int, Optional[str]]) -> None:
    """Write each op's region from ``base`` (``id(node)`` -> the module or core it is recomputed as
    part of, or ``None``): one region per contiguous run within one stage, ``'#2'`` and on for a
    later run of the same one; an in-place op on a tensor made before its run is left out."""
    runs: Dict[str, int] = {}
    current: Optional[tuple] = None
    made: set = set()                                  # tensors the current region made
    for node in graph.nodes:
        module = base.get(id(node))
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
