"""Print the body of one section (a forward, or one pipeline stage) of a rank's program.

The body is straight-line torch code: the user's calls with local shapes, and a ``comm.*`` call
for each collective of a layout conversion (``comm.lower`` decided which, and in what order; this
module only writes them out). Comments point back at the user's module and source line, so the
code doubles as an explanation of what the policy did::

    # blocks.0.attn.q: q = self.q(x)                      (model.py:42)
    norm_0_sum_grad: "f32[4, 8, 64]" = comm.sum_grad(norm_0, group=g0_1)
    linear_1: "f32[4, 8, 32]" = F.linear(norm_0_sum_grad, self.blocks_0_attn_q_weight)

Each assignment carries the local shape and dtype this rank holds, as ``torch.fx`` prints them: for
a split program the local shape is the lesson. A source line gets its comment once; the next
nodes of the same line name only their module.
"""

from __future__ import annotations

import linecache
from typing import Any, Dict, List, Optional, Sequence, Tuple

from nbscaler.codegen.liveness import release_dead
from nbscaler.codegen.context import chunk_comment, context_call
from nbscaler.codegen.experts import experts_call, experts_comment, experts_tp_comment
from nbscaler.codegen.float8 import float8_call, float8_nodes
from nbscaler.codegen.render import (INPLACE_OPERATORS, CodegenError, Code, source_comment, attr_name, group_var,
                                     render, render_call)
from nbscaler.codegen.vocab import vocab_call
from nbscaler.comm.arguments import local_arguments
from nbscaler.comm.program import (Call, Fetch, Origin, Receive, Recompute, Reshard, Return, Section, Send, Unshard,
                                   Value)
from nbscaler.ir.graph import RECOMPUTE_CORE, IRNode, IRTensor
from nbscaler.ir.backward_split import KEY as BACKWARD_PART
from nbscaler.ir.expert_rules import expert_parallel
from nbscaler.ir.layer_rules import context_group, context_parallel, sync_batch_norm, vocab_group, vocab_parallel
from nbscaler.layouts import COLLECTIVES, emulations
from nbscaler.recipe import Recipe
from torch.fx.graph import dtype_abbrs
from nbscaler.trace.guards import GUARD_OP, describe_site, guard_expression


def emulation_notes(fn: str) -> List[str]:
    """A line for each backend that runs collective ``fn``'s forward or backward as another
    collective (``nbscaler.layouts.EMULATED``): what that backend sends, and is priced."""
    spec = COLLECTIVES[fn]
    backward = COLLECTIVES[spec.backward].priced_as if spec.backward is not None else None
    return [f"on {backend} {where}{str(primitive).replace('_', '-')} runs as an {str(e.runs).replace('_', '-')}, "
            "and is priced as one"
            for where, primitive in (("this ", spec.priced_as), ("its backward's ", backward))
            for backend, e in emulations(primitive)]


def shape_text(value: Value) -> str:
    """``'f32[4, 64]'``: the dtype and local shape of ``value``, as ``torch.fx`` prints them."""
    dtype = dtype_abbrs.get(value.tensor.dtype, str(value.tensor.dtype).replace("torch.", ""))
    return f"{dtype}[{', '.join(map(str, value.shape))}]"


def annotated(value: Value) -> str:
    """The target of an assignment to ``value``: its name with its local shape."""
    return f'{value_name(value)}: "{shape_text(value)}"'


def value_name(value: Value) -> str:
    """The expression that holds ``value`` in generated code."""
    t = value.tensor
    if value.origin == Origin.WEIGHT:
        return f"self.{attr_name(t.name)}"
    if value.origin == Origin.CONVERTED:
        return f"{attr_name(t.name)}_{value.layout.label}"
    return t.name


