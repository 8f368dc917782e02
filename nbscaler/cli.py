"""Command line: ``nbscaler demo`` runs the demo; ``nbscaler show DIR [RANK]`` prints generated code;
``nbscaler report DIR [--hardware NAME --nodes N]`` writes every view of a compiled module to one
offline HTML file (on a catalogued target, if named);
``nbscaler notebooks [--only NN ...]`` runs the walkthroughs again and saves them with their outputs.

>>> python -m nbscaler.cli demo --ranks 4          # doctest: +SKIP
>>> nbscaler report .nbscaler/_parallel_modules/tests.models.Llama/_ -o llama.html   # doctest: +SKIP
>>> python -m nbscaler.cli notebooks --only 01 04     # doctest: +SKIP
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


OPTIMIZERS = {"sgd": "SGD", "adam": "Adam", "adamw": "AdamW"}
MEASURED_FOLDER = "measured"


def report(path: str, out: Optional[str], optimizer: str, measured: Optional[str],
           hardware: Optional[str] = None, nodes: int = 1) -> int:
    """Write the report of the compiled module at (or under) ``path``; a run's telemetry saved with
    ``Measured.save`` in ``path/measured`` (or ``--measured``) is drawn beside the prediction. With
    ``hardware`` (a catalogued name) the summary, timeline and memory are those of ``nodes`` such nodes."""
    import torch

    from nbscaler.cost.hardware import Hardware
    from nbscaler.planning.saved import SavedPlanError, find_module_dir, load_plan
    from nbscaler.widgets.base import Measured            # widgets only for this command
    from nbscaler.widgets.report import write_report

    try:
        folder = find_module_dir(path)
        plan = load_plan(folder)
    except (FileNotFoundError, SavedPlanError) as e:
        print(f"nbscaler report: {e}", file=sys.stderr)
        return 2
    telemetry = Path(measured) if measured else folder / MEASURED_FOLDER
    data = Measured.load(telemetry) if telemetry.is_dir() else None
    if measured and data is None:
        print(f"nbscaler report: {telemetry} is not a folder of measured data (Measured.save writes one)",
              file=sys.stderr)
        return 2
    try:
        target_hw = Hardware.resolve(hardware, nodes=nodes) if hardware else None
        if target_hw is not None:
            target_hw.check_ranks(plan.config.runtime_ngpus)
    except ValueError as e:
        print(f"nbscaler report: {e}", file=sys.stderr)
        return 2
    target = Path(out) if out else folder / "report.html"
    written = write_report(plan, target, data, optimizer=getattr(torch.optim, OPTIMIZERS[optimizer]),
                           hardware=target_hw)
    print(written)
    return 0


def demo(argv: List[str]) -> int:
    """The demo, then one offline HTML report of every view of its tour."""
    from nbscaler.demo import run
    outcome = run(argv)
    from nbscaler.widgets import Measured, write_report     # widgets only for this command
    measured = Measured.from_train_result(outcome.tour.result)
    from nbscaler.demo import runs_frame
    path = write_report(outcome.tour.plan, outcome.report_path, measured, runs=runs_frame(outcome.rows))
    print(f"\nreport of every view (plan and why, graph, code, timeline, memory, runs): {path.resolve()}")
    return 0 if outcome.ok else 1


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="nbscaler")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="compile and train a small GPT with every policy, checked against one process",
                   add_help=False)
    show_p = sub.add_parser("show", help="print generated per-rank code")
    show_p.add_argument("path")
    show_p.add_argument("rank", nargs="?", type=int, default=0)
    report_p = sub.add_parser("report", help="write every view of a compiled module to one offline HTML file")
    report_p.add_argument("path", help="the folder parallelize wrote: <gen_savedir>/_parallel_modules/<module>/<instance>")
    report_p.add_argument("-o", "--out", help="the HTML file to write (default: report.html in that folder)")
    report_p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw",
                          help="the optimizer whose state the memory view counts")
    report_p.add_argument("--measured", help="a folder written by Measured.save (default: <path>/measured if present)")
    report_p.add_argument("--hardware", metavar="NAME",
                          help="draw the plan on this catalogued target (nbscaler.Hardware.catalogue(), e.g. H100-SXM-80GB)")
    report_p.add_argument("--nodes", type=int, default=1, help="nodes of --hardware (default 1)")
    nb_p = sub.add_parser("notebooks", help="run the walkthroughs in fresh kernels and save them with their outputs")
    nb_p.add_argument("--only", nargs="+", default=[], metavar="NAME",
                      help="these notebooks only, by number (01) or name (01_tour); default: all")
    nb_p.add_argument("--folder", help="the folder of NN_*.ipynb notebooks (default: notebooks/ of this checkout)")
    nb_p.add_argument("--timeout", type=int, default=600, help="seconds a cell may run (default 600)")
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        return demo(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "report":
        return report(args.path, args.out, args.optimizer, args.measured, args.hardware, args.nodes)
    if args.command == "notebooks":
        from nbscaler.walkthroughs import main as save_notebooks
        return save_notebooks(args.only, args.folder, args.timeout)
    return show(args.path, args.rank)


if __name__ == "__main__":
    sys.exit(main())
