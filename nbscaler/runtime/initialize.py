"""A module's own initialisation, seeded so that its values never depend on the plan.

A rank that materialises only its slices of a module built on the meta device must still give each
tensor the value one process would. The rule, per module that owns tensors (its own parameters and
buffers, not its children's):

1. the module is copied with its own tensors on the CPU (its children stay as they are);
2. the CPU generator is seeded with ``module_seed(seed, path)``, a hash of the seed and the module's
   path (``'blocks.0.attn.q'``);
3. its initialiser runs on the copy: the ``_init_weights`` of the nearest Hugging Face model above
   it (or itself), when that sets every tensor of the module, else its ``reset_parameters()``.

Each tensor's value is then a function of the seed, the module's path and its class alone: not of
the plan, the rank, the other modules or the order they are initialised in. ``init_module(model,
seed)`` applies the rule to a whole module in one process; a rank applies it to the modules whose
tensors it holds a slice of, one module at a time, and keeps its slices. That is exact (bitwise
the same values) and costs a rank the initialisation of the full tensors it holds slices of, with
one module's tensors in memory at a time: the CPU generator cannot skip ahead to a slice.

A tensor shared by several modules (tied weights) belongs to the module of its first name.
"""

from __future__ import annotations

import copy
import hashlib
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

Initializer = Callable[[nn.Module], None]


def module_seed(seed: int, path: str) -> int:
    """The generator seed of the module at ``path``: 63 bits of SHA-256 of the seed and the path."""
    digest = hashlib.sha256(f"{int(seed)}/{path}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2 ** 63 - 1)


def owner_of(name: str) -> Tuple[str, str]:
    """``'blocks.0.attn.q.weight'`` -> ``('blocks.0.attn.q', 'weight')``."""
    path, _, attr = name.rpartition(".")
    return path, attr


def first_names(module: nn.Module) -> Dict[str, List[str]]:
    """Every parameter and buffer by its first name, with all its names (more than one when tied)."""
    names: Dict[int, List[str]] = {}
    for name, t in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)):
        names.setdefault(id(t), []).append(name)
    return {aliases[0]: aliases for aliases in names.values()}


def initial_tensors(root: nn.Module, path: str, seed: int) -> Dict[str, torch.Tensor]:
    """The initial values of the tensors the module at ``path`` owns, on the CPU, by attribute name."""
    module = root.get_submodule(path)
    rng_seed = module_seed(seed, path)
    tried = []
    for init in _initializers(root, path):
        copied = _materialised(module)
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(rng_seed)
            with torch.no_grad():
                init(copied)
        unset = _unset(copied)
        if unset is None:
            return {**{k: p.detach() for k, p in copied._parameters.items() if p is not None},
                    **{k: b for k, b in copied._buffers.items() if b is not None}}
        tried.append(f"{getattr(init, '__name__', 'init')} left '{unset}' unset")
    what = "; ".join(tried) if tried else "it has no reset_parameters() and no Hugging Face model above it"
    raise RuntimeError(
        f"cannot initialise '{path or type(root).__name__}' ({type(module).__name__}) on the meta device: {what}. "
        "Define reset_parameters() on it to set its own parameters and buffers, or pass "
        "parallelize(..., weights=PATH) to load them from a checkpoint.")


def owners(names: List[str]) -> Dict[str, List[str]]:
    """Tensor names grouped by the path of the module that owns them, in first-seen order."""
    out: Dict[str, List[str]] = {}
    for name in names:
        out.setdefault(owner_of(name)[0], []).append(name)
    return out


def initial_values(root: nn.Module, names: List[str], seed: int) -> Iterator[Tuple[str, torch.Tensor]]:
    """``(name, full initial tensor)`` for each of ``names``, one owning module at a time."""
    for path, owned in owners(names).items():
        values = initial_tensors(root, path, seed)
        for name in owned:
            yield name, values[owner_of(name)[1]]
        del values


@torch.no_grad()
def init_module(module: nn.Module, seed: int = 0) -> nn.Module:
    """Give every parameter and buffer of ``module`` its seeded initial value, on the CPU, in place
    (a module on the meta device gets real tensors); returns ``module``.

    This is the one-process reference of a parallel module materialised per rank without weights:
    ``parallelize(meta_model, ..., init_seed=seed)`` holds, on each rank, exactly its slices of
    ``init_module(copy_of_model, seed)``. Tied tensors stay tied.
    """
    tied = first_names(module)
    for name, value in initial_values(module, list(tied), seed):
        path, attr = owner_of(name)
        old = getattr(module.get_submodule(path), attr)
        new = nn.Parameter(value, requires_grad=old.requires_grad) if isinstance(old, nn.Parameter) else value
        for alias in tied[name]:                  # one new tensor object for every name: ties stay
            path, attr = owner_of(alias)
            holder = module.get_submodule(path)
            (holder._parameters if attr in holder._parameters else holder._buffers)[attr] = new
    return module


def _initializers(root: nn.Module, path: str) -> List[Initializer]:
    """The initialisers to try for the module at ``path``, in order."""
    module = root.get_submodule(path)
    found: List[Initializer] = []
    hf = _nearest_hf_model(root, path)
    if hf is not None:
        found.append(_named(hf._init_weights, "_init_weights"))
    if callable(getattr(module, "reset_parameters", None)):
        found.append(_named(lambda m: m.reset_parameters(), "reset_parameters()"))
    return found


def _named(fn: Initializer, name: str) -> Initializer:
    def init(m: nn.Module) -> None:
        fn(m)
    init.__name__ = name
    return init


def _nearest_hf_model(root: nn.Module, path: str) -> Optional[nn.Module]:
    """The deepest module on the way from ``root`` to ``path`` (itself included) that is a Hugging
    Face model (it has ``_init_weights`` and a ``config``)."""
    parts = path.split(".") if path else []
    found = None
    for depth in range(len(parts) + 1):
        candidate = root.get_submodule(".".join(parts[:depth]))
        if callable(getattr(candidate, "_init_weights", None)) and hasattr(candidate, "config"):
            found = candidate
    return found


def _materialised(module: nn.Module) -> nn.Module:
    """A shallow copy of ``module`` whose own tensors are new CPU tensors, NaN where they are
    floating point (so an initialiser that skips one is caught), except buffers the module holds
    real values of, which are copied; its children are the original ones, untouched."""
    copied = copy.copy(module)

    def fresh(t: torch.Tensor, keep: bool) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
        if keep and not t.is_meta:
            out.copy_(t.detach())
        elif out.is_floating_point():
            out.fill_(float("nan"))
        return out

    copied._parameters = {k: None if p is None else nn.Parameter(fresh(p, False), requires_grad=p.requires_grad)
                          for k, p in module._parameters.items()}
    copied._buffers = {k: None if b is None else fresh(b, True) for k, b in module._buffers.items()}
    copied._modules = dict(module._modules)
    return copied


def _unset(module: nn.Module) -> Optional[str]:
    """The first own floating-point tensor of ``module`` that still holds NaN, if any."""
    for name, t in (*module._parameters.items(), *module._buffers.items()):
        if t is not None and t.is_floating_point() and bool(torch.isnan(t).any()):
            return name
    return None
