"""The tool that saves the walkthroughs and the checks the suite runs on them, on small notebooks
made here: provenance, stale outputs named by cell, files never half-written."""

import subprocess
import sys

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

import nbscaler
import nbscaler.walkthroughs as walkthroughs
from nbscaler import ComputeConfig
from nbscaler.models.gpt import GPT, GPTConfig, sample_batch
from nbscaler.planning.fingerprint import FINGERPRINT_MIME, bundle, of_frames
from nbscaler.walkthroughs import (METADATA_KEY, NotebookFailed, checkout_root, notebook_paths, provenance,
                                   provenance_problems, save, stale_outputs)

ROOT = checkout_root()
MODEL = GPTConfig(n_layer=1, d_model=32, n_head=2, seq_len=16, vocab_size=64)


@pytest.fixture(scope="module")
def plans():
    tp = nbscaler.plan(GPT(MODEL), {"batch": sample_batch(MODEL, 2)}, "tp", ComputeConfig(2, 2))
    return tp, tp.replan("data", ComputeConfig(2, 2))


def shown(plan) -> dict:
    """A cell's output showing ``plan``'s ops and collectives, as a kernel would."""
    return new_output("execute_result", {"text/plain": repr(plan), **bundle(of_frames(plan.ops, plan.collectives))},
                      execution_count=1)


def notebook(*outputs) -> nbformat.NotebookNode:
    return new_notebook(cells=[new_markdown_cell("# a walkthrough"), new_code_cell("plan", outputs=list(outputs)),
                               new_code_cell("print(1)", outputs=[new_output("stream", text="1\n")])])


def test_stale_outputs_name_the_notebook_the_cell_and_the_rows(plans, tmp_path):
    tp, data = plans
    path = tmp_path / "01_tour.ipynb"
    assert stale_outputs(path, notebook(shown(tp)), notebook(shown(tp))) == []
    found = stale_outputs(path, notebook(shown(data)), notebook(shown(tp)))
    assert found[0].startswith("01_tour cell 1: collectives differ (") and found[1].startswith("01_tour cell 1: ops differ (")
    assert found[-1].endswith("re-run `python -m nbscaler.cli notebooks --only 01`")
    # Saved before outputs carried fingerprints, or showing a plan no longer shown: stale too.
    assert stale_outputs(path, notebook(), notebook(shown(tp)))[0] == "01_tour cell 1: 0 plan table output(s) saved, 1 now"
    assert stale_outputs(path, notebook(shown(tp)), notebook())[0].startswith("01_tour cell 1: 1 plan table")


def test_provenance_says_what_made_the_outputs_and_fits_the_cells():
    nb = notebook()
    assert "no provenance" in provenance_problems(nb)[0]
    nb.metadata[METADATA_KEY] = provenance(nb, ROOT)
    stamp = nb.metadata[METADATA_KEY]
    assert provenance_problems(nb) == []
    assert stamp["nbscaler_version"] == nbscaler.__version__ and stamp["torch_version"].startswith("2.")
    assert stamp["git_commit"] is None or len(stamp["git_commit"]) == 40
    nb.cells[1].source = "plan.ops"
    assert "edited after it was saved" in provenance_problems(nb)[0]
    nb.cells[0].source = "markdown is not code"
    del nb.metadata[METADATA_KEY]["torch_version"]
    assert "lacks torch_version" in provenance_problems(nb)[0]


def test_notebooks_are_chosen_by_number_or_name(tmp_path):
    for name in ("01_tour", "02_dp", "10_more"):
        nbformat.write(notebook(), tmp_path / f"{name}.ipynb")
    assert [p.stem for p in notebook_paths(tmp_path)] == ["01_tour", "02_dp", "10_more"]
    assert [p.stem for p in notebook_paths(tmp_path, ["10", "01_tour"])] == ["01_tour", "10_more"]
    with pytest.raises(ValueError, match="no notebook 3 in .*choose from 01_tour, 02_dp, 10_more"):
        notebook_paths(tmp_path, ["3"])


