"""Emit the body of one forward (or pipeline stage) for one plan device.

The body is straight-line torch code: the user's calls with local shapes, and a ``comm.*`` call
wherever a tensor must change layout between the op that made it and the op that reads it.
Comments point back at the user's module and source line, so the code doubles as an explanation
of what the policy did::

    # blocks.0.attn.q: q = self.q(x)                      (model.py:42)
    norm_0_rep = comm.sum_grad(norm_0, group=g01)
    linear_1 = F.linear(norm_0_rep, self.blocks_0_attn_q_weight)
"""

from __future__ import annotations

import linecache
from typing import Any, Dict, List, Optional, Sequence, Tuple

from nbscaler.codegen.render import (INPLACE_OPERATORS, CodegenError, Code, source_comment, attr_name, group_var,
                                     render, render_call)
from nbscaler.comm.layout import (Layout, conversion, input_requirement, local_call, local_shape,
                                  output_layout)
from nbscaler.ir.graph import IRGraph, IRNode, IRTensor, recompute_runs, requires_grad_of
from nbscaler.ir.layer_rules import sync_batch_norm, vocab_parallel
from nbscaler.ir.registry import spec_of
from nbscaler.layouts import LayoutKind
from nbscaler.trace.guards import GUARD_OP, describe_site, guard_expression


def runs_on(node: IRNode, device: int, stage: Optional[int] = None) -> bool:
    """Whether plan ``device`` runs ``node`` in the forward (``stage=None``) or in pipeline ``stage``."""
    return (stage is None or node.stage == stage) and device in node.placement.devices


