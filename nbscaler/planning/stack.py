"""A model as a stack: the ops before its repeated layers, the layers, the ops after.

Most of a large model is one layer repeated (Llama-3-70B's ``model.layers``: 80 decoder layers of
one class and shape), and each fact the cost model keeps per op (its local shapes and so its time
on a target, the bytes it saves for the backward, its FLOPs, the collectives before it) is the same
for every copy of that layer. So a model of any depth can be read off a copy of it with two layers:
the first, and a second that stands for all the others (its input comes from a layer, where the
first's comes from the ops before the stack). ``shallow`` makes that copy without copying a
weight; ``Stack.expand`` lays its ops out as the full model's would be, so that ``positions``
numbers every op of the full depth and ``template`` says which op of the copy it repeats.

>>> stack = find_stack(model)                       # doctest: +SKIP
>>> stack.path, stack.depth
('model.layers', 80)
>>> two = shallow(model, stack, 2)                  # 2 layers, sharing the module's own
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
from torch import nn

from nbscaler.ir.graph import REST_UNIT, IRNode
from nbscaler.policy.staging import layer_of


@dataclass(frozen=True)
class Stack:
    """The module path of a model's repeated layers (an ``nn.ModuleList``) and how many there are."""

    path: str
    depth: int

    def layer_of(self, module_path: str) -> Optional[int]:
        """The layer an op at ``module_path`` belongs to, or ``None`` outside the stack."""
        prefix = self.path + "."
        if not module_path.startswith(prefix):
            return None
        head = module_path[len(prefix):].split(".")[0]
        return int(head) if head.isdigit() else None

    def weight_layer(self, name: str) -> Optional[int]:
        """The layer weight ``name`` (``model.layers.3.mlp.up_proj.weight``) belongs to, or ``None``."""
        return self.layer_of(name)

    def unit_of(self, name: str) -> str:
        """ZeRO stage 3's unit of weight ``name`` by default (``policy.shard_units``): its layer of the
        stack, else ``REST_UNIT``."""
        layer = self.weight_layer(name)
        return REST_UNIT if layer is None else f"{self.path}.{layer}"

    def renamed(self, name: str, layer: int) -> str:
        """Weight ``name`` of a layer of the stack as the same weight of ``layer``."""
        rest = name[len(self.path) + 1:].split(".", 1)
        return f"{self.path}.{layer}.{rest[1]}" if len(rest) > 1 else f"{self.path}.{layer}"


def find_stack(module: nn.Module) -> Stack:
    """The largest ``nn.ModuleList`` (by parameters) of two or more layers of one class."""
    best = None
    for name, child in module.named_modules():
        if isinstance(child, nn.ModuleList) and name and len(child) >= 2 and len({type(c) for c in child}) == 1:
            size = sum(p.numel() for p in child.parameters())
            if best is None or size > best[0]:
                best = (size, name, len(child))
    if best is None:
        raise ValueError(f"{type(module).__name__} has no nn.ModuleList of two or more layers of one class, "
                         "which a sweep reads the model's depth from; hold the repeated layers in one "
                         "(as nanoGPT's blocks or Hugging Face's model.layers are), or plan it with nbscaler.plan.")
    return Stack(best[1], best[2])


#: Attributes by which layers of one class and shape may still compute differently: the keys a
#: layer's attention sees (``nbscaler.models.llama.Attention.window``; Hugging Face's ``sliding_window``).
PER_LAYER_FACTS = ("window", "sliding_window")


def check_layers_alike(module: nn.Module, stack: Stack) -> None:
    """Raise ``ValueError`` when a layer of ``stack`` after the second computes otherwise than the
    second (``PER_LAYER_FACTS``, such as a sliding window on every other layer, as GPT-OSS has): the
    copy's second layer stands for every later one, so such a model cannot be read off the copy."""
    layers = module.get_submodule(stack.path)

    def facts(layer: nn.Module) -> Dict[str, object]:
        out: Dict[str, object] = {}
        for name, m in layer.named_modules():
            for attr in PER_LAYER_FACTS:
                if hasattr(m, attr) and (getattr(m, attr) is None or isinstance(getattr(m, attr), int)):
                    out[f"{name}.{attr}" if name else attr] = getattr(m, attr)
        return out
    second = facts(layers[1])
    for i in range(2, len(layers)):
        theirs = facts(layers[i])
        if theirs != second:
            what = next(k for k in sorted(set(second) | set(theirs)) if second.get(k) != theirs.get(k))
            raise ValueError(f"the layers of {stack.path} do not all compute alike: {stack.path}.1.{what} is "
                             f"{second.get(what)!r} where {stack.path}.{i}.{what} is {theirs.get(what)!r}. A sweep "
                             f"prices every layer after the first as the second, so it cannot price this model; "
                             f"plan it with nbscaler.plan(...) and price each plan with plan.step_figures(...).")


