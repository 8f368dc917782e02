"""The walkthroughs in ``notebooks/``, saved with their outputs: how they are made and how they are checked.

A saved notebook is what a reader on GitHub sees, without a kernel. ``save_notebooks`` runs each one
top to bottom in a fresh kernel that imports this checkout, and saves it with its outputs and, in
its metadata under ``"nbscaler"``, what produced them (the nbscaler version, the git commit, torch,
Python, a digest of the package source and one of the notebook's code cells):

    python -m nbscaler.cli notebooks                  # every notebooks/NN_*.ipynb
    python -m nbscaler.cli notebooks --only 01 04     # by number or by name

A notebook whose cell fails is not written; the saved file stays as it was. Every output that shows
a plan's tables carries their fingerprint (``nbscaler.planning.fingerprint``); ``stale_outputs``
compares the saved ones with those of a fresh run, cell by cell, which is what the notebook tests do.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from nbscaler.planning.fingerprint import FINGERPRINT_MIME, Fingerprint, differences

NOTEBOOK_PATTERN = "[0-9][0-9]_*.ipynb"
MAX_SAVED_BYTES = 5 * 10**6
"""A saved notebook stays under this size (GitHub stops rendering large ones)."""
METADATA_KEY = "nbscaler"
PROVENANCE_FIELDS = ("command", "nbscaler_version", "git_commit", "git_dirty", "torch_version", "python_version",
                     "source_sha256", "cells_sha256")
COMMAND = "python -m nbscaler.cli notebooks"
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"


class NotebookFailed(RuntimeError):
    """A notebook that could not be run or saved; its saved file is unchanged."""


def checkout_root() -> Path:
    """The folder that holds the ``nbscaler`` package this process imported (and ``notebooks/``)."""
    return Path(__file__).resolve().parents[1]


def notebook_paths(folder: Path, only: Sequence[str] = ()) -> List[Path]:
    """The walkthroughs in ``folder``, or those named in ``only`` by number (``01``) or name (``01_tour``)."""
    found = sorted(folder.glob(NOTEBOOK_PATTERN))
    if not found:
        raise FileNotFoundError(f"no notebooks named NN_*.ipynb in {folder}")
    if not only:
        return found
    names = {p: {p.stem, p.name, p.stem.split("_")[0]} for p in found}
    chosen = [p for p in found if names[p] & set(only)]
    unknown = [n for n in only if not any(n in names[p] for p in found)]
    if unknown:
        raise ValueError(f"no notebook {', '.join(unknown)} in {folder}; choose from {', '.join(p.stem for p in found)}")
    return chosen


def rerun_command(path: Path) -> str:
    """The command that saves ``path`` again."""
    return f"{COMMAND} --only {path.stem.split('_')[0]}"


# -- provenance -----------------------------------------------------------------------------------
def cells_digest(nb: Any) -> str:
    """sha256 of the notebook's code cells: the sources its saved outputs came from."""
    sources = [c.source for c in nb.cells if c.cell_type == "code"]
    return hashlib.sha256(json.dumps(sources).encode()).hexdigest()


def source_digest(root: Path) -> str:
    """sha256 of the package's Python files and the views' browser files, by path and content."""
    digest = hashlib.sha256()
    files = sorted([*root.glob("nbscaler/**/*.py"), *root.glob("widgets/*.js"), *root.glob("widgets/*.css")])
    for f in files:
        digest.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()


def git_state(root: Path) -> Tuple[Optional[str], Optional[bool]]:
    """(HEAD's commit, whether files other than the notebooks differ from it), or Nones without git."""
    def git(*args: str) -> Optional[str]:
        try:
            done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    changes = git("status", "--porcelain", "--", ".", ":(exclude)notebooks") if commit else None
    return commit, (bool(changes) if changes is not None else None)