class SectionPrinter:
    """Prints one lowered section as the lines of a method body."""

    def __init__(self, section: Section, recipe: Optional[Recipe] = None):
        self.sec = section
        # a float8 recipe's scaling, and the linear layers it takes in fp8 (``codegen.float8``)
        self.float8 = recipe.float8 if recipe is not None else None
        self.float8_nodes = float8_nodes(section.graph, recipe.float8_skip) if self.float8 is not None else set()
        self.lines: List[str] = []
        # node name -> (first, end) indexes into ``lines``: its call and the collectives its inputs needed
        self.spans: Dict[str, Tuple[int, int]] = {}
        self.last_comment: Optional[str] = None     # the source comment last written
        self.last_source: Optional[Tuple[str, int]] = None     # and the source line it quoted

    def print(self) -> List[str]:
        sends: List[Send] = []
        for ins in self.sec.instructions:
            if isinstance(ins, Receive):
                name = ins.value.tensor.name
                self.lines.append(f"{annotated(ins.value)} = carry[{name!r}]")
            elif isinstance(ins, Call):
                self.calls([ins])
            elif isinstance(ins, Recompute):
                self.recompute(ins)
            elif isinstance(ins, Send):
                self.fetches(ins.fetches)
                sends.append(ins)
            elif isinstance(ins, Return):
                self.fetches(ins.fetches)
                self.lines.append(f"return {self._render_outputs(ins.outputs, ins.values)}")
            elif isinstance(ins, Unshard):
                self.unshard(ins)
            elif isinstance(ins, Reshard):
                self.reshard(ins)
        if sends:
            items = ", ".join(f"{s.tensor.name!r}: {value_name(s.value)}" for s in sends)
            self.lines.append(f"return {{{items}}}")
        self.lines = release_dead(self.lines)       # each local freed after its last use
        return self.lines

    def fetches(self, fetches: Sequence[Fetch]) -> None:
        for f in fetches:
            group = group_var(f.devices)
            for c in f.steps:
                step = c.step
                dims = "".join(f", dim={d}" for d in (step.dim,) if d is not None)
                dims += f", dim2={step.dim2}" if step.dim2 is not None else ""
                dims += f", blocks={step.blocks!r}" if step.blocks != 1 else ""
                self.lines += [f"# {note}" for note in emulation_notes(step.fn)]
                self.lines.append(f"{annotated(c.dst)} = comm.{step.fn}({value_name(c.src)}{dims}, group={group})")

    def calls(self, calls: Sequence[Call]) -> None:
        """Calls one after the other, each under a comment naming its module and source line."""
        for call in calls:
            comment = source_comment(call.node)
            if comment != self.last_comment:
                again = call.node.source is not None and call.node.source == self.last_source
                self.lines.append(f"# {call.node.module_path or '(top level)'}" if again else comment)
                self.last_comment, self.last_source = comment, call.node.source
            first = len(self.lines)
            self.fetches(call.fetches)
            self.call(call)
            self.spans[call.node.name] = (first, len(self.lines))

    def recompute(self, region: Recompute) -> None:
        """A recomputed region: one local function of the tensors it reads, run through checkpoint.
        Variables made inside are out of scope after it, except those it returns."""
        self.fetches(region.fetches)
        params: List[str] = []
        for v in region.inputs:
            expr = value_name(v)
            if not expr.startswith("self.") and expr not in params:
                params.append(expr)
        fn = f"recompute_{attr_name(region.region)}"
        module = region.region.split("#")[0]
        core = module.endswith(RECOMPUTE_CORE)         # recompute='selective': an attention core
        module = module[:-len(RECOMPUTE_CORE)] if core else module
        kind = self.sec.graph.meta.get("module_classes", {}).get(module)
        what = f"{'the attention core of ' if core else ''}{module}{f' ({kind})' if kind else ''}"
        self.lines.append(f"# {what} is recomputed in the backward: the forward keeps only its inputs")
        self.lines.append(f"def {fn}({', '.join(params)}):")
        body = len(self.lines)
        self.last_comment = self.last_source = None
        self.calls(region.body)
        self.last_comment = self.last_source = None
        self.lines[body:] = ["    " + line for line in self.lines[body:]]
        returned = ", ".join(t.name for t in region.returns) or "None"
        self.lines.append(f"    return {returned}")
        call = f"checkpoint({', '.join([fn] + params)}, use_reentrant=False)"
        self.lines.append(f"{returned} = {call}" if region.returns else call)

    def _unit_text(self, unit: str) -> str:
        kind = self.sec.graph.meta.get("module_classes", {}).get(unit)
        return f"{unit} ({kind})" if kind else unit

    def unshard(self, ins: Unshard) -> None:
        """``self.shards.unshard(unit, prefetch=...)``: the unit's parameters all-gathered from the
        shards the ranks hold (ZeRO-3), and the next unit's gather started."""
        self.lines.append(f"# ZeRO-3 unit {self._unit_text(ins.unit)}: all-gather its parameters from the shards "
                          "of the data-parallel ranks")
        if ins.prefetch is not None:
            self.lines.append(f"# and start {ins.prefetch}'s all-gather now, so that it overlaps this unit's compute")
        prefetch = f", prefetch={ins.prefetch!r}" if ins.prefetch is not None else ""
        self.lines.append(f"self.shards.unshard({ins.unit!r}{prefetch})")
        self.last_comment = self.last_source = None

    def reshard(self, ins: Reshard) -> None:
        """``a, b = self.shards.reshard(unit, a, b)``: the unit's gathered parameters freed; what
        leaves the unit passes through a hook that gathers them again for the backward."""
        self.lines.append(f"# ZeRO-3 unit {ins.unit} done: free its gathered parameters; the backward gathers them "
                          "again when it reaches what leaves the unit")
        names = [value_name(v) for v in ins.outputs]
        target = f"{', '.join(names)}{',' if len(names) == 1 else ''} = " if names else ""
        self.lines.append(f"{target}self.shards.reshard({', '.join([repr(ins.unit)] + names)})")
        self.last_comment = self.last_source = None

    def call(self, call: Call) -> None:
        node, place = call.node, call.node.placement
        per_position = [value_name(v) for v in call.inputs]
        if node.op == GUARD_OP:
            self.guard(node, per_position)
            return
        it = iter(per_position)
        args, kwargs = node.map_args(lambda t: Code(next(it)))
        args, kwargs = local_arguments(node, args, kwargs, call.outputs[0].shape if call.outputs else ())
        lhs = self._lhs(node, call.outputs)
        name = node.target[len("Tensor."):] if node.target.startswith("Tensor.") else ""
        if name == "__setitem__":
            idx = args[1]
            inner = ", ".join(render(i, index=True) for i in idx) if isinstance(idx, tuple) else render(idx, index=True)
            self.lines.append(f"{render(args[0])}[{inner}] = {render(args[2])}")
            self.lines.append(f"{lhs} = {render(args[0])}")
        elif name in INPLACE_OPERATORS and not kwargs and len(args) == 2:
            self.lines.append(f"{render(args[0])} {INPLACE_OPERATORS[name]} {render(args[1])}")
            self.lines.append(f"{lhs} = {render(args[0])}")
        elif context_parallel(node):    # this device's slice of the sequence
            group = context_group(node, self.sec.device)
            if node.op == "attention":
                self.lines += chunk_comment(node, group, self.sec.device).splitlines()
            self.lines.append(f"{lhs} = {context_call(node, args, kwargs, group_var(group), self.sec.device)}")
        elif expert_parallel(node):     # this device's experts; the pairs travel to theirs
            self.lines.append(experts_comment(node, self.sec.device))
            self.lines.append(f"{lhs} = {experts_call(node, args, kwargs, group_var(place.devices))}")
        elif vocab_parallel(node):      # this device's share of the vocabulary
            group = vocab_group(node, self.sec.device)
            self.lines.append(f"{lhs} = {vocab_call(node, args, group.index(self.sec.device), group_var(group))}")
        elif node.name in self.float8_nodes:    # products in fp8, scaled as the whole tensors would be
            self.lines.append(f"{lhs} = {float8_call(node, args, kwargs, self.float8, self.sec.device)}")
        elif sync_batch_norm(node):     # statistics over the whole batch, not this device's share
            call_text = render_call(node, args, kwargs)
            self.lines.append(f"{lhs} = comm.{call_text[len('F.'):-1]}, group={group_var(place.devices)})")
        else:
            self.lines += [c for c in [experts_tp_comment(node, self.sec.device)] if c]   # experts split by width
            line = f"{lhs} = {render_call(node, args, kwargs)}"
            if not isinstance(node.outputs, IRTensor) and call.outputs:     # several: their shapes in a comment
                line += f"    # {', '.join(shape_text(v) for v in call.outputs)}"
            self.lines.append(line)
        part = node.meta.get(BACKWARD_PART)
        if part:                        # a zero-bubble schedule: which backward block computes its gradient
            last = self.lines[-1]
            self.lines[-1] = f"{last}; backward {part}" if "    # " in last else f"{last}    # backward {part}"

    def guard(self, node: IRNode, tensors: List[str]) -> None:
        """``expect_traced(bool(all_0), True, ...)``: the value the trace specialised on, checked."""
        expression = guard_expression(node, tuple(tensors))
        where = describe_site(node.module_path, node.source)
        code = linecache.getline(*node.source).split("  #", 1)[0].strip() if node.source else ""
        where += f": `{code}`" if code else ""
        self.lines.append(f"expect_traced({expression}, {render(node.outputs)}, {expression!r}, {where!r})")

    def _lhs(self, node: IRNode, values: Sequence[Value]) -> str:
        """The assignment target: one name with its local shape, or a pattern that unpacks several."""
        if isinstance(node.outputs, IRTensor):
            return annotated(values[0])
        return self._pattern(node)

    def _pattern(self, node: IRNode) -> str:
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

    def _render_outputs(self, value: Any, values: Dict[int, Value]) -> str:
        if isinstance(value, IRTensor):
            return value_name(values[id(value)])
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            inner = ", ".join(self._render_outputs(v, values) for v in value)
            return f"{type(value).__module__}.{type(value).__qualname__}({inner})"
        if isinstance(value, (tuple, list)):
            inner = ", ".join(self._render_outputs(v, values) for v in value)
            if isinstance(value, list):
                return f"[{inner}]"
            return f"({inner},)" if len(value) == 1 else f"({inner})"
        if isinstance(value, dict):
            return "{" + ", ".join(f"{render(k)}: {self._render_outputs(v, values)}" for k, v in value.items()) + "}"
        return render(value)
