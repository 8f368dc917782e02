"""Nothing nbscaler reads back runs code: a planted pickle is refused, naming the file and the fix,
before anything in it is called."""

import collections
import pickle
import warnings

import numpy as np
import pytest
import torch

from nbscaler import ComputeConfig, Recipe, parallelize, safeload
from nbscaler.cost.hardware import Hardware
from nbscaler.genfiles import CONSTANTS_FILE, GRAPH_FILE, GenDir, module_dir
from nbscaler.layouts import ContextKind
from nbscaler.models.gpt import GPT, GPTConfig, sample_batch
from nbscaler.planning.saved import SavedPlanError, load_plan
from nbscaler.runtime.checkpoint import load as load_checkpoint
from nbscaler.runtime.sources import TorchFile
from nbscaler.runtime.statecheck import CheckpointError
from tests.models import MLP, batch, build


class Planted:
    """Creates ``marker`` when unpickled: what a malicious file would do instead."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _compile(tmp_path, model=None, args=None, **kwargs):
    parallelize(model or build("mlp"), args or batch("mlp", 0), "tp", ComputeConfig(2, 2), gen_savedir=tmp_path,
                load_module=False, **kwargs)
    return module_dir(type(model or build("mlp")), tmp_path, None)


def test_graphs_read_back_as_written(tmp_path):
    folder = _compile(tmp_path)
    graphs = GenDir(folder).read_graphs()
    assert (folder / GRAPH_FILE).read_bytes().startswith(safeload.GRAPH_MAGIC)
    plan = load_plan(folder)
    assert [n.name for n in plan.graph.nodes] == [n.name for n in next(iter(graphs.values())).nodes]
    constants = {"bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "empty": torch.zeros(0, 2),
                 "scalar": torch.tensor(True), "meta": torch.empty(3, device="meta")}
    (tmp_path / "g.pkl").write_bytes(safeload.dump_graphs({"g": constants}))
    back = safeload.load_graphs(tmp_path / "g.pkl")["g"]
    assert all(torch.equal(back[k], constants[k]) for k in ("bf16", "empty", "scalar"))
    assert back["meta"].is_meta and back["meta"].shape == (3,)
    # what autodist's search on a target records in graph.meta
    target = {"hardware": Hardware.named("H100-SXM-80GB"), "recipe": Recipe(torch.optim.SGD, master_dtype=None),
              "row": {"tp": np.int64(2), "fits": np.bool_(True)}}
    (tmp_path / "t.pkl").write_bytes(safeload.dump_graphs(target))
    assert safeload.load_graphs(tmp_path / "t.pkl") == {**target, "row": {"tp": 2, "fits": True}}


@pytest.mark.parametrize("framed", [False, True], ids=["old-style pickle", "with this nbscaler's header"])
def test_a_planted_graph_file_is_refused(tmp_path, framed):
    folder = _compile(tmp_path)
    marker = tmp_path / "ran"
    body = pickle.dumps({"train": Planted(marker)})
    good = (folder / GRAPH_FILE).read_bytes()
    header = good[: good.index(b"\n", len(safeload.GRAPH_MAGIC)) + 1]
    (folder / GRAPH_FILE).write_bytes(header + body if framed else body)
    with pytest.raises(SavedPlanError, match=f"{folder / GRAPH_FILE} .*reuse='override'"):
        load_plan(folder)
    with pytest.raises(safeload.RefusedFile, match=f"{folder / GRAPH_FILE} .*reuse='override'"):
        _compile(tmp_path, reuse="graph")
    assert not marker.exists()
    _compile(tmp_path, reuse="override")                     # the fix the message names
    assert load_plan(folder).graph.nodes


def test_a_graph_file_of_another_format_is_refused(tmp_path):
    folder = _compile(tmp_path)
    data = (folder / GRAPH_FILE).read_bytes()
    (folder / GRAPH_FILE).write_bytes(data.replace(b'{"format": 1}', b'{"format": 99}', 1))
    with pytest.raises(SavedPlanError, match="format 99, written by another version .*reads format 1 only; compile"):
        load_plan(folder)


Out = collections.namedtuple("Out", "logits")


class Named(torch.nn.Module):
    """Returns its own type, which a graph file may not name."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 4)

    def forward(self, x, y):
        return Out(self.fc(x))


