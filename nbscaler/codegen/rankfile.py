"""Assemble ``gencode{rank}.py``: the module class of one rank, its weight table and its methods.

A rank's file holds one ``ParallelModule`` subclass with:

- ``weight_specs``: which slice of which original parameter or buffer each local one holds;
- ``device_groups``: every device set a collective runs over (the same list on every rank, since
  process groups are created collectively);
- ``_forward`` (or ``_forward_train`` / ``_forward_eval`` when the module branches on
  ``self.training``), or for a pipeline one ``_stage{s}`` method per stage the rank holds, plus
  ``stage_carry``: what crosses each stage boundary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from torch.utils._pytree import keystr

from nbscaler.codegen.emitter import ForwardEmitter, runs_on
from nbscaler.codegen.render import CodegenError, attr_name, user_op_alias
from nbscaler.comm.layout import Layout
from nbscaler.comm.stages import stage_carries
from nbscaler.ir.graph import RECOMPUTE_REGION, IRGraph, IRNode, IRTensor
from nbscaler.ir.layer_rules import vocab_parallel
from nbscaler.ir.registry import USER_OPS
from nbscaler.layouts import LayoutKind
from nbscaler.schedule.geometry import PipelineGeometry
from nbscaler.trace.guards import GUARD_OP


def _unpack_inputs(graph: IRGraph) -> List[str]:
    lines = []
    for t in graph.inputs:
        path = t.path
        arg = path[0].key if hasattr(path[0], "key") else str(path[0])
        rest = keystr(path[1:])
        expr = f"{arg}{rest}"
        if expr != t.name:
            lines.append(f"{t.name} = {expr}")
    return lines


def _signature(params: List[Tuple[str, str, bool]]) -> str:
    """Forward's parameters; those the trace did not receive default to ``None``. A received one
    after such a default (``labels`` after ``position_ids=None``) becomes keyword-only."""
    parts = ["self"]
    defaulted = keyword_only = False
    for name, kind, given in params:
        if kind == "VAR_POSITIONAL":
            parts.append(f"*{name}")
            keyword_only = True
        elif kind == "VAR_KEYWORD":
            parts.append(f"**{name}")
        else:
            if given and defaulted and not keyword_only and kind != "KEYWORD_ONLY":
                parts.append("*")
                keyword_only = True
            keyword_only = keyword_only or kind == "KEYWORD_ONLY"
            parts.append(name if given else f"{name}=None")
            defaulted = defaulted or not given
    return ", ".join(parts)


@dataclass
class Section:
    """One generated method: a whole forward, or one stage of it, as seen by one plan device."""

    name: str
    graph: IRGraph
    device: int
    stage: Optional[int] = None
    carry_in: Sequence[IRTensor] = ()
    carry_out: Optional[Sequence[IRTensor]] = None

    def nodes(self) -> List[IRNode]:
        """The nodes this method runs, in graph order."""
        return [n for n in self.graph.nodes if runs_on(n, self.device, self.stage)]


def sections_of(graphs: Dict[str, IRGraph], device: int, geometry: Optional[PipelineGeometry]) -> List[Section]:
    """The methods plan ``device`` needs: ``_forward[_mode]``, or ``_stage{s}[_mode]`` per stage it holds.

    Under ``chimera_direct`` a device also holds a stage of the pipeline running the other way; it
    runs that stage's code as the device that holds it in the graph.
    """
    suffix = lambda mode: "" if mode == "any" else f"_{mode}"
    if geometry is None:
        return [Section(f"_forward{suffix(mode)}", g, device) for mode, g in graphs.items()]
    out = []
    nstages = geometry.schedule.nstages
    for s in geometry.schedule.stages_of(geometry.pipeline_device(device)):
        group = geometry.stage_group(s)
        view = device if device in group else group[device % geometry.tp]
        for mode, g in graphs.items():
            carries = stage_carries(g, nstages)
            out.append(Section(f"_stage{s}{suffix(mode)}", g, view, s, carries[s - 1] if s else (),
                               carries[s] if s < nstages - 1 else None))
    return out


def generate(graphs: Dict[str, IRGraph], storage: Dict[str, Layout], *, rank: int, plan_ngpus: int,
             runtime_ngpus: int, module_name: str, policy_name: str,
             geometry: Optional[PipelineGeometry] = None,
             line_map: Optional[Dict[str, Dict[str, List[int]]]] = None) -> str:
    """The source of ``gencode{rank}.py`` for one runtime rank.

    ``graphs`` maps a mode ('train', 'eval') to its placed graph; one graph under the key 'any'
    means the forward does not depend on ``self.training``. ``geometry`` is set for pipelines.
    ``line_map``, when given, is filled with ``mode -> node name -> line numbers`` (1-based): the
    lines each node's call and the collectives for its inputs take up in the returned text.
    """
    device = rank % plan_ngpus
    sections = sections_of(graphs, device, geometry)
    out: List[str] = []
    w = out.append
    w(f'"""nbscaler generated code for rank {rank}: plan device {device} of {plan_ngpus}, '
      f'unit {rank // plan_ngpus} of {runtime_ngpus // plan_ngpus}.')
    w("")
    w(f"Module: {module_name}    policy: {policy_name}")
    if geometry is not None:
        stages = geometry.schedule.stages_of(geometry.pipeline_device(device))
        w(f"Pipeline: '{geometry.schedule.name}', {geometry.schedule.nstages} stages; this rank runs stage(s) "
          f"{', '.join(map(str, stages))}.")
    w("Each comm.* call changes how a tensor is laid out over the devices of a group; see")
    w("nbscaler.runtime.collectives for what each one does forward and backward.")
    w('"""')
    w("")
    w("import torch")
    w("import torch.nn.functional as F")
    w("")
    w("from nbscaler.runtime import collectives as comm")
    w("from nbscaler.runtime.module import ParallelModule, WeightSpec")
    if any(RECOMPUTE_REGION in n.meta for g in graphs.values() for n in g.nodes):
        w("from torch.utils.checkpoint import checkpoint")
    if any(n.op == GUARD_OP for g in graphs.values() for n in g.nodes):
        w("from nbscaler.runtime.guards import expect_traced")
    if any(vocab_parallel(n) for g in graphs.values() for n in g.nodes):
        w("from nbscaler.runtime.vocab import vocab_embedding")
    user_targets = sorted({n.target for g in graphs.values() for n in g.nodes if n.target in USER_OPS})
    for target in user_targets:
        fn = USER_OPS[target]
        if fn.__module__ == "__main__":
            raise CodegenError(f"the registered op {fn.__qualname__} is defined in __main__; move it to an "
                               "importable .py module so that generated code can import it.")
        w(f"from {fn.__module__} import {fn.__qualname__.split('.')[0]} as {user_op_alias(target)}")
    w("")
    w("")
    w("class GenModule(ParallelModule):")
    w(f"    rank = {rank}")
    w(f"    plan_device = {device}")
    specs = _weight_specs(graphs, storage, sections, geometry)
    # Identical on every rank: process groups are created collectively, in this order.
    groups = {n.placement.devices for g in graphs.values() for n in g.nodes if len(n.placement.devices) > 1}
    groups |= set(_replica_groups(geometry)) | set(_tied_groups(graphs, geometry))
    w(f"    device_groups = {sorted(groups, key=lambda d: (len(d), d))!r}")
    if geometry is not None:
        w(f"    stage_carry = {_carry_table(graphs, geometry.schedule.nstages)!r}")
    w("")
    w("    # local parameter/buffer -> the slice of the original module's tensor it holds")
    w(f"    # {_dtypes_held(graphs, specs)}")
    w("    weight_specs = {")
    for attr, spec in specs.items():
        w(f"        {attr!r}: WeightSpec({spec}),")
    w("    }")
    w("    # every parameter of the original module in its order, which indexes optimizer checkpoints")
    w("    original_params = (")
    for name, t in next(iter(graphs.values())).weights.items():
        if t.kind == "param":
            w(f"        {name!r},")
    w("    )")
    params = next(iter(graphs.values())).meta["forward_params"]
    for sec in sections:
        emitter = ForwardEmitter(sec.graph, sec.device, storage)
        body = emitter.emit(sec.stage, sec.carry_in, sec.carry_out)
        w("")
        signature = _signature(params)
        if sec.stage is not None:
            signature = signature.replace("self", "self, carry", 1)
        w(f"    def {sec.name}({signature}):")
        for devices, var in sorted(emitter.groups.items()):
            w(f"        {var} = self.group({', '.join(map(str, devices))})")
        body_start = len(out) + len(_unpack_inputs(sec.graph))
        for line in _unpack_inputs(sec.graph) + body:
            w(f"        {line}" if line else "")
        if line_map is not None:
            mode = next(m for m, g in graphs.items() if g is sec.graph)
            lines = line_map.setdefault(mode, {})
            for name, (first, end) in emitter.spans.items():
                lines.setdefault(name, []).extend(range(body_start + first + 1, body_start + end + 1))
    w("")
    return "\n".join(out)


