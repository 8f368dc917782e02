"""The facts of one plan that every pane and expansion of the graph reads, gathered once per plan.

- each op's row of ``plan.ops`` (placement, split, annotation, shapes, FLOPs);
- the data edges between nodes (from the IR's tensors: who made each input);
- each row of ``plan.collectives`` as ``(from node, to node, collective, bytes, devices)``;
- which nodes each rank runs (``plan.rank_nodes``).

Scenes are cheap cuts of these facts, so expanding a module never touches the plan again.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set, Tuple

from nbscaler.glossary import split_name
from nbscaler.ir.expert_rules import EXPERT_OPS, expert_parallel
from nbscaler.ir.layer_rules import parallel_splits
from nbscaler.layouts import Collective
from nbscaler.planning.expert_tables import held_text
from nbscaler.widgets.formats import fmt_count, is_missing
from nbscaler.widgets.graph.box import Box, BoxKind

if TYPE_CHECKING:
    from nbscaler.planning import Plan

INPUTS, OUTPUTS = "@inputs", "@outputs"
GRAPH_INPUT = -1                     # ``CommRow.src`` of a tensor that is an input of the model


@dataclass(frozen=True)
class CommRow:
    """One row of ``plan.collectives`` tied to graph nodes.

    ``src``: the node that made the tensor, ``GRAPH_INPUT`` for a model input, ``None`` for a
    weight (it then counts on its reader). ``dst``: the node that needs it, ``None`` for the
    model's outputs.
    """

    src: Optional[int]
    dst: Optional[int]
    collective: str
    bytes: int
    devices: Tuple[int, ...]


class OpRows:
    """``plan.ops`` read by position without a pandas lookup per access: ``rows[i]`` is row ``i`` as
    a dict, ``rows.column(name)`` one column as a list."""

    def __init__(self, frame):
        self._columns = {c: frame[c].tolist() for c in frame.columns}
        self._n = len(frame)

    def column(self, name: str) -> list:
        return self._columns[name]

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: int) -> dict:
        return {c: values[i] for c, values in self._columns.items()}


class PlanFacts:
    """Per-plan facts for the graph view (see the module docstring)."""

    def __init__(self, plan: "Plan"):
        self.plan = plan
        self.ops = OpRows(plan.ops)
        graph = plan.graph
        self.index = {id(n): i for i, n in enumerate(graph.nodes)}
        self.reduce_dims = [set(n.annotation.reduce) if n.annotation is not None else set() for n in graph.nodes]
        self.input_names = [t.name for t in graph.inputs]
        self.contexts = parallel_splits(graph)     # ops context or expert parallelism cut
        self.data_edges = self._data_edges()
        self.comm_rows = self._comm_rows()
        self._runs: Dict[int, Set[int]] = {}
        self._boxes: Dict[Tuple[Any, Optional[int]], Box] = {}

    # -- gathered once ------------------------------------------------------------------------
    def _data_edges(self) -> List[Tuple[int, Optional[int]]]:
        """(producer, consumer) per tensor read, ``GRAPH_INPUT`` / ``None`` for the model's ends."""
        graph = self.plan.graph
        edges = []
        for i, node in enumerate(graph.nodes):
            for t in {id(t): t for t in node.inputs}.values():
                if t.producer is not None:
                    edges.append((self.index[id(t.producer)], i))
                elif t.kind == "input":
                    edges.append((GRAPH_INPUT, i))
        for t in graph.output_tensors():
            if t.producer is not None:
                edges.append((self.index[id(t.producer)], None))
        return edges

    def _comm_rows(self) -> List[CommRow]:
        graph = self.plan.graph
        by_name = {n.name: i for i, n in enumerate(graph.nodes)}
        readers: Dict[str, List[int]] = defaultdict(list)
        for i, node in enumerate(graph.nodes):
            for t in node.inputs:
                readers[t.name].append(i)
        inputs = set(self.input_names)
        rows = []
        for r in self.plan.collectives.itertuples(index=False):
            if r.producer is not None and isinstance(r.producer, str):
                src = by_name[r.producer]
            else:
                src = GRAPH_INPUT if r.tensor in inputs else None
            if r.collective == Collective.SEND_RECV:
                dst = self._receiver(readers[r.tensor], r.stage if r.phase == "F" else r.stage - 1)
            else:
                dst = None if is_missing(r.consumer_index) else int(r.consumer_index)
            rows.append(CommRow(src, dst, r.collective, int(r.bytes_per_device), tuple(r.devices)))
        return rows

    def _receiver(self, readers: List[int], sending_stage: int) -> Optional[int]:
        """The first reader of a tensor sent across a stage boundary, beyond ``sending_stage``."""
        later = [i for i in readers if (self.plan.graph.nodes[i].stage or 0) > sending_stage]
        return later[0] if later else None

    # -- asked per pane -----------------------------------------------------------------------
    def runs(self, rank: Optional[int]) -> Optional[Set[int]]:
        """The nodes ``rank`` runs (``None``: the logical pane shows them all)."""
        if rank is not None and rank not in self._runs:
            self._runs[rank] = set(self.plan.rank_nodes(rank))
        return None if rank is None else self._runs[rank]

    def device_of(self, rank: Optional[int]) -> Optional[int]:
        return None if rank is None else self.plan.config.device_of(rank)

    def split_mark(self, i: int) -> str:
        """How op ``i`` is split: its dimension name, ``+`` when the split leaves partial sums."""
        split = self.ops.column("split")[i]
        if not isinstance(split, str):
            return ""
        return split + ("+" if split in self.reduce_dims[i] else "")

    # -- boxes ----------------------------------------------------------------------------------
    def op_box(self, i: int, rank: Optional[int] = None) -> Box:
        """Op ``i``'s box in the logical pane or ``rank``'s; drawn once per plan (a scene copies it
        before adding bytes). Only an expert-parallel op's differs by rank: the experts it holds."""
        device = self.device_of(rank) if expert_parallel(self.plan.graph.nodes[i]) else None
        if ("op", i, device) not in self._boxes:
            self._boxes[("op", i, device)] = self._op_box(i, device)
        return self._boxes[("op", i, device)]

    def module_box(self, path: str, ops: List[int], rank: Optional[int]) -> Box:
        """A module's box for the logical pane or ``rank``'s (its share of ``ops``); drawn once.
        A rank that runs all of them shares the logical pane's box."""
        if (path, rank) not in self._boxes:
            runs = self.runs(rank)
            mine = ops if runs is None else [i for i in ops if i in runs]
            self._boxes[(path, rank)] = (self.module_box(path, ops, None) if rank is not None and len(mine) == len(ops)
                                         else self._module_box(path, mine))
        return self._boxes[(path, rank)]

    def _op_box(self, i: int, device: Optional[int]) -> Box:
        op, node = self.ops[i], self.plan.graph.nodes[i]
        devices = list(op["devices"]) or [0]
        mark = self.split_mark(i)
        where = (f"split {mark}, {split_name(op['split'], op['op'], self.contexts.get(op['name']))}, over {devices}"
                 if mark
                 else f"replicated on {devices}")
        if isinstance(op.get("inner_split"), str):     # a grid: tensor parallel inside context parallel
            where += f", {op['inner_split']}"
        subtitle = short_target(op["target"])
        if node.target in EXPERT_OPS:          # named by its experts: all of them, or those ``device`` holds
            subtitle = held_text(node, device)
            where += f"\n{subtitle}" + (f" on device {device}" if device is not None else "")
        tooltip = f"{op['name']} = {op['target']}  ({op['module'] or 'top level'})\n{where}"
        return Box(f"#{i}", BoxKind.OP, op["name"], subtitle, tooltip, [(d, 1 / len(devices)) for d in devices], mark)

    def _module_box(self, path: str, ops: List[int]) -> Box:
        devices, local, whole = (self.ops.column(c) for c in ("devices", "local_flops_fwd", "flops_fwd"))
        weight: Dict[int, float] = defaultdict(float)
        for i in ops:
            for d in devices[i]:
                weight[d] += _number(local[i])
        if not sum(weight.values()):
            for i in ops:
                for d in devices[i]:
                    weight[d] += 1.0
        total = sum(weight.values()) or 1.0
        flops = sum(_number(whole[i]) for i in ops)
        marks: Dict[str, float] = defaultdict(float)
        names: Dict[str, str] = {}
        for i in ops:
            mark = self.split_mark(i)
            if mark:
                marks[mark] += _number(whole[i]) + 1
                names.setdefault(mark, split_name(self.ops.column("split")[i], self.ops.column("op")[i],
                                                  self.contexts.get(self.ops.column("name")[i])))
        heaviest = sorted(marks, key=lambda m: -marks[m])[:3]
        split = " ".join(heaviest)
        title = module_title(path)
        tooltip = f"{path}: {len(ops)} ops, {fmt_count(flops)} forward FLOPs" + (
            "; split " + ", ".join(f"{m} {names[m]}" for m in heaviest) if split else "")
        return Box(path, BoxKind.MODULE, title, f"{len(ops)} ops · {fmt_count(flops)} FLOPs", tooltip,
                   sorted((d, w / total) for d, w in weight.items()), split)

    def io_box(self, key: str, rank: Optional[int]) -> Box:
        elsewhere = " · other stages" if rank is not None and self.plan.geometry is not None else ""
        if key == INPUTS:
            names = ", ".join(self.input_names)
            return Box(key, BoxKind.IO, "inputs", _clip(names) + elsewhere, f"model inputs: {names}", [])
        return Box(key, BoxKind.IO, "outputs", "returned" + elsewhere, "what the forward returns", [])


def module_title(path: str) -> str:
    """How a module box is titled: its own name, with the list's name for a numbered layer."""
    parts = path.split(".")
    return f"{parts[-2]}.{parts[-1]}" if len(parts) > 1 and parts[-1].isdigit() else parts[-1]


def short_target(target: str) -> str:
    """'torch.nn.functional.linear' -> 'F.linear', 'Tensor.view' -> '.view'."""
    if target.startswith("torch.nn.functional."):
        return "F." + target[len("torch.nn.functional."):]
    if target.startswith("Tensor."):
        return "." + target[len("Tensor."):]
    return target


def _number(x) -> float:
    return 0.0 if is_missing(x) else float(x)


def _clip(text: str, width: int = 28) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


__all__ = ["CommRow", "GRAPH_INPUT", "INPUTS", "OUTPUTS", "PlanFacts", "short_target"]
