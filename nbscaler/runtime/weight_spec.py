"""``WeightSpec``: which slice of an original tensor a rank's local parameter or buffer holds.

The parallel module (``nbscaler.runtime.module``), the weight sources that fill it
(``nbscaler.runtime.sources``) and checkpoints all read it; it reads none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch

from nbscaler import blocks as strided
from nbscaler.blocks import Blocks, normalize


@dataclass(frozen=True)
class WeightSpec:
    """Which part of an original parameter or buffer a local one holds.

    ``split_dim=None``: the whole tensor, a copy of which lives on each of ``devices``. Otherwise
    slice ``index`` of ``parts`` along ``split_dim``; the slices live on ``devices``. With
    ``blocks=3`` the dim is three equal blocks (a fused q, k, v projection) and the slice is part
    ``index`` of each block, concatenated: this device's heads of q, k and v; ``blocks=(2, 1, 1)``
    the same with blocks of relative sizes 2:1:1 (grouped-query attention; ``nbscaler.blocks``).

    With ``inner_dim`` the slice is cut twice (experts split by expert and, inside each, by hidden
    unit): ``parts`` counts every distinct slice and ``index`` is this one's place among them; the
    cut along ``split_dim`` has ``parts // inner_parts`` parts, of which this holds
    ``index // inner_parts``, and the cut of that along ``inner_dim`` (in ``inner_blocks``) has
    ``inner_parts``, of which this holds ``index % inner_parts``.
    """

    name: str
    kind: str                       # 'param' | 'buffer' | 'constant'
    shape: Tuple[int, ...]          # the full, original shape
    dtype: torch.dtype
    devices: Tuple[int, ...] = (0,)
    split_dim: Optional[int] = None
    parts: int = 1
    index: int = 0
    persistent: bool = True
    replicas: Tuple[int, ...] = ()      # plan devices holding copies whose gradients must be summed
    blocks: Blocks = 1
    partial_grads: bool = False         # each of ``devices`` holds part of the gradient (its ops split the batch)
    inner_dim: Optional[int] = None     # a second cut, inside the first (see above)
    inner_parts: int = 1
    inner_blocks: Blocks = 1
    partial_devices: Tuple[int, ...] = ()   # with ``partial_grads``: the devices summed, when not all of ``devices``

    @property
    def copies(self) -> int:
        """How many devices of a unit hold this same slice (copies of a pipeline stage included)."""
        return len(self.devices) // self.parts * max(1, len(self.replicas))

    @property
    def partial_group(self) -> Tuple[int, ...]:
        """The devices whose partial gradients are summed with this one's (``partial_grads``): all
        of ``devices`` unless ``partial_devices`` names some (over a grid, this device's
        counterparts in the other groups: tensor parallelism inside context parallelism)."""
        return self.partial_devices or self.devices

    @property
    def saved(self) -> bool:
        """Whether the original module's state dict has this tensor (parameters and persistent
        buffers; not non-persistent buffers, nor constants the trace captured)."""
        return self.kind == "param" or (self.kind == "buffer" and self.persistent)

    def to_dict(self) -> Dict[str, Any]:
        """Plain values only, so checkpoints load with ``torch.load(..., weights_only=True)``."""
        return {"name": self.name, "kind": self.kind, "shape": list(self.shape), "dtype": str(self.dtype),
                "devices": list(self.devices), "split_dim": self.split_dim, "parts": self.parts,
                "index": self.index, "persistent": self.persistent, "replicas": list(self.replicas),
                "blocks": self.blocks if isinstance(self.blocks, (int, str)) else list(self.blocks),
                "partial_grads": self.partial_grads, "inner_dim": self.inner_dim, "inner_parts": self.inner_parts,
                "inner_blocks": self.inner_blocks if isinstance(self.inner_blocks, (int, str)) else list(self.inner_blocks),
                "partial_devices": list(self.partial_devices)}

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "WeightSpec":
        return cls(d["name"], d["kind"], tuple(d["shape"]), getattr(torch, d["dtype"].replace("torch.", "")),
                   tuple(d["devices"]), d["split_dim"], d["parts"], d["index"], d["persistent"], tuple(d["replicas"]),
                   normalize(d.get("blocks", 1)), d.get("partial_grads", False), d.get("inner_dim"),
                   d.get("inner_parts", 1), normalize(d.get("inner_blocks", 1)), tuple(d.get("partial_devices", ())))

    @property
    def cuts(self) -> List[Tuple[int, Blocks, int, int]]:
        """``(dim, blocks, parts, index)`` of each cut that makes this slice from the full tensor, in
        the order they are made (none for a whole tensor)."""
        if self.split_dim is None:
            return []
        if self.inner_dim is None:
            return [(self.split_dim, self.blocks, self.parts, self.index)]
        outer = self.parts // self.inner_parts
        return [(self.split_dim, self.blocks, outer, self.index // self.inner_parts),
                (self.inner_dim, self.inner_blocks, self.inner_parts, self.index % self.inner_parts)]

    @property
    def local_shape(self) -> Tuple[int, ...]:
        shape = list(self.shape)
        for dim, _, parts, _ in self.cuts:
            shape[dim] //= parts
        return tuple(shape)

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """This spec's slice of the full tensor."""
        if tuple(full.shape) != tuple(self.shape):
            raise ValueError(f"'{self.name}' has shape {tuple(full.shape)}, the parallel module expects "
                             f"{tuple(self.shape)}")
        for dim, blocks, parts, index in self.cuts:
            full = strided.take(full, dim, blocks, parts, index)
        return full

    def join(self, slices: List[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every device's slice, in index order (the inverse of ``take``)."""
        if self.inner_dim is not None:        # each outer part from its inner slices first
            k = self.inner_parts
            slices = [strided.join(slices[i:i + k], self.inner_dim, self.inner_blocks) for i in range(0, len(slices), k)]
        return strided.join(slices, self.split_dim, self.blocks)
