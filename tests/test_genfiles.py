"""The weights file: written once, shared by key across module folders, never shared by mistake."""

import torch

import nbscaler.genfiles as genfiles
from nbscaler import ComputeConfig, parallelize
from nbscaler.genfiles import WEIGHTS_FILE, module_dir, weights_key, weights_store
from tests.models import MLP, batch, build


def _compile(model, tmp_path, instance, policy="tp"):
    parallelize(model, batch("mlp", 0), policy, ComputeConfig(2, 2), gen_savedir=tmp_path, load_module=False,
                instance_name=instance, reuse="override")
    return module_dir(MLP, tmp_path, instance) / WEIGHTS_FILE


def _saved_equals(path, model) -> bool:
    saved = torch.load(path, weights_only=True)
    return all(torch.equal(saved[n], p.detach()) for n, p in model.named_parameters())


def test_another_instance_with_the_same_weights_links_the_same_file(tmp_path):
    model = build("mlp")
    first = _compile(model, tmp_path, "run1")
    second = _compile(model, tmp_path, "run2", policy="data")
    assert first.stat().st_ino == second.stat().st_ino                  # written once
    assert [p.stat().st_ino for p in weights_store(first.parent).glob("*.pt")] == [first.stat().st_ino]
    assert _saved_equals(second, model)


def test_changed_weights_are_written_and_the_stale_entry_dropped(tmp_path):
    model = build("mlp")
    first = _compile(model, tmp_path, "run1")
    inode = first.stat().st_ino
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    first = _compile(model, tmp_path, "run1")                            # replaces the only user of the old file
    assert first.stat().st_ino != inode and _saved_equals(first, model)
    entries = list(weights_store(first.parent).glob("*.pt"))
    assert [p.stat().st_ino for p in entries] == [first.stat().st_ino]
    assert entries[0].name == f"{weights_key(torch.load(first, weights_only=True))}.pt"


def test_a_key_collision_costs_a_write_not_wrong_weights(tmp_path, monkeypatch):
    monkeypatch.setattr(genfiles, "weights_key", lambda weights: "same")
    model = build("mlp")
    first = _compile(model, tmp_path, "run1")
    with torch.no_grad():
        next(model.parameters()).mul_(-2.0)
    second = _compile(model, tmp_path, "run2")
    assert first.stat().st_ino != second.stat().st_ino and _saved_equals(second, model)
    assert not _saved_equals(first, model)                               # the first folder kept its own file


def test_weights_key_follows_values_dtypes_and_names():
    a = {"w": torch.arange(10.0), "b": torch.zeros(3, dtype=torch.bfloat16), "s": torch.tensor(2)}
    assert weights_key(a) == weights_key({k: v.clone() for k, v in a.items()})
    assert weights_key(a) != weights_key({**a, "w": torch.arange(10.0) + 1})
    assert weights_key(a) != weights_key({**a, "w": torch.arange(10.0).double()})
    assert weights_key(a) != weights_key({"v" if k == "w" else k: v for k, v in a.items()})