def _dtypes_held(graphs: Dict[str, IRGraph], specs: Dict[str, str]) -> str:
    """What the weight table holds in which dtype, and where the optimizer's dtype is decided."""
    held: Dict[str, set] = {}
    for name, t in next(iter(graphs.values())).weights.items():
        if attr_name(name) in specs:
            held.setdefault(t.kind, set()).add(str(t.dtype).replace("torch.", ""))
    listed = ", ".join(f"{kind}s in {'/'.join(sorted(dtypes))}" for kind, dtypes in sorted(held.items()))
    return (f"held as compiled ({listed or 'no weights'}); the optimizer's master copies and state are in "
            "build_optimizer's master_dtype")


def _carry_table(graphs: Dict[str, IRGraph], nstages: int) -> Dict[str, Dict[int, List[Tuple]]]:
    """Per mode and boundary: (name, full shape, dtype) of each tensor crossing it, for receivers."""
    return {mode: {s: [(t.name, tuple(t.shape), str(t.dtype).replace("torch.", "")) for t in carry]
                   for s, carry in enumerate(stage_carries(g, nstages))}
            for mode, g in graphs.items()}


def _weight_specs(graphs: Dict[str, IRGraph], storage: Dict[str, Layout], sections: List[Section],
                  geometry: Optional[PipelineGeometry]) -> Dict[str, str]:
    """The WeightSpec arguments of every weight the sections read, in the graph's weight order."""
    readers: Dict[str, Tuple[IRNode, int, Optional[int]]] = {}
    for sec in sections:
        for n in sec.nodes():
            for t in n.inputs:
                if t.is_weight:
                    readers.setdefault(t.name, (n, sec.device, sec.stage))
    any_graph = next(iter(graphs.values()))
    non_persistent = set(any_graph.meta.get("non_persistent", ()))
    specs = {}
    for name, t in any_graph.weights.items():
        if name not in readers:
            continue
        node, view, stage = readers[name]
        lay = storage.get(name, Layout.replicated())
        devices = node.placement.devices
        text = f"{name!r}, {t.kind!r}, {tuple(t.shape)!r}, {t.dtype}, devices={devices!r}"
        if lay.kind == LayoutKind.SPLIT:
            text += f", split_dim={lay.dim}, parts={len(devices)}, index={devices.index(view)}"
            text += f", blocks={lay.blocks}" if lay.blocks != 1 else ""
        if lay.kind == LayoutKind.SUM_GRAD:
            text += ", partial_grads=True"
        if geometry is not None and stage is not None:
            replicas = _copies_of(name, graphs, geometry, stage, devices.index(view))
            if replicas:
                text += f", replicas={replicas!r}"
        if name in non_persistent:
            text += ", persistent=False"
        specs[attr_name(name)] = text
    return specs


