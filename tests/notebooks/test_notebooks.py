"""Every walkthrough in notebooks/ runs top to bottom in a fresh kernel, as a reader would run it, and
each one checks its own numbers in its cells (an ``assert`` that fails is an error output, and fails
the test). The saved copies, read on GitHub without a kernel, are checked without running anything:
saved by ``python -m nbscaler.cli notebooks``, from the cells they hold; and each run compares the
plan tables its outputs show (ops, collectives, memory, code; never seconds) with the saved ones."""

import shutil
from pathlib import Path

import nbformat
import pytest

from nbscaler.walkthroughs import (MAX_SAVED_BYTES, NOTEBOOK_PATTERN, execute, provenance_problems, rerun_command,
                                   stale_outputs)

ROOT = Path(__file__).parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob(NOTEBOOK_PATTERN))


def _needs(path: Path):
    """What a notebook needs beyond the project's own dependencies."""
    if path.stem.startswith("10_"):
        has_mpi = shutil.which("mpiexec") is not None and _importable("mpi4py")
        return pytest.mark.skipif(not has_mpi, reason="needs mpiexec and mpi4py (apt-get install openmpi-bin; "
                                                     "pip install 'nbscaler[mpi]')")
    return []


def _importable(module: str) -> bool:
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def _errors(nb) -> list:
    return [f"cell {i}: {o.get('ename')}: {o.get('evalue')}" for i, cell in enumerate(nb.cells)
            if cell.cell_type == "code" for o in cell.get("outputs", []) if o.get("output_type") == "error"]


def test_the_walkthroughs_are_all_there():
    """Numbered from 01 on with no gap, at least the ten walkthroughs of the first release."""
    numbers = [p.stem[:2] for p in NOTEBOOKS]
    assert len(numbers) >= 10 and numbers == [f"{i:02d}" for i in range(1, len(numbers) + 1)], \
        [p.name for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_saved_with_outputs_small_and_clean(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), f"{path.name} was saved without running every cell"
    assert sum(bool(c.get("outputs")) for c in code) >= len(code) // 2, f"{path.name} has few saved outputs"
    assert not _errors(nb), _errors(nb)
    assert path.stat().st_size < MAX_SAVED_BYTES, f"{path.name} is {path.stat().st_size:,} bytes"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_saved_with_provenance_from_its_cells(path):
    problems = provenance_problems(nbformat.read(path, as_version=4))
    assert not problems, f"{path.name}: {problems[0]}; re-run `{rerun_command(path)}`"


@pytest.mark.notebook
@pytest.mark.cluster
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", [pytest.param(p, marks=_needs(p)) for p in NOTEBOOKS], ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
    saved = nbformat.read(path, as_version=4)
    # As the saving command runs it: a fresh kernel, started in notebooks/ as a learner's is, that
    # (with the engines it starts) imports this checkout; raises NotebookFailed at the first failing cell.
    nb = execute(path, ROOT, timeout=300, log=lambda line: None)
    assert not _errors(nb), _errors(nb)
    stale = stale_outputs(path, saved, nb)
    assert not stale, "\n".join(stale)
