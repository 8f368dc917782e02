"""Command line: ``nbscaler demo`` runs the demo; ``nbscaler show DIR [RANK]`` prints generated code.

>>> python -m nbscaler.cli demo --ranks 4          # doctest: +SKIP
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional


def show(path: str, rank: int) -> int:
    """Print one rank's generated code from a module folder (or any folder above one)."""
    root = Path(path)
    files = sorted(root.rglob(f"gencode{rank}.py"))
    if not files:
        print(f"no gencode{rank}.py under {root}", file=sys.stderr)
        return 1
    for f in files:
        print(f"# ===== {f}\n{f.read_text()}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="nbscaler")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="compile and train a small GPT with every policy, checked against one process",
                   add_help=False)
    show_p = sub.add_parser("show", help="print generated per-rank code")
    show_p.add_argument("path")
    show_p.add_argument("rank", nargs="?", type=int, default=0)
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from nbscaler.demo import main as demo_main
        return demo_main(rest)
    return show(args.path, args.rank)


if __name__ == "__main__":
    sys.exit(main())
