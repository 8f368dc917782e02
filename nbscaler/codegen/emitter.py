"""Write one readable Python file per rank from a placed graph.

The file holds one ``ParallelModule`` subclass. Its ``weight_specs`` table says which slice of which
original parameter each local parameter is, and its forward is straight-line torch code: the user's
calls, with local shapes, and a ``comm.*`` call wherever a tensor must change layout. Comments
point back at the user's module and source line, so the file doubles as an explanation of what the
policy did::

    # blocks.0.attn.q: q = self.q(x)                      (model.py:42)
    norm_0_rep = comm.sum_grad(norm_0, group=g01)
    linear_1 = F.linear(norm_0_rep, self.blocks_0_attn_q_weight)
"""

from __future__ import annotations

import inspect
import linecache
import math
import os
import re
import types
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch.utils._pytree import keystr

from nbscaler.comm.layout import Layout, conversion, input_requirement, output_layout
from nbscaler.comm.stages import stage_carries
from nbscaler.ir.graph import IRGraph, IRNode, IRTensor
from nbscaler.ir.registry import USER_OPS, spec_of
from nbscaler.schedule.geometry import PipelineGeometry


class CodegenError(RuntimeError):
    """A traced call that cannot be written back as Python; names the call and its source."""


_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "true_divide": "/", "__add__": "+",
          "__sub__": "-", "__mul__": "*", "__truediv__": "/", "__matmul__": "@", "__pow__": "**",
          "__mod__": "%", "__floordiv__": "//", "__eq__": "==", "__ne__": "!=", "__lt__": "<",
          "__le__": "<=", "__gt__": ">", "__ge__": ">=", "__and__": "&", "__or__": "|"}
_RINFIX = {"__radd__": "+", "__rsub__": "-", "__rmul__": "*", "__rtruediv__": "/", "__rmatmul__": "@",
           "__rpow__": "**"}
_IINFIX = {"__iadd__": "+=", "__isub__": "-=", "__imul__": "*=", "__itruediv__": "/="}
_UNARY = {"__neg__": "-", "__invert__": "~"}


def attr_name(qualified: str) -> str:
    """'blocks.0.attn.q.weight' -> 'blocks_0_attn_q_weight'."""
    return re.sub(r"\W", "_", qualified)


def group_var(devices: Sequence[int]) -> str:
    return "g" + "_".join(map(str, devices))


def local_shape(shape: Sequence[int], layout: Layout, parts: int) -> Tuple[int, ...]:
    shape = list(shape)
    if layout.kind == "S":
        shape[layout.dim] //= parts
    return tuple(shape)


class _Code(str):
    """Already-rendered source text (a variable name or an expression)."""