def provenance(nb: Any, root: Path) -> Dict[str, Any]:
    """What a notebook's outputs were produced with (``PROVENANCE_FIELDS``)."""
    import torch

    import nbscaler

    commit, dirty = git_state(root)
    return {"command": COMMAND, "nbscaler_version": nbscaler.__version__, "git_commit": commit, "git_dirty": dirty,
            "torch_version": torch.__version__, "python_version": platform.python_version(),
            "source_sha256": source_digest(root), "cells_sha256": cells_digest(nb)}


def provenance_problems(nb: Any) -> List[str]:
    """Why a saved notebook's provenance is missing or does not fit its cells (empty: it is fine)."""
    stamp = nb.metadata.get(METADATA_KEY)
    if not isinstance(stamp, dict):
        return [f"no provenance in its metadata (key '{METADATA_KEY}'): it was not saved by `{COMMAND}`"]
    missing = [f for f in PROVENANCE_FIELDS if f not in stamp]
    if missing:
        return [f"its provenance lacks {', '.join(missing)}"]
    if stamp["cells_sha256"] != cells_digest(nb):
        return ["its code cells were edited after it was saved: the outputs belong to other code"]
    return []


# -- fingerprints of the outputs ------------------------------------------------------------------
def output_fingerprints(nb: Any) -> Dict[int, List[Fingerprint]]:
    """Cell index -> the fingerprints its outputs carry, in output order (cells without any left out)."""
    out: Dict[int, List[Fingerprint]] = {}
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        found = [Fingerprint.from_json(o["data"][FINGERPRINT_MIME]) for o in cell.get("outputs", [])
                 if FINGERPRINT_MIME in o.get("data", {})]
        if found:
            out[i] = found
    return out


def stale_outputs(path: Path, saved: Any, fresh: Any) -> List[str]:
    """One line per cell whose saved plan tables differ from a fresh run's, naming what differs
    and the command that saves the notebook again (empty: the saved outputs show today's plans)."""
    before, now = output_fingerprints(saved), output_fingerprints(fresh)
    lines = []
    for i in sorted(set(before) | set(now)):
        old, new = before.get(i, []), now.get(i, [])
        if len(old) != len(new):
            notes = [f"{len(old)} plan table output(s) saved, {len(new)} now"]
        else:
            notes = [d for a, b in zip(old, new) for d in differences(a, b)]
        lines += [f"{path.stem} cell {i}: {note}" for note in notes]
    if lines:
        lines.append(f"the saved outputs show another nbscaler than this one: re-run `{rerun_command(path)}`")
    return lines


# -- running and saving ---------------------------------------------------------------------------
def kernel_env(root: Path) -> Dict[str, str]:
    """This process's environment with ``root`` first on PYTHONPATH: the kernel, and the engines
    and ranks it starts, import this checkout."""
    paths = [str(root), os.environ.get("PYTHONPATH", "")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}


def execute(path: Path, root: Path, timeout: int, log: Callable[[str], None]) -> Any:
    """Run ``path`` top to bottom in a fresh kernel and return the notebook with its new outputs;
    raises ``NotebookFailed`` at the first failing cell. The kernel starts in the notebook's folder,
    where ``make lab`` and Binder start a learner's kernel, so a relative path means what it means there."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(path, as_version=4)
    ncode = sum(c.cell_type == "code" for c in nb.cells)
    start = time.perf_counter()
    done = {"code": 0, "cell": None}

    def started(cell: Any, cell_index: int, **_: Any) -> None:
        done["cell"] = cell_index

    def executed(cell: Any, cell_index: int, **_: Any) -> None:
        done["code"] += 1
        log(f"  {path.stem}: cell {cell_index} ({done['code']}/{ncode} code cells), {time.perf_counter() - start:.1f} s")

    # record_timing off: timestamps in every cell would make each save a diff of everything. Widget
    # state is kept while running (nbclient routes an Output widget's captured output through it and
    # fails on the widget's id without it); ``save`` drops it.
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}},
                            on_cell_start=started, on_cell_executed=executed)
    try:
        client.execute(env=kernel_env(root))
    except CellExecutionError as e:
        raise NotebookFailed(f"{path.name}: cell {done['cell']} failed with {e.ename}: {e.evalue}\n{e}") from None
    except Exception as e:                      # a kernel that dies or does not start, a cell timeout
        where = "" if done["cell"] is None else f" in cell {done['cell']} ({_first_line(nb.cells[done['cell']])})"
        raise NotebookFailed(f"{path.name}: could not run it{where}, {time.perf_counter() - start:.0f} s in "
                             f"({type(e).__name__}: {e})") from e
    return nb


def _first_line(cell: Any) -> str:
    """The first line of a cell's source, for an error that must say which cell."""
    lines = [line for line in cell.source.splitlines() if line.strip()]
    return repr(lines[0][:80]) if lines else "empty"