def shallow(module: nn.Module, stack: Stack, layers: int) -> nn.Module:
    """A copy of ``module`` whose stack keeps its first ``layers`` layers: the modules on the way to
    the stack are copied shallowly, every layer and weight is the module's own."""
    parts = stack.path.split(".")
    top = copy.copy(module)
    top._modules = dict(module._modules)
    parent = top
    for part in parts[:-1]:
        child = copy.copy(parent._modules[part])
        child._modules = dict(child._modules)
        parent._modules[part] = child
        parent = child
    parent._modules[parts[-1]] = nn.ModuleList(list(parent._modules[parts[-1]])[:layers])
    return top


class Expansion:
    """The ops of the full-depth model, laid out from a placed two-layer copy's ``nodes``.

    ``template[v]`` is the index (in ``nodes``) of the op that full-model op ``v`` repeats: the ops
    before the stack, the first layer's, the second layer's ``depth - 1`` times, the ops after.
    ``layer_key[v]`` names the unit a pipeline cut should not split (``policy.staging.layer_of``).
    """

    def __init__(self, stack: Stack, nodes: Sequence[IRNode]):
        layers = [stack.layer_of(n.module_path) for n in nodes]
        first = [i for i, k in enumerate(layers) if k == 0]
        second = [i for i, k in enumerate(layers) if k == 1]
        if not first or len(first) != len(second) or first != list(range(first[0], first[-1] + 1)) \
                or second != list(range(first[-1] + 1, first[-1] + 1 + len(first))):
            raise ValueError(f"the layers of {stack.path} do not trace as two runs of the same ops, one after "
                             "the other; a sweep needs layers alike (one class, one shape, called in order).")
        self.stack, self.nodes = stack, nodes
        self.before, self.size = first[0], len(first)
        self.after = second[-1] + 1
        tail = list(range(self.after, len(nodes)))
        self.template = np.array(list(range(self.after - self.size)) + second * (stack.depth - 1) + tail)
        keys: List[str] = [layer_of(n.module_path) for n in nodes[:self.before]]
        for k in range(stack.depth):
            keys += [f"{stack.path}.{k}"] * self.size
        self.layer_key = keys + [layer_of(nodes[i].module_path) for i in tail]

    def __len__(self) -> int:
        return len(self.template)

    def positions(self, index: int, layer: Optional[int]) -> List[int]:
        """Where op ``index`` of the copy sits in the full model: once outside the stack; in
        ``layer`` (or in every layer it stands for when ``layer`` is None) inside it."""
        if index < self.before:
            return [index]
        if index >= self.after:
            return [index - self.after + self.before + self.stack.depth * self.size]
        j = (index - self.before) % self.size
        if index < self.before + self.size:
            return [self.before + j]
        layers = range(1, self.stack.depth) if layer is None else [layer]
        return [self.before + k * self.size + j for k in layers]

    def copy_position(self, v: int) -> int:
        """The place in the copy's ops that full-model cut ``v`` (before op ``v``) looks like: the
        same place for a cut before or in the first layer, the second layer's for a cut in a later
        one, the same place after the stack for one there."""
        if v < self.before + self.size:
            return v
        end = self.before + self.stack.depth * self.size
        if v >= end:
            return self.after + (v - end)
        return self.before + self.size + (v - self.before) % self.size


def repeat_counts(expansion: Expansion, start: int, end: int) -> np.ndarray:
    """How often each op of the copy runs among full-model ops ``start .. end - 1``."""
    return np.bincount(expansion.template[start:end], minlength=len(expansion.nodes)).astype(float)


def one_sequence(args, micro_batch: int):
    """``args`` (dummy inputs of one sequence) with ``micro_batch`` sequences: every tensor repeated
    along its first dimension, a tensor passed twice still one tensor (as the trace sees it)."""
    from torch.utils._pytree import tree_map
    grown: Dict[int, torch.Tensor] = {}

    def grow(t):
        if isinstance(t, torch.Tensor) and id(t) not in grown:
            grown[id(t)] = _repeated(t, micro_batch)
        return grown[id(t)] if isinstance(t, torch.Tensor) else t
    return tree_map(grow, args)


def _repeated(t: torch.Tensor, micro_batch: int) -> torch.Tensor:
    if t.ndim == 0:
        return t
    if t.shape[0] != 1:
        raise ValueError(f"sweep's dummy_args hold one sequence: every tensor's first dimension must be 1, "
                         f"got a tensor of shape {tuple(t.shape)}; pass one row (x[:1]).")
    return t.repeat(micro_batch, *([1] * (t.ndim - 1)))
