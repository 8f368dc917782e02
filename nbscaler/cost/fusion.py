"""The fusion pass: which tensors a compiler that fuses element-wise chains never reads or writes.

``torch.compile`` (inductor) turns each chain of element-wise ops, norms, softmaxes and reductions
into one kernel: the kernel reads what enters the chain from outside it and writes what leaves it;
what one op of the chain hands the next stays in registers. A target whose software compiles
(``Software.compiled``) prices each op of such a chain by those bytes alone (``cost.roofline``).

After ``annotate_fusion(graph)`` every node carries:

=================  ==============================================================================
``fused_reads``    per tensor input (``node.inputs``): the module path of the op of the same chain
                   that made it, which a compiled kernel does not read from memory; ``None`` for an
                   input from outside the chain
``fused_readers``  the module paths of the ops reading the node's outputs, when every one is an op
                   of the same chain (and no output leaves the graph): a compiled kernel never
                   writes them; ``None`` otherwise
=================  ==============================================================================

The paths let a target compile only some modules, each in a graph of its own
(``Software.compiled_modules``: torchtitan compiles each transformer block alone, and not the
loss): ``kept_in_registers`` cuts the chains at each compiled graph's edges (``compiled_unit``).

An op joins the kernel of the op it reads (directly or through views, ``VIEW_OPS``: no kernel, no
copy) when both are fusible (``FUSIBLE_OPS``), run in the same pipeline stage at the same placement
(a layout change between them is a collective, which a kernel cannot take inside it), and none of
its other inputs depends on that kernel: a residual add after an MLP cannot join the kernel of the
norm before it, whose output the MLP's products read; a SwiGLU's product joins its SiLU's kernel,
as the up-projection it also reads does not read the SiLU. Matrix products, attention and embeddings
run kernels of their own (cuBLAS, FlashAttention, a gather). Which of its inputs a fused backward keeps is the compiler's
choice (it may recompute them); the backward's bytes follow the forward's (``cost.roofline``).

>>> annotate_fusion(graph)                                  # doctest: +SKIP
>>> graph.nodes[5].meta["fused_reads"], graph.nodes[5].meta["fused_readers"]    # doctest: +SKIP
(('layers.0.mlp', None), ('layers.0.mlp', 'layers.0.mlp'))
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Set, Tuple

from nbscaler.ir.graph import IRGraph, IRNode, IRTensor
from nbscaler.ir.shape_rules import VIEW_OPS  # no kernel: a chain of fused ops runs through them

#: Ops a compiler fuses into its element-wise kernels: point-wise maths, norms, softmax, reductions,
#: masks, losses (a log-softmax, a gather and a mean), concatenation and padding.
FUSIBLE_OPS = frozenset({"elementwise", "norm", "softmax", "reduce", "sum", "triangle", "loss", "concat", "pad"})
FUSION_KEYS = ("fused_reads", "fused_readers")


def fusible(node: IRNode) -> bool:
    """Whether ``node`` runs inside a compiled element-wise kernel (never a product's FLOPs)."""
    return node.op in FUSIBLE_OPS and not node.meta.get("product", False)


def _same_chain(a: IRNode, b: IRNode) -> bool:
    return fusible(a) and fusible(b) and a.stage == b.stage and str(a.placement) == str(b.placement)


def _maker(tensor: IRTensor) -> Optional[IRNode]:
    """The op that computed ``tensor``'s values: its producer, looked through views."""
    node = tensor.producer
    while node is not None and node.op in VIEW_OPS and node.inputs:
        node = node.inputs[0].producer
    return node


def _readers(node: IRNode, consumers: Dict[int, List[IRNode]], leaving: Set[int]) -> List[Optional[IRNode]]:
    """The ops that read ``node``'s outputs, looked through views; ``None`` for an output of the
    graph (``leaving``), which the step hands back and so must be written."""
    out: List[Optional[IRNode]] = []
    todo = list(node.output_tensors)
    while todo:
        tensor = todo.pop()
        if id(tensor) in leaving:
            out.append(None)
        for reader in consumers.get(id(tensor), []):
            if reader.op in VIEW_OPS:
                todo.extend(reader.output_tensors)
            else:
                out.append(reader)
    return out


class _Kernels:
    """Kernels as a union-find over their first ids; ``members[root]`` and each value's ``after``
    are bit sets of ids (one bit per kernel: a graph of thousands of ops stays cheap)."""

    def __init__(self) -> None:
        self.parent: List[int] = []
        self.members: Dict[int, int] = {}

    def new(self) -> int:
        k = len(self.parent)
        self.parent.append(k)
        self.members[k] = 1 << k
        return k

    def find(self, k: int) -> int:
        while self.parent[k] != k:
            k = self.parent[k]
        return k

    def merge(self, kernels: Set[int]) -> int:
        root, *rest = sorted(kernels)
        for k in rest:
            self.parent[k] = root
            self.members[root] |= self.members.pop(k)
        return root


def _kernels(graph: IRGraph) -> Dict[int, int]:
    """``id(node) -> kernel`` for the fusible ops of ``graph``, in graph order: an op joins (and
    merges) the kernels of the ops of its chain it reads, unless one of its other inputs, or one of
    those kernels, depends on another of them: a kernel cannot wait inside it for a product that
    reads it, while a product that does not read it can run first. Otherwise it begins a kernel."""
    kernels, kernel = _Kernels(), {}
    after: Dict[int, int] = {}                  # id(node) -> bit set of the kernels its value depends on
    for node in graph.nodes:
        makers = [m for m in map(_maker, node.inputs) if m is not None]
        chained = [m for m in makers if id(m) in kernel and _same_chain(m, node)]
        deps = 0
        for m in makers:
            deps |= after.get(id(m), 0)
        if fusible(node):
            mine = {kernels.find(kernel[id(m)]) for m in chained}
            blocked = 0                         # what the other inputs wait for, and what each kernel waits for
            for m in makers:
                if m not in chained:
                    blocked |= after.get(id(m), 0)
            for m in chained:
                blocked |= after[id(m)] & ~kernels.members[kernels.find(kernel[id(m)])]
            free = mine and not any(blocked & kernels.members[k] for k in mine)
            kernel[id(node)] = kernels.merge(mine) if free else kernels.new()
            deps |= 1 << kernel[id(node)]
        after[id(node)] = deps
    return {n: kernels.find(k) for n, k in kernel.items()}


def annotate_fusion(graph: IRGraph) -> IRGraph:
    """Write ``fused_reads`` and ``fused_readers`` (above) on every node of ``graph``; returns it."""
    consumers = graph.consumers()
    leaving = {id(t) for t in graph.output_tensors()}
    kernel = _kernels(graph)
    together = lambda a, b: a is not None and b is not None and kernel.get(id(a), -1) == kernel.get(id(b), -2)
    for node in graph.nodes:
        reads = tuple(m.module_path if together(m, node) else None for m in map(_maker, node.inputs))
        readers = _readers(node, consumers, leaving)
        kept = id(node) in kernel and bool(readers) and all(together(node, r) for r in readers)
        node.meta.update(fused_reads=reads, fused_readers=tuple(r.module_path for r in readers) if kept else None)
    return graph


def compiled_unit(path: str, modules: Sequence[str] = ()) -> Optional[str]:
    """The graph a compiler of ``modules`` compiles the op at module ``path`` in: ``""`` (the whole
    model) where ``modules`` is empty; else the first module named (``ir.graph.in_module``) that holds
    it, or that module's numbered child where it is a list of blocks (torchtitan compiles each
    transformer block of ``layers`` on its own); ``None`` where no named module holds it (eager).

    >>> compiled_unit("model.layers.3.mlp", ("layers",)), compiled_unit("model.norm", ("layers",))
    ('model.layers.3', None)
    """
    if not modules:
        return ""
    parts = path.split(".") if path else []
    for name in modules:
        wanted = name.split(".")
        for i in range(len(parts) - len(wanted) + 1):
            if parts[i:i + len(wanted)] == wanted:
                end = i + len(wanted) + (i + len(wanted) < len(parts) and parts[i + len(wanted)].isdigit())
                return ".".join(parts[:end])
    return None


def kept_in_registers(node: IRNode, modules: Sequence[str] = ()) -> Tuple[Tuple[bool, ...], bool]:
    """Under a compiler of ``modules`` (``compiled_unit``): which of ``node``'s inputs its chain's
    kernel does not read from memory, and whether it never writes the node's outputs. A chain
    stops at the edge of each compiled graph."""
    unit = compiled_unit(node.module_path, modules)
    reads, readers = node.meta["fused_reads"], node.meta["fused_readers"]
    if unit is None:
        return (False,) * len(reads), False
    same = lambda path: path is not None and compiled_unit(path, modules) == unit
    return tuple(map(same, reads)), readers is not None and all(map(same, readers))