def without_widget_state(nb: Any) -> None:
    """Drop the widgets' models and the outputs' references to them, keeping the HTML beside them.

    A widget needs its kernel: saved, its model is megabytes (a plotly figure's every point) that
    GitHub and nbviewer do not draw, and a reference to a model not saved shows as an error in
    JupyterLab. The self-contained HTML every view carries is what a reader without a kernel sees;
    running the notebook brings the widgets back."""
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            data = output.get("data", {})
            if WIDGET_VIEW_MIME in data and len(data) > 1:
                del data[WIDGET_VIEW_MIME]


def save(nb: Any, path: Path, root: Path) -> int:
    """Stamp ``nb``'s provenance, drop its widget state and write it to ``path`` atomically;
    returns its size in bytes. Over ``MAX_SAVED_BYTES`` nothing is written."""
    import nbformat

    from nbscaler.genfiles import atomic_write_bytes

    for cell in nb.cells:
        cell.metadata.pop("execution", None)    # timestamps of an older save
    without_widget_state(nb)
    nb.metadata[METADATA_KEY] = provenance(nb, root)
    nbformat.validate(nb)
    data = nbformat.writes(nb).encode()
    if len(data) >= MAX_SAVED_BYTES:
        raise NotebookFailed(f"{path.name} would be {len(data):,} bytes, over the {MAX_SAVED_BYTES:,} a saved "
                             f"notebook may have; the saved file is unchanged (show less, e.g. fewer or smaller charts)")
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
    atomic_write_bytes(path, data)
    os.chmod(path, mode)                        # the temporary file was private (mkstemp); readers are not
    return len(data)


def save_notebooks(only: Sequence[str] = (), folder: Optional[Path] = None, timeout: int = 600,
                   log: Callable[[str], None] = print) -> List[Path]:
    """Run and save the walkthroughs (all, or ``only`` those), one after the other; stops at the
    first that fails (``NotebookFailed``), leaving it and those after it as they were."""
    root = checkout_root()
    paths = notebook_paths(folder or root / "notebooks", only)
    saved = []
    for n, path in enumerate(paths, 1):
        log(f"[{n}/{len(paths)}] {path.name}: running in a fresh kernel")
        start = time.perf_counter()
        nb = execute(path, root, timeout, log)
        size = save(nb, path, root)
        log(f"[{n}/{len(paths)}] {path.name}: saved, {size:,} bytes, {time.perf_counter() - start:.1f} s")
        saved.append(path)
    return saved


def main(only: Sequence[str], folder: Optional[str], timeout: int) -> int:
    """``nbscaler notebooks``: 0 when every notebook was saved, 1 when one failed, 2 for bad names."""
    try:
        save_notebooks(only, Path(folder) if folder else None, timeout, log=lambda line: print(line, flush=True))
    except (FileNotFoundError, ValueError) as e:
        print(f"nbscaler notebooks: {e}", file=sys.stderr)
        return 2
    except NotebookFailed as e:
        print(f"nbscaler notebooks: {e}\nnbscaler notebooks: stopped; that notebook's saved file is unchanged",
              file=sys.stderr)
        return 1
    return 0
