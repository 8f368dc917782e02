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

from typing import Dict, List, Optional, Set, Tuple

import torch
from torch.utils._pytree import keystr

from nbscaler.codegen.emitter import SectionPrinter
from nbscaler.codegen.render import CodegenError, attr_name, group_var, is_library_op, user_op_alias
from nbscaler.codegen.context import context_imports
from nbscaler.codegen.experts import experts_imports
from nbscaler.ir.expert_rules import expert_parallel
from nbscaler.codegen.float8 import check_float8, float8_imports
from nbscaler.codegen.vocab import vocab_imports
from nbscaler.comm.program import LocalWeight, RankProgram, Section
from nbscaler.comm.stages import stage_carries
from nbscaler.ir.graph import RECOMPUTE_REGION, IRGraph
from nbscaler.ir.registry import USER_OPS
from nbscaler.layouts import LayoutKind
from nbscaler.recipe import Recipe
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


def generate(program: RankProgram, graphs: Dict[str, IRGraph], *, rank: int, plan_ngpus: int,
             runtime_ngpus: int, module_name: str, policy_name: str,
             geometry: Optional[PipelineGeometry] = None,
             line_map: Optional[Dict[str, Dict[str, List[int]]]] = None, recipe: Optional[Recipe] = None) -> str:
    """The source of ``gencode{rank}.py`` for one runtime rank: its lowered ``program`` printed as a
    header (docstring and imports), the class with its weight table, and one method per section.

    ``graphs`` maps a mode ('train', 'eval') to its placed graph; one graph under the key 'any'
    means the forward does not depend on ``self.training``. ``geometry`` is set for pipelines.
    ``line_map``, when given, is filled with ``mode -> node name -> line numbers`` (1-based): the
    lines each node's call and the collectives for its inputs take up in the returned text.
    ``recipe``, the run's training recipe where it is known, is stated beside the weight table.
    """
    check_float8(graphs, recipe)
    out = header(program, graphs, rank=rank, plan_ngpus=plan_ngpus, runtime_ngpus=runtime_ngpus,
                 module_name=module_name, policy_name=policy_name, geometry=geometry, recipe=recipe)
    out += class_table(program, graphs, rank, geometry, recipe)
    out += methods(program, graphs, len(out), line_map, recipe)
    out.append("")
    return "\n".join(out)


def header(program: RankProgram, graphs: Dict[str, IRGraph], *, rank: int, plan_ngpus: int, runtime_ngpus: int,
           module_name: str, policy_name: str, geometry: Optional[PipelineGeometry],
           recipe: Optional[Recipe] = None) -> List[str]:
    """The file's docstring (who runs it, under which plan) and its imports."""
    device = program.device
    out: List[str] = []
    w = out.append
    w(f'"""nbscaler generated code for rank {rank}: plan device {device} of {plan_ngpus}, '
      f'unit {rank // plan_ngpus} of {runtime_ngpus // plan_ngpus}.')
    w("")
    w(f"Module: {module_name}    policy: {policy_name}")
    if geometry is not None:
        stages = geometry.stages_of(device)
        w(f"Pipeline: '{geometry.schedule.name}', {geometry.schedule.nstages} stages; this rank runs stage(s) "
          f"{', '.join(map(str, stages))}.")
        if geometry.schedule.splits_backward:
            w("Its backward runs in two blocks: B, the gradient of each stage's input (the previous stage")
            w("waits for it), then W, the weights' gradients, later; 'backward B', 'W' or 'B+W' beside an")
            w("op says which block computes its gradient (an op with both gives each its part).")
    w("Each comm.* call changes how a tensor is laid out over the devices of a group; see")
    w("nbscaler.runtime.collectives for what each one does forward and backward.")
    if recipe is not None and recipe.float8 is not None:
        w(f"float8_linear is F.linear with its products in fp8 ({recipe.float8.value} scaling); an m/k/n_group")
        w("names the group that splits the product's rows, inner or output dimension, over which its scales")
        w("are taken so that they equal one process's (nbscaler.runtime.float8).")
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
    for imports in (vocab_imports(graphs), context_imports(graphs), experts_imports(graphs), float8_imports(recipe)):
        if imports:
            w(imports)
    for target in sorted({n.target for g in graphs.values() for n in g.nodes if is_library_op(n.target)}):
        module, _, name = target.rpartition(".")
        w(f"from {module} import {name}")
    user_targets = sorted({n.target for g in graphs.values() for n in g.nodes
                           if n.target in USER_OPS and not expert_parallel(n)})
    for target in user_targets:
        fn = USER_OPS[target]
        if fn.__module__ == "__main__":
            raise CodegenError(f"the registered op {fn.__qualname__} is defined in __main__; move it to an "
                               "importable .py module so that generated code can import it.")
        w(f"from {fn.__module__} import {fn.__qualname__.split('.')[0]} as {user_op_alias(target)}")
    w("")
    w("")
    return out


