"""What each runtime rank holds and runs: its sections of the graphs and its weights.

A runtime rank plays plan device ``rank % plan_ngpus``. Without a pipeline it runs that device's
share of each graph; with one, the stages its pipeline device holds (two under
``chimera_direct``, where it runs a stage of the opposite pipeline as the device the graph placed
it on). The weights it creates are those its sections read, at their stored (local) shapes, in the
order of the graph's weights: the order of ``module.parameters()`` at run time. This mirrors what
code generation writes into each ``gencode{rank}.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from nbscaler.comm.layout import Layout
from nbscaler.comm.stages import stage_carries
from nbscaler.ir.graph import IRGraph, IRTensor
from nbscaler.layouts import LayoutKind
from nbscaler.schedule import PipelineGeometry


@dataclass(frozen=True)
class Section:
    """One method of a rank's module: a whole forward, or one pipeline stage, as plan ``device``."""

    mode: str
    graph: IRGraph
    device: int
    stage: Optional[int] = None


@dataclass(frozen=True)
class LocalWeight:
    """A parameter or buffer as a rank stores it."""

    name: str
    kind: str                     # 'param' | 'buffer' | 'constant'
    shape: Tuple[int, ...]        # local shape
    dtype: torch.dtype
    trained: bool                 # read by the training graph on this rank (gets a gradient in backward)
    partial_over: int = 1         # devices whose partial gradients the reducer sums (storage ``R*``)
    stages: Tuple[int, ...] = ()  # the pipeline stages whose training backward gives it a gradient

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize


def train_graph(graphs: Dict[str, IRGraph]) -> IRGraph:
    """The graph a training step runs."""
    return graphs["train"] if "train" in graphs else graphs["any"]


def sections(graphs: Dict[str, IRGraph], device: int, geometry: Optional[PipelineGeometry]) -> List[Section]:
    """The sections plan ``device`` runs, for every mode."""
    if geometry is None:
        return [Section(mode, g, device) for mode, g in graphs.items()]
    out = []
    for s in geometry.schedule.stages_of(geometry.pipeline_device(device)):
        group = geometry.stage_group(s)
        view = device if device in group else group[device % geometry.tp]
        out += [Section(mode, g, view, s) for mode, g in graphs.items()]
    return out


def local_weights(graphs: Dict[str, IRGraph], storage: Dict[str, Layout], device: int,
                  geometry: Optional[PipelineGeometry]) -> List[LocalWeight]:
    """The weights plan ``device`` stores, in the order the runtime registers them."""
    readers: Dict[str, int] = {}          # name -> devices of its first reader
    trained: Dict[str, set] = {}          # name -> pipeline stages (None without one) that train it
    train = train_graph(graphs)
    for sec in sections(graphs, device, geometry):
        for n in sec.graph.nodes:
            if (sec.stage is None or n.stage == sec.stage) and sec.device in n.placement.devices:
                for t in n.inputs:
                    if t.is_weight:
                        readers.setdefault(t.name, len(n.placement.devices))
                        if sec.graph is train:
                            trained.setdefault(t.name, set()).add(sec.stage)
    out = []
    for name, t in next(iter(graphs.values())).weights.items():
        if name not in readers:
            continue
        shape = list(t.shape)
        lay = storage.get(name, Layout.replicated())
        if lay.kind == LayoutKind.SPLIT:
            shape[lay.dim] //= readers[name]
        partial = readers[name] if lay.kind == LayoutKind.SUM_GRAD else 1
        stages = tuple(sorted(s for s in trained.get(name, ()) if s is not None))
        out.append(LocalWeight(name, t.kind, tuple(shape), t.dtype, name in trained, partial, stages))
    return out


def stage_io(graph: IRGraph, geometry: Optional[PipelineGeometry], stage: Optional[int]
             ) -> Tuple[List[IRTensor], Optional[List[IRTensor]]]:
    """What a stage receives and sends on (``((), None)`` without a pipeline)."""
    if geometry is None or stage is None:
        return [], None
    nstages = geometry.schedule.nstages
    carries = stage_carries(graph, nstages)
    return (carries[stage - 1] if stage else []), (carries[stage] if stage < nstages - 1 else None)
