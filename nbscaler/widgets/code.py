"""``CodeView``: each rank's generated code (``plan.sources``), highlighted, with a rank selector.

Selecting an op anywhere shows the lines that run it: ``code.show(node_id)`` picks a rank that runs
the op (the current one when it does), marks its lines (``plan.source_lines``: the call and the
collectives its inputs needed) and scrolls to them. ``code.link(graph)`` does that whenever a
``GraphView``'s selection changes.

>>> code = CodeView(plan).link(graph)          # doctest: +SKIP
>>> graph.select(17); code.rank, code.lines    # the rank showing op 17 and its lines there
"""

from __future__ import annotations

import functools
import re
from html import escape
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Set

import anywidget
import traitlets
from pygments.formatters import HtmlFormatter

from nbscaler.widgets.base import Measured, View
from nbscaler.widgets.frontend import frontend_text

if TYPE_CHECKING:
    from nbscaler.planning import Plan
    from nbscaler.planning.fingerprint import Fingerprint
    from nbscaler.widgets.graph import GraphView

CODE_CLASS = "nbs-hl"
LINE_ID = "nbs-line"                 # each line is <span id="nbs-line-N">, for marking and scrolling
SAVED_RANKS = 4                      # the most files the saved HTML holds (to_html)


@functools.lru_cache(maxsize=1)
def highlight_css() -> str:
    """Pygments' colours for code inside a CodeView, scoped so they never style the page."""
    scope = f".nbs-codeview .{CODE_CLASS}"
    rules = HtmlFormatter(style="default").get_style_defs(scope).splitlines()
    return "\n".join(r for r in rules if r.startswith(scope)) + f"\n{frontend_text('code.css')}"


_KEYWORDS = frozenset("and as assert break class continue def del elif else except finally for global if in is "
                      "lambda nonlocal not or pass raise return try while with yield".split())
_IMPORTS = frozenset(("import", "from"))
_CONSTANTS = frozenset(("None", "True", "False"))
#: One token of a generated line, by kind: the CSS classes are Pygments' (``highlight_css``).
_TOKEN = re.compile(r"""(?P<c1>\#.*)|(?P<s1>'(?:[^'\\]|\\.)*')|(?P<s2>"(?:[^"\\]|\\.)*")"""
                    r"|(?P<mf>\b\d+\.\d*(?:e[+-]?\d+)?|\b\d+e[+-]?\d+)|(?P<mi>\b\d+\b)|(?P<word>[A-Za-z_]\w*)"
                    r"|(?P<o>[=+\-*/%<>!&|^~@.]+)")


def _line_html(line: str) -> str:
    """One line of code (no docstring) as HTML spans: comments, strings, numbers, keywords, operators."""
    out, at, previous = [], 0, ""
    for m in _TOKEN.finditer(line):
        out.append(escape(line[at:m.start()], quote=False))
        kind, text = m.lastgroup, m.group()
        if kind == "word":
            kind = ("kn" if text in _IMPORTS else "k" if text in _KEYWORDS else "kc" if text in _CONSTANTS
                    else "bp" if text == "self" else "nf" if previous == "def" else "nc" if previous == "class" else "")
            previous = text
        out.append(f'<span class="{kind}">{escape(text)}</span>' if kind else escape(text))
        at = m.end()
    out.append(escape(line[at:], quote=False))
    return "".join(out)


def highlighted(source: str) -> str:
    """One file as highlighted HTML with line numbers; line ``N`` is ``<span id="nbs-line-N">``.

    Generated code is plain statements, comments and one docstring, so a one-pass tokenizer colours
    it with Pygments' classes (``highlight_css``), about twenty times faster than Pygments' Python
    lexer, whose cost grew to seconds per rank of a real-size model."""
    lines, width, docstring = source.splitlines(), len(str(source.count("\n") + 1)), False
    out = [f'<div class="{CODE_CLASS}"><pre><span></span>']
    for n, line in enumerate(lines, 1):
        quotes = line.count('"""')
        if docstring or quotes:
            body = f'<span class="sd">{escape(line, quote=False)}</span>' if line else ""
            docstring = docstring != (quotes % 2 == 1)
        else:
            body = _line_html(line)
        out.append(f'<span id="{LINE_ID}-{n}"><span class="linenos">{n:>{width}}</span>{body}\n</span>')
    return "".join(out) + "</pre></div>\n"


class CodeWidget(anywidget.AnyWidget):
    """The live widget; ``CodeView`` sets what it shows."""

    _esm = traitlets.Unicode(frontend_text("code.js")).tag(sync=True)
    _css = traitlets.Unicode(highlight_css()).tag(sync=True)

    ranks = traitlets.List(traitlets.Int()).tag(sync=True)
    rank = traitlets.Int(0).tag(sync=True)
    html = traitlets.Unicode("").tag(sync=True)              # the shown rank's file, highlighted
    lines = traitlets.List(traitlets.Int()).tag(sync=True)   # lines marked (1-based) in the shown file
    node = traitlets.Int(None, allow_none=True).tag(sync=True)
    caption = traitlets.Unicode("").tag(sync=True)


