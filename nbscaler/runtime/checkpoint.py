"""Putting per-rank slices back together into the original module's tensors.

Every local parameter knows, through its ``WeightSpec``, which slice of which original tensor it
holds; merging is concatenating the slices of each tensor in index order (a replicated tensor is
taken from any rank that has it).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch

from nbscaler.runtime.module import ParallelModule, WeightSpec


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
        full[name] = torch.cat([slices[i] for i in range(spec.parts)], dim=spec.split_dim)
    return full


def local_pieces(module: torch.nn.Module, grads: bool = False) -> List[Tuple[WeightSpec, torch.Tensor]]:
    """``(spec, tensor)`` for every local weight of every parallel module in ``module``
    (its gradient with ``grads=True``; parameters without a gradient are left out)."""
    out = []
    for m in module.modules():
        if isinstance(m, ParallelModule):
            for attr, spec in m.weight_specs.items():
                t = getattr(m, attr)
                t = t.grad if grads else t
                if t is not None:
                    out.append((spec, t.detach().cpu().clone()))
    return out