def test_save_stamps_drops_widget_state_and_never_writes_an_oversized_file(plans, tmp_path, monkeypatch):
    path = tmp_path / "01_tour.ipynb"
    path.write_text("the saved notebook")
    path.chmod(0o640)
    nb = notebook(shown(plans[0]))
    nb.cells[1].outputs[0]["data"][walkthroughs.WIDGET_VIEW_MIME] = {"model_id": "abc", "version_major": 2,
                                                                      "version_minor": 0}
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    monkeypatch.setattr(walkthroughs, "MAX_SAVED_BYTES", 1000)
    with pytest.raises(NotebookFailed, match="over the 1,000 .* unchanged"):
        save(nb, path, ROOT)
    assert path.read_text() == "the saved notebook" and [p.name for p in tmp_path.iterdir()] == [path.name]
    monkeypatch.undo()
    save(nb, path, ROOT)
    back = nbformat.read(path, as_version=4)
    assert provenance_problems(back) == [] and "widgets" not in back.metadata
    assert set(back.cells[1].outputs[0]["data"]) == {"text/plain", FINGERPRINT_MIME}
    assert path.stat().st_mode & 0o777 == 0o640              # as the saved file was


@pytest.mark.notebook
@pytest.mark.timeout(300)
def test_the_command_saves_what_runs_and_leaves_a_failing_notebook_as_it_was(tmp_path):
    good = new_notebook(cells=[new_code_cell(
        "import os, nbscaler, torch\n"
        f"assert nbscaler.__file__.startswith({str(ROOT)!r}), nbscaler.__file__   # the kernel imports this checkout\n"
        f"assert os.getcwd() == {str(tmp_path.resolve())!r}, os.getcwd()   # and starts in the notebook's folder, as Lab and Binder do\n"
        "from nbscaler.models.gpt import GPT, GPTConfig, sample_batch\n"
        "cfg = GPTConfig(n_layer=1, d_model=32, n_head=2, seq_len=16, vocab_size=64)\n"
        "nbscaler.plan(GPT(cfg), {'batch': sample_batch(cfg, 2)}, 'tp', nbscaler.ComputeConfig(2, 2)).ops")])
    bad = new_notebook(cells=[new_code_cell("1 + 1"), new_code_cell("raise ValueError('not today')")])
    nbformat.write(good, tmp_path / "01_good.ipynb")
    nbformat.write(bad, tmp_path / "02_bad.ipynb")
    before = (tmp_path / "02_bad.ipynb").read_bytes()
    done = subprocess.run([sys.executable, "-m", "nbscaler.cli", "notebooks", "--folder", str(tmp_path)],
                          capture_output=True, text=True, timeout=280)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "[1/2] 01_good.ipynb: saved" in done.stdout and "01_good: cell 0 (1/1 code cells)" in done.stdout
    assert "02_bad.ipynb: cell 1 failed with ValueError: not today" in done.stderr
    assert (tmp_path / "02_bad.ipynb").read_bytes() == before
    saved = nbformat.read(tmp_path / "01_good.ipynb", as_version=4)
    assert provenance_problems(saved) == []
    assert list(saved.cells[0].outputs[0]["data"][FINGERPRINT_MIME]["tables"]) == ["ops"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["01_good.ipynb", "02_bad.ipynb"]


@pytest.mark.notebook
@pytest.mark.timeout(120)
def test_a_cell_that_outlives_its_timeout_is_named_with_the_time_taken(tmp_path):
    path = tmp_path / "01_hang.ipynb"
    nbformat.write(new_notebook(cells=[new_code_cell("1 + 1"), new_code_cell("import threading\n\nthreading.Event().wait()")]),
                   path)
    with pytest.raises(NotebookFailed, match=r"01_hang.ipynb: could not run it in cell 1 \('import threading'\), \d+ s in "
                                             r"\(CellTimeoutError"):
        walkthroughs.execute(path, ROOT, timeout=3, log=lambda line: None)