def class_table(program: RankProgram, graphs: Dict[str, IRGraph], rank: int,
                geometry: Optional[PipelineGeometry], recipe: Optional[Recipe] = None) -> List[str]:
    """The class line and its tables: process groups, stage carries, the weight table (from the
    program's) and the original parameters' order."""
    out: List[str] = []
    w = out.append
    w("class GenModule(ParallelModule):")
    w(f"    rank = {rank}")
    w(f"    plan_device = {program.device}")
    specs = {attr_name(wt.name): _weight_spec(wt) for wt in program.weights}
    # Identical on every rank: process groups are created collectively, in this order.
    w(f"    device_groups = {program.device_groups!r}")
    if geometry is not None:
        w(f"    stage_carry = {_carry_table(graphs, geometry.schedule.nstages)!r}")
    w("")
    w("    # local parameter/buffer -> the slice of the original module's tensor it holds")
    w(f"    # {_dtypes_held(graphs, specs)}")
    if recipe is not None:
        w(f"    # recipe: {recipe.describe(_param_dtype(graphs))}")
    w("    weight_specs = {")
    for attr, spec in specs.items():
        w(f"        {attr!r}: WeightSpec({spec}),")
    w("    }")
    if program.units:
        w("    # ZeRO-3: each unit's parameters, gathered together before the unit runs; each rank stores 1/N of them")
        w("    shard_units = {")
        for unit, names in program.units.items():
            w(f"        {unit!r}: {tuple(attr_name(n) for n in names)!r},")
        w("    }")
    w("    # every parameter of the original module in its order, which indexes optimizer checkpoints")
    w("    original_params = (")
    for name, t in next(iter(graphs.values())).weights.items():
        if t.kind == "param":
            w(f"        {name!r},")
    w("    )")
    return out


def methods(program: RankProgram, graphs: Dict[str, IRGraph], offset: int,
            line_map: Optional[Dict[str, Dict[str, List[int]]]], recipe: Optional[Recipe] = None) -> List[str]:
    """One method per section of the program; ``offset`` is the number of lines before them (for
    ``line_map``, filled as ``generate`` says). ``recipe``: where it takes products in fp8, its
    linear layers call ``float8_linear``."""
    out: List[str] = []
    w = out.append
    params = next(iter(graphs.values())).meta["forward_params"]
    for sec in program.sections:
        printer = SectionPrinter(sec, recipe)
        body = printer.print()
        w("")
        signature = _signature(params)
        if sec.stage is not None:
            signature = signature.replace("self", "self, carry", 1)
        w(f"    def {sec.name}({signature}):")
        for devices in sorted(set(sec.groups) | _float8_groups(sec, printer.float8_nodes)):
            w(f"        {group_var(devices)} = self.group({', '.join(map(str, devices))})")
        body_start = offset + len(out) + len(_unpack_inputs(sec.graph))
        for line in _unpack_inputs(sec.graph) + body:
            w(f"        {line}" if line else "")
        if line_map is not None:
            lines = line_map.setdefault(sec.mode, {})
            for name, (first, end) in printer.spans.items():
                lines.setdefault(name, []).extend(range(body_start + first + 1, body_start + end + 1))
    return out


def _float8_groups(sec: Section, names: Set[str]) -> Set[Tuple[int, ...]]:
    """The device sets of the split fp8 linear layers of ``sec``: their scales' groups."""
    return {n.placement.devices for n in sec.nodes() if n.name in names and n.placement.split is not None}


def _dtypes_held(graphs: Dict[str, IRGraph], specs: Dict[str, str]) -> str:
    """What the weight table holds in which dtype, and where the optimizer's dtype is decided."""
    held: Dict[str, set] = {}
    for name, t in next(iter(graphs.values())).weights.items():
        if attr_name(name) in specs:
            held.setdefault(t.kind, set()).add(str(t.dtype).replace("torch.", ""))
    listed = ", ".join(f"{kind}s in {'/'.join(sorted(dtypes))}" for kind, dtypes in sorted(held.items()))
    return (f"held as compiled ({listed or 'no weights'}); the optimizer's master copies and state are in "
            "build_optimizer's master_dtype")


def _param_dtype(graphs: Dict[str, IRGraph]) -> Optional[torch.dtype]:
    """The dtype the parameters are held in, where they share one."""
    held = {t.dtype for t in next(iter(graphs.values())).weights.values() if t.kind == "param"}
    return held.pop() if len(held) == 1 else None


def _carry_table(graphs: Dict[str, IRGraph], nstages: int) -> Dict[str, Dict[int, List[Tuple]]]:
    """Per mode and boundary: (name, full shape, dtype) of each tensor crossing it, for receivers."""
    return {mode: {s: [(t.name, tuple(t.shape), str(t.dtype).replace("torch.", "")) for t in carry]
                   for s, carry in enumerate(stage_carries(g, nstages))}
            for mode, g in graphs.items()}


def _weight_spec(wt: LocalWeight) -> str:
    """The ``WeightSpec`` arguments of one row of the weight table."""
    text = f"{wt.name!r}, {wt.kind!r}, {wt.full_shape!r}, {wt.dtype}, devices={wt.devices!r}"
    lay = wt.layout
    if lay.kind == LayoutKind.SPLIT:
        text += f", split_dim={lay.dim}, parts={len(wt.devices)}, index={wt.index}"
        text += f", blocks={wt.blocks}" if wt.blocks != 1 else ""
        if lay.inner is not None:     # cut again inside each part: experts by hidden unit
            cut = lay.inner
            text += f", inner_dim={cut.dim}, inner_parts={cut.parts}"
            text += f", inner_blocks={cut.blocks}" if cut.blocks != 1 else ""
    elif lay.inner is not None and lay.inner.kind == LayoutKind.SPLIT:
        # whole across the groups of a grid, split inside each: device i holds slice i % parts, as do
        # its counterparts in the other groups, whose partial gradients are summed with its own
        cut = lay.inner
        text += f", split_dim={cut.dim}, parts={cut.parts}, index={wt.index % cut.parts}"
        text += f", blocks={cut.blocks}" if cut.blocks != 1 else ""
    if lay.kind == LayoutKind.SUM_GRAD:
        text += ", partial_grads=True"
        text += f", partial_devices={wt.partial_devices!r}" if wt.partial_devices != wt.devices else ""
    if wt.replicas:
        text += f", replicas={wt.replicas!r}"
    if not wt.persistent:
        text += ", persistent=False"
    return text
