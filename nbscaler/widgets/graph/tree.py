"""The module hierarchy of a traced graph, and which part of it is on screen.

Every IR node records the module that called it (``node.module_path``, e.g. ``blocks.3.attn.qkv``).
Those paths form a tree: the root (the whole model, path ``''``) holds its child modules and the
ops it calls itself; each module holds its own children and ops, in the order the forward first
reaches them. A view shows the tree cut at an *expanded set*: an expanded module opens into its
children, a collapsed one stands for every op below it. Keys name what is shown:

- a module by its path (``'blocks.3'``);
- an op by ``'#'`` and its node index in the graph (``'#17'``), the index ``plan.ops.id`` uses.

A module that calls very many ops itself (a long functional forward) shows them in segments of
consecutive ops (``ops40-71``), which open like modules.

>>> tree = ModuleTree.from_graph(plan.graph)             # doctest: +SKIP
>>> tree.leaves(tree.default_expanded())[:4]
['tok', '#1', 'pos', '#3']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Iterable, List, Set

from nbscaler.ir.graph import IRGraph

ROOT = ""

#: Open modules until this many items show; a model that is one wrapper module is not one box.
MIN_VISIBLE = 6
#: A module calling more ops than this itself shows them in segments of consecutive ops, each a box
#: that opens like a module, so that no level is ever the flat graph of a long functional forward.
MAX_DIRECT_OPS = 48
SEGMENT = 32


def op_key(node_id: int) -> str:
    return f"#{node_id}"


def is_op_key(key: str) -> bool:
    return key.startswith("#")


def node_of(key: str) -> int:
    return int(key[1:])


@dataclass
class ModuleEntry:
    """One module of the tree: its children (module paths and op keys) and every op below it."""

    path: str
    children: List[str] = field(default_factory=list)
    ops: List[int] = field(default_factory=list)        # node indexes, this module and below, in order

    @property
    def name(self) -> str:
        return self.path.rsplit(".", 1)[-1]


@dataclass
class ModuleTree:
    modules: Dict[str, ModuleEntry]
    op_module: List[str]                                 # node index -> the module that called it

    @classmethod
    def from_graph(cls, graph: IRGraph) -> "ModuleTree":
        modules = {ROOT: ModuleEntry(ROOT)}
        op_module = []
        for i, node in enumerate(graph.nodes):
            path = node.module_path or ROOT
            parent = ROOT
            parts = path.split(".") if path else []
            for depth in range(len(parts)):
                prefix = ".".join(parts[:depth + 1])
                if prefix not in modules:
                    modules[prefix] = ModuleEntry(prefix)
                    modules[parent].children.append(prefix)
                modules[parent].ops.append(i)
                parent = prefix
            modules[path].ops.append(i)
            modules[path].children.append(op_key(i))
            op_module.append(path)
        tree = cls(modules, op_module)
        for path in list(modules):
            tree._segment(path)
        return tree

    def _segment(self, path: str) -> None:
        """Group the direct ops of a module that calls too many into segments ``ops<first>-<last>``."""
        entry = self.modules[path]
        if sum(is_op_key(c) for c in entry.children) <= MAX_DIRECT_OPS:
            return
        children: List[str] = []
        run: List[str] = []

        def flush() -> None:
            for start in range(0, len(run), SEGMENT):
                piece = run[start:start + SEGMENT]
                ids = [node_of(k) for k in piece]
                name = f"ops{ids[0]}-{ids[-1]}"
                seg = f"{path}.{name}" if path else name
                self.modules[seg] = ModuleEntry(seg, list(piece), ids)
                for i in ids:
                    self.op_module[i] = seg
                children.append(seg)
            run.clear()

        for child in entry.children:
            if is_op_key(child):
                run.append(child)
            else:
                flush()
                children.append(child)
        flush()
        entry.children = children

    def parent(self, key: str) -> str:
        """The module holding ``key`` (a module path, or an op key via the op's module)."""
        if key == ROOT:
            raise ValueError("the root module has no parent")
        if is_op_key(key):
            return self.op_module[node_of(key)]
        return key.rsplit(".", 1)[0] if "." in key else ROOT

    def ancestors(self, key: str) -> List[str]:
        """The modules that must be open for ``key`` to show, outermost first (the root excluded)."""
        out = []
        while key != ROOT:
            key = self.parent(key)
            if key != ROOT:
                out.append(key)
        return out[::-1]

    # -- what is on screen ------------------------------------------------------------------
    def normalise(self, expanded: Iterable[str]) -> FrozenSet[str]:
        """The modules of ``expanded`` that exist and whose ancestors are all open as well."""
        wanted = {p for p in expanded if p in self.modules and p != ROOT}
        return frozenset(p for p in wanted if all(a in wanted for a in self.ancestors(p)))

    def leaves(self, expanded: FrozenSet[str]) -> List[str]:
        """The keys shown as boxes: collapsed modules and the ops of open ones, in forward order."""
        out: List[str] = []
        self._walk(ROOT, expanded, out, [])
        return out

    def open_modules(self, expanded: FrozenSet[str]) -> List[str]:
        """The open modules drawn as frames around their children (outermost first)."""
        frames: List[str] = []
        self._walk(ROOT, expanded, [], frames)
        return frames

    def _walk(self, path: str, expanded: FrozenSet[str], leaves: List[str], frames: List[str]) -> None:
        for child in self.modules[path].children:
            if not is_op_key(child) and child in expanded:
                frames.append(child)
                self._walk(child, expanded, leaves, frames)
            else:
                leaves.append(child)

    def owners(self, expanded: FrozenSet[str]) -> Dict[int, str]:
        """Node index -> the key of the box that shows it."""
        owner: Dict[int, str] = {}
        for key in self.leaves(expanded):
            for i in ([node_of(key)] if is_op_key(key) else self.modules[key].ops):
                owner[i] = key
        return owner

    def default_expanded(self) -> FrozenSet[str]:
        """What a view opens with: wrappers and lists of layers open (a GPT shows its embeddings,
        ``blocks.0 .. blocks.N`` and its head), then the largest module until a few boxes show."""
        expanded: Set[str] = set()
        frontier = [ROOT]
        while frontier:
            path = frontier.pop()
            for child in self.modules[path].children:
                if not is_op_key(child) and self._is_container(child):
                    expanded.add(child)
                    frontier.append(child)
        while len(self.leaves(frozenset(expanded))) < MIN_VISIBLE:
            closed = [k for k in self.leaves(frozenset(expanded)) if not is_op_key(k)]
            if not closed:
                break
            largest = max(closed, key=lambda k: len(self.modules[k].ops))
            expanded.add(largest)
        return frozenset(expanded)

    def _is_container(self, path: str) -> bool:
        """A module that calls nothing itself: a single-child wrapper, or a list of numbered layers."""
        children = self.modules[path].children
        if any(is_op_key(c) for c in children):
            return False
        return len(children) == 1 or all(self.modules[c].name.isdigit() for c in children)