def render(value: Any, index: bool = False) -> str:
    """A constant argument as Python source. ``index`` renders slices as ``a:b`` for subscripts."""
    if isinstance(value, _Code):
        return str(value)
    if isinstance(value, slice):
        if index:
            parts = ["" if v is None else render(v) for v in (value.start, value.stop, value.step)]
            return ":".join(parts[:2]) + (f":{parts[2]}" if value.step is not None else "")
        return f"slice({render(value.start)}, {render(value.stop)}, {render(value.step)})"
    if value is Ellipsis:
        return "..."
    if isinstance(value, (torch.dtype, torch.memory_format, torch.layout)):
        return str(value)
    if isinstance(value, torch.device):
        return "self.device"
    if isinstance(value, torch.Size):
        value = tuple(value)
    if isinstance(value, float) and (math.isinf(value) or math.isnan(value)):
        return f"float('{value}')"
    if isinstance(value, tuple):
        inner = ", ".join(render(v, index) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(render(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{render(k)}: {render(v)}" for k, v in value.items()) + "}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    raise CodegenError(f"cannot write the constant {value!r} ({type(value).__name__}) into generated code")


def _is_property(name: str) -> bool:
    return isinstance(getattr(torch.Tensor, name, None), (property, types.GetSetDescriptorType))


def render_call(node: IRNode, args: Tuple, kwargs: Dict[str, Any]) -> str:
    """The call expression for ``node`` over already-rendered arguments."""
    target = node.target
    if target == "Tensor.__getitem__":
        idx = args[1]
        inner = ", ".join(render(i, index=True) for i in idx) if isinstance(idx, tuple) else render(idx, index=True)
        return f"{render(args[0])}[{inner or '()'}]"
    if target.startswith("Tensor."):
        name = target[len("Tensor."):]
        first, rest = render(args[0]), args[1:]
        if not kwargs and len(rest) == 1 and name in _INFIX:
            return f"{first} {_INFIX[name]} {render(rest[0])}"
        if not kwargs and len(rest) == 1 and name in _RINFIX:
            return f"{render(rest[0])} {_RINFIX[name]} {first}"
        if not kwargs and not rest and name in _UNARY:
            return f"{_UNARY[name]}{first}"
        if not rest and not kwargs and _is_property(name):
            return f"{first}.{name}"
        return f"{first}.{name}({_arglist(rest, kwargs)})"
    if target.startswith("torch.nn.functional."):
        fn = "F." + target[len("torch.nn.functional."):]
        kwargs = _without_defaults(target, kwargs)
        while args and args[-1] is None and len(args) > 1:      # trailing optional tensors left out
            args = args[:-1]
    elif target in USER_OPS:
        fn = user_op_alias(target)
    else:
        fn = target
    return f"{fn}({_arglist(args, kwargs)})"


def user_op_alias(target: str) -> str:
    return "_op_" + attr_name(target)


def _without_defaults(target: str, kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """Drop keyword arguments that only repeat the function's defaults (torch passes them all)."""
    fn = getattr(torch.nn.functional, target.rsplit(".", 1)[-1], None) if target.startswith("torch.nn.functional.") else None
    try:
        params = inspect.signature(fn).parameters if fn is not None else {}
    except (TypeError, ValueError):
        params = {}
    return {k: v for k, v in kwargs.items()
            if not (k in params and params[k].default is not inspect.Parameter.empty
                    and type(params[k].default) is type(v) and params[k].default == v)}


def _arglist(args: Sequence, kwargs: Dict[str, Any]) -> str:
    return ", ".join([render(a) for a in args] + [f"{k}={render(v)}" for k, v in kwargs.items()])


def _source_comment(node: IRNode) -> str:
    where = node.module_path or "(top level)"
    if not node.source:
        return f"# {where}"
    path, line = node.source
    code = linecache.getline(path, line).strip()
    return f"# {where}: {code}    ({os.path.basename(path)}:{line})" if code else f"# {where}    ({os.path.basename(path)}:{line})"


def requires_grad_of(graph: IRGraph) -> Dict[int, bool]:
    """Which tensors can carry a gradient: parameters, float inputs, and whatever they feed."""
    grad: Dict[int, bool] = {}
    for t in graph.inputs:
        grad[id(t)] = t.dtype.is_floating_point
    for t in graph.weights.values():
        grad[id(t)] = t.kind == "param" and t.requires_grad
    for node in graph.nodes:
        flows = any(grad.get(id(t), False) for t in node.inputs)
        for t in node.output_tensors:
            grad[id(t)] = flows and t.dtype.is_floating_point
    return grad


class ForwardEmitter:
    """Emits the forward body of one graph for one plan device."""

    def __init__(self, graph: IRGraph, device: int, storage: Dict[str, Layout]):
        self.graph, self.device, self.storage = graph, device, storage
        self.lines: List[str] = []
        self.vars: Dict[int, Dict[Layout, str]] = {}
        self.have: Dict[int, Layout] = {}
        self.grad = requires_grad_of(graph)
        self.groups: Dict[Tuple[int, ...], str] = {}

    # -- values ---------------------------------------------------------------------------------
    def bind(self, t: IRTensor, layout: Layout, expr: str) -> None:
        self.have[id(t)] = layout
        self.vars.setdefault(id(t), {})[layout] = expr

    def fetch(self, t: IRTensor, want: Layout, devices: Tuple[int, ...]) -> str:
        """The variable holding ``t`` in layout ``want``, emitting the collectives on first use."""
        if id(t) not in self.have:
            raise CodegenError(f"{t.name} is used before it is computed on device {self.device}")
        if want.kind == "R*" and not self.grad.get(id(t), False):
            want = Layout.replicated()        # no gradient to sum
        known = self.vars[id(t)]
        if want in known:
            return known[want]
        have = self.have[id(t)]
        expr = known[have]
        group = self.group(devices)
        for step in conversion(have, want):
            dims = "".join(f", dim={d}" for d in (step.dim,) if d is not None)
            dims += f", dim2={step.dim2}" if step.dim2 is not None else ""
            name = f"{attr_name(t.name)}_{want.label}"
            self.lines.append(f"{name} = comm.{step.fn}({expr}{dims}, group={group})")
            expr = name
        known[want] = expr
        return expr

    def group(self, devices: Tuple[int, ...]) -> str:
        if devices not in self.groups:
            self.groups[devices] = group_var(devices)
        return self.groups[devices]

    # -- body -----------------------------------------------------------------------------------
    def emit(self, stage: Optional[int] = None, carry_in: Sequence[IRTensor] = (),
             carry_out: Optional[Sequence[IRTensor]] = None) -> List[str]:
        """The body of a forward (``stage=None``) or of one pipeline stage.

        A stage reads the tensors crossing into it from ``carry`` and returns those crossing out
        of it as a dict (or, for the last stage, the module's outputs).
        """
        for t in self.graph.inputs:
            self.bind(t, Layout.replicated(), t.name)
        for t in self.graph.weights.values():
            attr = f"self.{attr_name(t.name)}"
            self.bind(t, self.storage.get(t.name, Layout.replicated()), attr)
        for t in carry_in:
            self.lines.append(f"{t.name} = carry[{t.name!r}]")
            self.bind(t, Layout.replicated(), t.name)
        nodes = [n for n in self.graph.nodes if stage is None or n.stage == stage]
        last_comment = None
        for node in nodes:
            if self.device not in node.placement.devices:
                continue
            comment = _source_comment(node)
            if comment != last_comment:
                self.lines.append(comment)
                last_comment = comment
            self.emit_node(node)
        group = tuple(sorted({d for n in nodes for d in n.placement.devices}))
        if carry_out is not None:
            items = ", ".join(f"{t.name!r}: {self.fetch(t, Layout.replicated(), group)}" for t in carry_out)
            self.lines.append(f"return {{{items}}}")
        else:
            self.lines.append(f"return {self._render_outputs(self.graph.outputs, group)}")
        return self.lines

    def emit_node(self, node: IRNode) -> None:
        place = node.placement
        inputs = node.inputs
        # by position: one tensor may be passed twice with different requirements
        per_position = [self.fetch(t, input_requirement(node, i), place.devices) for i, t in enumerate(inputs)]
        it = iter(per_position)
        args, kwargs = node.map_args(lambda t: _Code(next(it)))
        spec = spec_of(node.target)
        outs = node.output_tensors
        layouts = [output_layout(node, i) for i in range(len(outs))]
        if spec is not None and spec.shape_args:
            shape = local_shape(outs[0].shape, layouts[0], place.parts)
            args = (args[0], tuple(shape))
            kwargs = {k: v for k, v in kwargs.items() if k not in ("shape", "size")}
        lhs = self._lhs(node)
        name = node.target[len("Tensor."):] if node.target.startswith("Tensor.") else ""
        if name == "__setitem__":
            idx = args[1]
            inner = ", ".join(render(i, index=True) for i in idx) if isinstance(idx, tuple) else render(idx, index=True)
            self.lines.append(f"{render(args[0])}[{inner}] = {render(args[2])}")
            self.lines.append(f"{lhs} = {render(args[0])}")
        elif name in _IINFIX and not kwargs and len(args) == 2:
            self.lines.append(f"{render(args[0])} {_IINFIX[name]} {render(args[1])}")
            self.lines.append(f"{lhs} = {render(args[0])}")
        else:
            self.lines.append(f"{lhs} = {render_call(node, args, kwargs)}")
        for t, lay in zip(outs, layouts):
            self.bind(t, lay, t.name)

    def _lhs(self, node: IRNode) -> str:
        def pattern(v):
            if isinstance(v, IRTensor):
                return v.name
            if isinstance(v, (tuple, list)):
                inner = ", ".join(pattern(x) for x in v)
                return f"({inner},)" if len(v) == 1 else f"({inner})"
            return "_"
        outs = node.outputs
        if isinstance(outs, IRTensor):
            return outs.name
        if isinstance(outs, (tuple, list)) and all(isinstance(v, (IRTensor, tuple, list)) or v is None for v in outs):
            return pattern(tuple(outs))
        raise CodegenError(f"{node.target} returns {type(outs).__name__}, which generated code cannot unpack "
                           f"({_source_comment(node)[2:]})")

    def _render_outputs(self, value: Any, unit: Tuple[int, ...]) -> str:
        if isinstance(value, IRTensor):
            return self.fetch(value, Layout.replicated(), unit)
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            inner = ", ".join(self._render_outputs(v, unit) for v in value)
            return f"{type(value).__module__}.{type(value).__qualname__}({inner})"
        if isinstance(value, (tuple, list)):
            inner = ", ".join(self._render_outputs(v, unit) for v in value)
            if isinstance(value, list):
                return f"[{inner}]"
            return f"({inner},)" if len(value) == 1 else f"({inner})"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{render(k)}: {self._render_outputs(v, unit)}" for k, v in value.items()) + "}"
        return render(value)


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
    parts = ["self"]
    for name, kind, given in params:
        if kind == "VAR_POSITIONAL":
            parts.append(f"*{name}")
        elif kind == "VAR_KEYWORD":
            parts.append(f"**{name}")
        else:
            parts.append(name if given else f"{name}=None")
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
             geometry: Optional[PipelineGeometry] = None) -> str:
    """The source of ``gencode{rank}.py`` for one runtime rank.

    ``graphs`` maps a mode ('train', 'eval') to its placed graph; one graph under the key 'any'
    means the forward does not depend on ``self.training``. ``geometry`` is set for pipelines.
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
    groups |= set(_replica_groups(geometry))
    w(f"    device_groups = {sorted(groups, key=lambda d: (len(d), d))!r}")
    if geometry is not None:
        w(f"    stage_carry = {_carry_table(graphs, geometry.schedule.nstages)!r}")
    w("")
    w("    # local parameter/buffer -> the slice of the original module's tensor it holds")
    w("    weight_specs = {")
    for attr, spec in specs.items():
        w(f"        {attr!r}: WeightSpec({spec}),")
    w("    }")
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
        for line in _unpack_inputs(sec.graph) + body:
            w(f"        {line}" if line else "")
    w("")
    return "\n".join(out)


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
        for n in sec.graph.nodes:
            if (sec.stage is None or n.stage == sec.stage) and sec.device in n.placement.devices:
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
        if lay.kind == "S":
            text += f", split_dim={lay.dim}, parts={len(devices)}, index={devices.index(view)}"
        if geometry is not None and stage is not None:
            replicas = _replica_groups(geometry, stage).get(devices.index(view))
            if replicas:
                text += f", replicas={replicas!r}"
        if name in non_persistent:
            text += ", persistent=False"
        specs[attr_name(name)] = text
    return specs


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