def test_graphs_of_a_users_type_are_left_out_with_a_warning(tmp_path):
    refusal = r"graph.pkl was not written: .*tests.test_safeload.Out.*reuse='graph' will trace"
    with pytest.warns(UserWarning, match=refusal):
        folder = _compile(tmp_path, Named(), batch("mlp", 0))
    assert not (folder / GRAPH_FILE).exists() and (folder / "gencode0.py").exists()
    with warnings.catch_warnings(record=True):
        _compile(tmp_path, Named(), batch("mlp", 0), reuse="graph")      # traces again, no error
    with pytest.raises(SavedPlanError, match="leaves it out"):
        load_plan(folder)


def test_a_planted_checkpoint_is_refused(tmp_path):
    marker, path = tmp_path / "ran", tmp_path / "ckpt.pt"
    torch.save({"w": torch.ones(2), "x": Planted(marker)}, path)
    with pytest.raises(CheckpointError, match=f"cannot read the checkpoint {path} holds objects other than tensors"
                                              ".*checkpoint.save"):
        load_checkpoint(path)
    with pytest.raises(safeload.RefusedFile, match=f"{path} holds objects .*safetensors"):
        TorchFile(path)                                       # parallelize(weights=path)
    assert not marker.exists()


def test_a_planted_constants_file_is_refused(tmp_path):
    """A meta-built module's ranks read the traced constants from the folder."""
    from nbscaler.parallel import _weights_source

    marker, path = tmp_path / "ran", tmp_path / CONSTANTS_FILE
    torch.save(Planted(marker), path)
    with pytest.raises(safeload.RefusedFile, match=f"{path} holds objects .*reuse='override'"):
        _weights_source(MLP(), None, 0, constants=path)
    assert not marker.exists()


GPT_SMALL = GPTConfig(n_layer=1, d_model=32, n_head=2, seq_len=16, vocab_size=64)
DIMENSIONS = {
    "cp ring": ("gpt", {"context_parallel": 2, "context_parallel_kind": "ring"}),
    "cp all_gather": ("gpt", {"context_parallel": 2, "context_parallel_kind": "all_gather"}),
    "sequence parallel": ("gpt", {"sequence_parallel": True}),
    "ep dropless": ("moe", {"expert_parallel": 2}),
    "ep capacity": ("moe_capacity", {"expert_parallel": 2}),
}


@pytest.mark.parametrize("dimension", list(DIMENSIONS))
def test_every_dimension_s_graphs_are_written_and_read_back(tmp_path, dimension):
    """A plan of each dimension keeps its graph file (its meta names nbscaler's vocabularies, such as
    ``ContextKind``), so ``reuse='graph'`` and ``load_plan`` work for it as for any other."""
    name, pas_config = DIMENSIONS[dimension]
    model, args = (GPT(GPT_SMALL), {"batch": sample_batch(GPT_SMALL, 2)}) if name == "gpt" else (build(name), batch(name, 0))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*was not written")
        parallelize(model, args, "tp", ComputeConfig(2, 2, pas_config=pas_config), gen_savedir=tmp_path, load_module=False)
    folder = module_dir(type(model), tmp_path, None)
    graph = next(iter(GenDir(folder).read_graphs().values()))
    written = {n.name: n.meta for n in load_plan(folder).graph.nodes}
    assert [n.name for n in graph.nodes] == list(written) and written
    kinds = [m["context_kind"] for m in written.values() if "context_kind" in m]
    if "context_parallel_kind" in pas_config:
        assert kinds and all(k is ContextKind(pas_config["context_parallel_kind"]) for k in kinds), kinds