def tied_stages(graphs: Dict[str, IRGraph]) -> Dict[str, Tuple[int, ...]]:
    """Parameters read in more than one pipeline stage (tied embeddings): name -> those stages.

    Each such stage keeps a copy; the copies' gradients are summed between the stages (as
    Megatron does for a tied input embedding and output head), so they stay equal, and a merged
    checkpoint holds the tensor once."""
    stages: Dict[str, set] = {}
    for g in graphs.values():
        for n in g.nodes:
            for t in n.inputs:
                if t.kind == "param" and n.stage is not None:
                    stages.setdefault(t.name, set()).add(n.stage)
    return {name: tuple(sorted(s)) for name, s in stages.items() if len(s) > 1}


def _copies_of(name: str, graphs: Dict[str, IRGraph], geometry: PipelineGeometry, stage: int,
               position: int) -> Tuple[int, ...]:
    """The plan devices whose copies of weight ``name`` (at ``position`` in their stage group) hold
    gradients to sum with this one: copies of the stage (chimera) and of the other stages that
    read a tied weight. Empty when there is no other copy."""
    devices = set()
    for s in tied_stages(graphs).get(name, (stage,)):
        devices |= set(_replica_groups(geometry, s).get(position, (geometry.stage_group(s)[position],)))
    return tuple(sorted(devices)) if len(devices) > 1 else ()


def _tied_groups(graphs: Dict[str, IRGraph], geometry: Optional[PipelineGeometry]) -> List[Tuple[int, ...]]:
    """Every device set whose tied-weight copies sum their gradients (process groups to create)."""
    if geometry is None:
        return []
    found = set()
    for name, stages in tied_stages(graphs).items():
        for position in range(len(geometry.stage_group(stages[0]))):
            copies = _copies_of(name, graphs, geometry, stages[0], position)
            if copies:
                found.add(copies)
    return sorted(found)


def _replica_groups(geometry: Optional[PipelineGeometry], stage: Optional[int] = None):
    """Devices holding copies of the same stage slice (``chimera_direct``): their gradients add up.

    For one ``stage``: ``{position in the stage group: devices}``; without: every such device set.
    """
    if geometry is None:
        return {} if stage is not None else []
    stages = [stage] if stage is not None else range(geometry.schedule.nstages)
    found = {}
    for s in stages:
        holders = sorted({geometry.group_of(p[s]) for p in geometry.schedule.placements})
        if len(holders) > 1:
            for position in range(len(holders[0])):
                found[(s, position)] = tuple(sorted(h[position] for h in holders))
    if stage is not None:
        return {position: devices for (_, position), devices in found.items()}
    return sorted(set(found.values()))