class ForwardEmitter:
    """Emits the forward body of one graph for one plan device."""

    def __init__(self, graph: IRGraph, device: int, storage: Dict[str, Layout]):
        self.graph, self.device, self.storage = graph, device, storage
        self.lines: List[str] = []
        self.vars: Dict[int, Dict[Layout, str]] = {}
        self.have: Dict[int, Layout] = {}
        self.grad = requires_grad_of(graph)
        self.groups: Dict[Tuple[int, ...], str] = {}
        # node name -> (first, end) indexes into ``lines``: its call and the collectives its inputs needed
        self.spans: Dict[str, Tuple[int, int]] = {}
        self.last_comment: Optional[str] = None     # the source comment last written

    # -- values ---------------------------------------------------------------------------------
    def bind(self, t: IRTensor, layout: Layout, expr: str) -> None:
        self.have[id(t)] = layout
        self.vars.setdefault(id(t), {})[layout] = expr

    def fetch(self, t: IRTensor, want: Layout, devices: Tuple[int, ...]) -> str:
        """The variable holding ``t`` in layout ``want``, emitting the collectives on first use."""
        if id(t) not in self.have:
            raise CodegenError(f"{t.name} is used before it is computed on device {self.device}")
        if want.kind == LayoutKind.SUM_GRAD and not self.grad.get(id(t), False):
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
            dims += f", blocks={step.blocks}" if step.blocks != 1 else ""
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
        ran = [n for n in nodes if runs_on(n, self.device, stage)]
        finals = carry_out if carry_out is not None else self.graph.output_tensors()
        done = 0
        for region, run in recompute_runs(ran):
            done += len(run)
            if region is None:
                self.emit_nodes(run)
            else:
                self.emit_region(region, run, ran[done:], finals)
        group = tuple(sorted({d for n in nodes for d in n.placement.devices}))
        if carry_out is not None:
            items = ", ".join(f"{t.name!r}: {self.fetch(t, Layout.replicated(), group)}" for t in carry_out)
            self.lines.append(f"return {{{items}}}")
        else:
            self.lines.append(f"return {self._render_outputs(self.graph.outputs, group)}")
        return self.lines

    def emit_nodes(self, nodes: Sequence[IRNode]) -> None:
        """Nodes one after the other, each under a comment naming its module and source line."""
        for node in nodes:
            comment = source_comment(node)
            if comment != self.last_comment:
                self.lines.append(comment)
                self.last_comment = comment
            first = len(self.lines)
            self.emit_node(node)
            self.spans[node.name] = (first, len(self.lines))

    def emit_region(self, region: str, nodes: Sequence[IRNode], later: Sequence[IRNode],
                    finals: Sequence[IRTensor]) -> None:
        """A recomputed region: one local function of the tensors it reads, run through checkpoint.

        Its inputs are fetched (converted to the layouts its ops need) before the function, so the
        collectives inside it are those between its own ops: the backward runs them again, in the
        same order on every rank of their group, when it recomputes the region. Variables made
        inside are out of scope after it, except those it returns (what later code reads)."""
        made = {id(t) for n in nodes for t in n.output_tensors}
        params: List[str] = []
        for n in nodes:
            for i, t in enumerate(n.inputs):
                if id(t) not in made:
                    expr = self.fetch(t, input_requirement(n, i), n.placement.devices)
                    if not expr.startswith("self.") and expr not in params:
                        params.append(expr)
        needed = {id(t) for n in later for t in n.inputs} | {id(t) for t in finals}
        outs = [t.name for n in nodes for t in n.output_tensors if id(t) in needed]
        fn = f"recompute_{attr_name(region)}"
        module = region.split("#")[0]
        kind = self.graph.meta.get("module_classes", {}).get(module)
        self.lines.append(f"# {module}{f' ({kind})' if kind else ''} is recomputed in the backward: "
                          "the forward keeps only its inputs")
        self.lines.append(f"def {fn}({', '.join(params)}):")
        body = len(self.lines)
        self.last_comment = None
        self.emit_nodes(nodes)
        self.last_comment = None
        self.lines[body:] = ["    " + line for line in self.lines[body:]]
        returned = ", ".join(outs) or "None"
        self.lines.append(f"    return {returned}")
        call = f"checkpoint({', '.join([fn] + params)}, use_reentrant=False)"
        self.lines.append(f"{returned} = {call}" if outs else call)
        for n in nodes:
            for t in n.output_tensors:
                if t.name in outs:
                    self.vars[id(t)] = {self.have[id(t)]: t.name}
                else:
                    self.vars.pop(id(t), None)
                    self.have.pop(id(t), None)

    def emit_node(self, node: IRNode) -> None:
        place = node.placement
        inputs = node.inputs
        # by position: one tensor may be passed twice with different requirements
        per_position = [self.fetch(t, input_requirement(node, i), place.devices) for i, t in enumerate(inputs)]
        if node.op == GUARD_OP:
            self.emit_guard(node, per_position)
            return
        it = iter(per_position)
        args, kwargs = node.map_args(lambda t: Code(next(it)))
        args, kwargs = local_call(node, args, kwargs)
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
        elif name in INPLACE_OPERATORS and not kwargs and len(args) == 2:
            self.lines.append(f"{render(args[0])} {INPLACE_OPERATORS[name]} {render(args[1])}")
            self.lines.append(f"{lhs} = {render(args[0])}")
        elif vocab_parallel(node):      # this device's rows of the table: a masked lookup
            rows = node.inputs[1].shape[0] // place.parts
            start = place.devices.index(self.device) * rows
            self.lines.append(f"{lhs} = vocab_embedding({render(args[0])}, {render(args[1])}, {start})")
        elif sync_batch_norm(node):     # statistics over the whole batch, not this device's share
            call = render_call(node, args, kwargs)
            self.lines.append(f"{lhs} = comm.{call[len('F.'):-1]}, group={self.group(place.devices)})")
        else:
            self.lines.append(f"{lhs} = {render_call(node, args, kwargs)}")
        for t, lay in zip(outs, layouts):
            self.bind(t, lay, t.name)

    def emit_guard(self, node: IRNode, tensors: List[str]) -> None:
        """``expect_traced(bool(all_0), True, ...)``: the value the trace specialised on, checked."""
        expression = guard_expression(node, tuple(tensors))
        where = describe_site(node.module_path, node.source)
        code = linecache.getline(*node.source).split("  #", 1)[0].strip() if node.source else ""
        where += f": `{code}`" if code else ""
        self.lines.append(f"expect_traced({expression}, {render(node.outputs)}, {expression!r}, {where!r})")

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
                           f"({source_comment(node)[2:]})")

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
