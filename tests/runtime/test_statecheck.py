"""Checkpoint safety in one process (a plan with one rank needs no process group): a checkpoint
that does not fit is refused before anything is copied, files are written atomically and read
with ``weights_only=True``, and non-persistent buffers stay out of state dicts."""

import pickle

import pytest
import torch

from nbscaler import ComputeConfig, build_optimizer, load_merged_state_dicts, merge_state_dicts, parallelize
from nbscaler.runtime.checkpoint import load, save
from nbscaler.runtime.statecheck import CheckpointError
from tests.models import Llama, batch, build


def compile_llama(gen_dir, model=None, name="llama", vocab=64):
    tokens = {k: v % vocab for k, v in batch("llama", 1).items()}
    return parallelize(model or build("llama"), tokens, "dp", ComputeConfig(plan_ngpus=1, runtime_ngpus=1),
                       gen_savedir=str(gen_dir), instance_name=name)


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("gen")


@pytest.fixture
def trained(gen_dir):
    """A one-rank Llama and its AdamW after one step, so the optimizer has state."""
    pm = compile_llama(gen_dir)
    opt = build_optimizer(pm, torch.optim.AdamW, lr=0.01)
    pm(**batch("llama", 2)).backward()
    opt.step()
    return pm, opt


def snapshot(pm):
    return {k: v.clone() for k, v in pm.state_dict().items() if isinstance(v, torch.Tensor)}


def assert_unchanged(pm, before):
    for key, value in snapshot(pm).items():
        assert torch.equal(value, before[key]), f"{key} changed"


def test_another_models_state_is_refused_naming_the_tensor_and_both_shapes(gen_dir, trained):
    pm, _ = trained
    before = snapshot(pm)
    torch.manual_seed(0)
    other = compile_llama(gen_dir, Llama(vocab_size=32), name="small_vocab", vocab=32)
    with pytest.raises(CheckpointError, match=r"'embed.weight' \(whole, shape \(64, 32\)\) here, but 'embed.weight' "
                                              r"\(whole, shape \(32, 32\)\) in the checkpoint: the checkpoint belongs"):
        pm.load_state_dict(other.state_dict())
    assert_unchanged(pm, before)


def test_a_damaged_tensor_is_refused_before_anything_is_copied(trained):
    pm, _ = trained
    before = snapshot(pm)
    sd = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in pm.state_dict().items()}
    sd = {k: v.add(1) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}       # would change everything
    sd["blocks_1_mlp_w2_weight"] = torch.zeros(16, 64)
    with pytest.raises(CheckpointError, match=r"'blocks_1_mlp_w2_weight' \(blocks.1.mlp.w2.weight\) has shape "
                                              r"\(16, 64\) in the checkpoint, but \(32, 64\) here"):
        pm.load_state_dict(sd)
    assert_unchanged(pm, before)
    del sd["blocks_1_mlp_w2_weight"]
    with pytest.raises(CheckpointError, match="has no 'blocks_1_mlp_w2_weight'"):
        pm.load_state_dict(sd)
    assert_unchanged(pm, before)


def test_a_plain_torch_state_dict_is_refused_with_the_way_to_load_it(trained):
    pm, _ = trained
    with pytest.raises(CheckpointError, match="no nbscaler layout record.*load_merged_state_dicts"):
        pm.load_state_dict(build("llama").state_dict())


def test_optimizer_state_of_the_wrong_shape_is_refused(gen_dir, trained):
    pm, opt = trained
    osd = opt.state_dict()
    osd["state"][0]["exp_avg"] = torch.zeros(3)
    fresh = build_optimizer(pm, torch.optim.AdamW, lr=0.01)
    with pytest.raises(CheckpointError, match=r"optimizer state 'exp_avg' of 'embed.weight'.*\(3,\).*\(64, 32\)"):
        fresh.load_state_dict(osd)
    assert not fresh.state


def test_load_merged_checks_module_and_optimizer_before_copying(trained):
    pm, opt = trained
    sd, osd = merge_state_dicts([pm.state_dict()], [opt.state_dict()])
    before = snapshot(pm)
    fresh_opt = build_optimizer(pm, torch.optim.AdamW, lr=0.01)
    bad = {k: v + 1 for k, v in sd.items()}
    bad["norm.weight"] = torch.ones(5)
    with pytest.raises(CheckpointError, match=r"'norm.weight' has shape \(5,\) in the checkpoint, but \(32,\) here"):
        load_merged_state_dicts(pm, bad, fresh_opt, osd)
    bad_osd = {**osd, "state": {**osd["state"], 1: {**osd["state"][1], "exp_avg_sq": torch.ones(7)}}}
    with pytest.raises(CheckpointError, match=r"'exp_avg_sq' of 'blocks.0.attn_norm.weight' has shape \(7,\)"):
        load_merged_state_dicts(pm, {k: v + 1 for k, v in sd.items()}, fresh_opt, bad_osd)
    assert_unchanged(pm, before)
    assert not fresh_opt.state
    load_merged_state_dicts(pm, sd, fresh_opt, osd)
    assert_unchanged(pm, before)
    assert torch.equal(fresh_opt.state_dict()["state"][3]["exp_avg"], opt.state_dict()["state"][3]["exp_avg"])


def test_files_are_written_atomically_and_read_weights_only(tmp_path, trained):
    pm, opt = trained
    target = tmp_path / "ckpt.pt"
    save((pm.state_dict(), opt.state_dict()), target)
    good = target.read_bytes()
    with pytest.raises(Exception):
        save({"fn": lambda: None}, target)                  # fails while writing: the old file stays
    assert target.read_bytes() == good and [p.name for p in tmp_path.iterdir()] == ["ckpt.pt"]
    sd, osd = load(target)
    assert torch.equal(sd["embed_weight"], pm.embed_weight.detach()) and osd["state"]

    target.write_bytes(good[: len(good) // 2])
    with pytest.raises(CheckpointError, match=f"cannot read the checkpoint {target}.*damaged or incomplete"):
        load(target)
    target.write_bytes(pickle.dumps(ValueError("runs code when unpickled"), protocol=2))
    with pytest.raises(CheckpointError, match="cannot read the checkpoint"):
        load(target)


def test_non_persistent_buffers_stay_out_of_checkpoints(gen_dir, trained):
    """They are not saved, so loading leaves them as construction made them: filled with
    init_params=True, untouched (here: a marker) with init_params=False."""
    pm, _ = trained
    sd = pm.state_dict()
    assert "blocks_0_attn_cos" not in sd and "blocks_0_attn_cos" in dict(pm.named_buffers())
    merged, _ = merge_state_dicts([sd])
    assert "blocks.0.attn.cos" not in merged
    build("llama").load_state_dict(merged)                  # the original module takes it as is

    empty = type(pm)(init_params=False)
    empty.blocks_0_attn_cos.fill_(-7.0)
    empty.load_state_dict(sd)
    assert torch.equal(empty.embed_weight, pm.embed_weight)
    assert bool((empty.blocks_0_attn_cos == -7.0).all())
    initialized = type(pm)(init_params=True)
    initialized.load_state_dict(sd)
    assert torch.equal(initialized.blocks_0_attn_cos, build("llama").blocks[0].attn.cos)
