"""Weight sources and the seeded initialisation, in one process: what ``parallelize`` writes for a
module built on meta, the checks on ``weights=`` before anything is written, each kind of file,
and the initialisation rule (plan-independent, tied tensors, a clear error where it cannot apply)."""

import json

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file

from nbscaler import ComputeConfig, parallelize
from nbscaler.genfiles import WEIGHTS_FILE
from nbscaler.models.llama import Llama, LlamaConfig, sample_batch
from nbscaler.runtime.checkpoint import save
from nbscaler.runtime.initialize import init_module, initial_tensors, module_seed
from nbscaler.runtime.module import WeightSpec
from nbscaler.runtime.sources import Safetensors, TorchFile

CFG = LlamaConfig(vocab_size=64, seq_len=16, n_layer=2, d_model=32, n_head=4, n_kv_head=2)


def meta_llama() -> Llama:
    with torch.device("meta"):
        return Llama(CFG)


def compile_one(model, tmp_path, **kwargs):
    return parallelize(model, sample_batch(CFG, 2), "tp", ComputeConfig(1, 1), gen_savedir=str(tmp_path / "gen"),
                       reuse="override", **kwargs)


def assert_same_values(pm, reference: nn.Module) -> None:
    values = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    for attr, spec in pm.weight_specs.items():
        assert torch.equal(getattr(pm, attr), values[spec.name]), spec.name


def test_meta_module_without_weights_is_its_seeded_initialisation(tmp_path):
    pm = compile_one(meta_llama(), tmp_path, init_seed=3)
    assert_same_values(pm, init_module(Llama(CFG), 3))
    folder = next((tmp_path / "gen").rglob("config.json")).parent
    assert not (folder / WEIGHTS_FILE).exists()
    assert json.loads((folder / "config.json").read_text())["weights"] == {"source": "init", "seed": 3}
    assert "GenModule.weights_source = {'seed': 3, 'source': 'init'}" in (folder / "gencode0.py").read_text()
    assert type(pm).weights_source == {"source": "init", "seed": 3}


@pytest.mark.parametrize("kind", ["safetensors", "merged"])
def test_meta_module_loads_a_checkpoint_file(kind, tmp_path):
    torch.manual_seed(0)
    original = Llama(CFG)
    if kind == "safetensors":
        path = tmp_path / "model.safetensors"
        save_file(original.state_dict(), str(path))
    else:                                      # a merged checkpoint: the module state dict, torch.save'd
        path = tmp_path / "merged.pt"
        save(original.state_dict(), path)
    pm = compile_one(meta_llama(), tmp_path, weights=path)
    assert_same_values(pm, original)           # the rotary tables, in no checkpoint, are computed
    config = next((tmp_path / "gen").rglob("config.json")).read_text()
    assert json.loads(config)["weights"]["path"] == str(path)


@pytest.mark.parametrize("change, message", [
    (lambda sd: sd.pop("norm.weight"), "'norm.weight' is missing from"),
    (lambda sd: sd.__setitem__("head.weight", torch.zeros(64, 16)), r"'head.weight' has shape \(64, 16\)"),
    (lambda sd: sd.__setitem__("extra.weight", torch.zeros(2)), "holds 'extra.weight', which the module does not have"),
])
def test_a_checkpoint_that_does_not_fit_is_named_and_nothing_is_written(change, message, tmp_path):
    state = Llama(CFG).state_dict()
    change(state)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=message):
        compile_one(meta_llama(), tmp_path, weights=tmp_path / "model.safetensors")
    assert not (tmp_path / "gen").exists()


def test_slice_reads_take_what_take_takes(tmp_path):
    """Reading a slice from the file gives ``WeightSpec.take`` of the whole tensor, strided blocks too."""
    full = torch.randn(64, 6)
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    files = [Safetensors(tmp_path / "w.safetensors")]
    save({"w": full}, tmp_path / "w.pt")
    files.append(TorchFile(tmp_path / "w.pt"))
    for blocks in (1, 4, (2, 1, 1)):
        for dim, parts in ((0, 2), (0, 4), (1, 3)):
            if dim == 1 and blocks != 1:
                continue
            for index in range(parts):
                spec = WeightSpec("w", "param", (64, 6), torch.float32, tuple(range(parts)), dim, parts, index,
                                  blocks=blocks)
                for source in files:
                    assert torch.equal(source.read(spec), spec.take(full)), (source, blocks, dim, parts, index)


def test_slices_cut_twice_read_only_their_boxes(tmp_path):
    """Experts cut by expert and by hidden unit (strided in gate and up halves): the file read gives
    ``take`` of the whole tensor, and the slices of every device join back to it."""
    full = torch.randn(4, 6, 8)                                 # (experts, d, 2 x hidden)
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    source = Safetensors(tmp_path / "w.safetensors")
    specs = [WeightSpec("w", "param", (4, 6, 8), torch.float32, tuple(range(4)), 0, 4, index,
                        inner_dim=2, inner_parts=2, inner_blocks=2) for index in range(4)]
    pieces = [spec.take(full) for spec in specs]
    assert pieces[1].shape == (2, 6, 4) and torch.equal(pieces[1], torch.cat([full[:2, :, 2:4], full[:2, :, 6:8]], 2))
    assert all(torch.equal(source.read(spec), piece) for spec, piece in zip(specs, pieces))
    assert torch.equal(specs[0].join(pieces), full)
    assert WeightSpec.from_dict(specs[3].to_dict()) == specs[3]


def test_initialisation_depends_on_the_seed_and_the_module_path_only():
    model = Llama(CFG)
    first = initial_tensors(model, "blocks.1.attn.q", 5)["weight"]
    init_module(model, 9)                                   # other modules, other seeds, in any order
    assert torch.equal(initial_tensors(model, "blocks.1.attn.q", 5)["weight"], first)
    assert not torch.equal(initial_tensors(model, "blocks.0.attn.q", 5)["weight"], first)
    assert not torch.equal(initial_tensors(model, "blocks.1.attn.q", 6)["weight"], first)
    assert module_seed(5, "blocks.1.attn.q") != module_seed(5, "blocks.0.attn.q")


def test_tied_tensors_stay_tied():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.head = nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight

    with torch.device("meta"):
        model = Tied()
    init_module(model, 0)
    assert model.head.weight is model.embed.weight and not model.embed.weight.is_meta
    assert torch.equal(model.embed.weight, initial_tensors(Tied(), "embed", 0)["weight"])


def test_a_module_without_initialisation_is_named():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.scale = Scale()

    with torch.device("meta"):
        model = Net()
    with pytest.raises(RuntimeError, match=r"'scale' \(Scale\).*reset_parameters\(\).*weights=PATH"):
        init_module(model, 0)