class CodeView(View):
    """Generated code per rank; ``show(node_id)`` marks and scrolls to an op's lines."""

    def __init__(self, plan: "Plan", *, measured: Optional[Measured] = None, rank: int = 0, **options: Any) -> None:
        super().__init__(plan, measured=measured, **options)
        self._html: Dict[int, str] = {}
        self._linked: Set[int] = set()
        self.widget = CodeWidget(ranks=sorted(plan.sources), rank=self._check_rank(rank))
        self.widget.observe(self._on_rank, "rank")
        self._on_rank()

    @property
    def rank(self) -> int:
        return self.widget.rank

    @rank.setter
    def rank(self, rank: int) -> None:
        self.widget.rank = self._check_rank(rank)

    @property
    def lines(self) -> List[int]:
        return list(self.widget.lines)

    @property
    def node(self) -> Optional[int]:
        return self.widget.node

    def show(self, node_id: Optional[int]) -> None:
        """Mark the lines that run op ``node_id`` (``plan.ops.id``), switching to a rank that runs it."""
        if node_id is not None and not 0 <= node_id < len(self.plan.graph):
            raise ValueError(f"node id {node_id} is not in this plan's graph (0 .. {len(self.plan.graph) - 1})")
        self.widget.node = node_id
        if node_id is not None and node_id not in self.plan.source_lines[self.rank]:
            runs = [r for r, per_node in self.plan.source_lines.items() if node_id in per_node]
            if runs:
                self.widget.rank = runs[0]          # observed: marks the lines there
                return
        self._mark()

    def link(self, graph: "GraphView") -> "CodeView":
        """Follow ``graph``'s selection from now on (and show its current one); returns ``self``.
        Linking the same graph twice changes nothing."""
        if id(graph.widget) not in self._linked:
            self._linked.add(id(graph.widget))
            graph.widget.observe(lambda change: self.show(change["new"]), "selected")
        if graph.selected is not None:
            self.show(graph.selected)
        return self

    def _check_rank(self, rank: int) -> int:
        if rank not in self.plan.sources:
            raise ValueError(f"rank {rank} is not in this plan: its ranks are 0 .. {len(self.plan.sources) - 1}")
        return rank

    def _source_html(self, rank: int) -> str:
        if rank not in self._html:
            self._html[rank] = highlighted(self.plan.sources[rank])
        return self._html[rank]

    def _on_rank(self, change=None) -> None:
        self.widget.html = self._source_html(self.rank)
        self._mark()

    def _mark(self) -> None:
        node, w = self.widget.node, self.widget
        lines = self.plan.source_lines[self.rank].get(node, []) if node is not None else []
        w.lines = list(lines)
        if node is None:
            w.caption = f"gencode{self.rank}.py"
        elif lines:
            span = f"line {lines[0]}" if len(lines) == 1 else f"lines {lines[0]}-{lines[-1]}"
            w.caption = f"gencode{self.rank}.py · {self.plan.graph.nodes[node].name}: {span}"
        else:
            w.caption = f"gencode{self.rank}.py · {self.plan.graph.nodes[node].name} does not run on rank {self.rank}"

    def _redraw(self) -> None:
        self._html.clear()
        w = self.widget
        with w.hold_trait_notifications():
            w.ranks = sorted(self.plan.sources)
            if w.rank not in self.plan.sources:
                w.rank = 0
            if w.node is not None and w.node >= len(self.plan.graph):
                w.node = None
        self._on_rank()

    def fingerprint(self) -> "Fingerprint":
        """The shown rank's generated file, one row per line."""
        from nbscaler.planning.fingerprint import code_fingerprint
        return code_fingerprint(self.plan, self.rank)

    def to_html(self) -> str:
        """The files of the first unit's ranks, highlighted, each in a ``<details>`` (no script needed).

        Ranks of other units run their plan device's code (``grid.device_of(rank)``); their files differ
        only in the rank number, so they are named, not repeated. A unit of more than
        ``SAVED_RANKS`` devices saves the shown rank's file alone (the 8 files of Llama-3-8B under
        ``tp`` weigh 8 MB, the 64 of 70B's plan 27 MB); the live view shows any rank.
        """
        cfg = self.plan.config
        shown = cfg.device_of(self.rank)
        ranks = range(cfg.plan_ngpus) if cfg.plan_ngpus <= SAVED_RANKS else [shown]
        files = "".join(f"<details{' open' if r == shown else ''}><summary>{escape(self._same_code(r))}</summary>"
                        f'<div class="nbs-code-body">{self._source_html(r)}</div></details>'
                        for r in ranks)
        return (f'<div class="nbs-codeview nbs-static"><style>{highlight_css()}</style>'
                f'<div class="nbs-title">{escape(repr(self.plan))}</div>{files}</div>'
                ).encode("ascii", "xmlcharrefreplace").decode("ascii")

    def _same_code(self, rank: int) -> str:
        twins = [r for r in self.plan.config.grid.dp_ranks(self.plan.config.device_of(rank)) if r > rank]
        also = (f" (rank {twins[0]} runs the same code)" if len(twins) == 1 else
                f" (ranks {', '.join(map(str, twins))} run the same code)" if twins else "")
        return f"rank {rank}: gencode{rank}.py{also}"
