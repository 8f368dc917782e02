"""Modules built on the meta device are materialised per rank, and train exactly like one process.

Each case builds its model under ``torch.device('meta')`` on every rank and parallelizes it with
``weights=`` a safetensors checkpoint (transformers' Llama and Qwen2 saved by ``save_pretrained`` in
shards with an index; the shipped GPT and Llama in one file) or with no weights at all (the module's own
initialisation, per rank, seeded). The reference is the same model in one process, loaded from the
same files or initialised whole by ``init_module`` with the same seed: losses, merged gradients and
final parameters over 3 steps must agree (``tests.multiprocess.check_equivalence``). Each rank must
read from the checkpoint exactly the bytes of the slices it holds, and start from exactly its slices
of the reference's values.
"""

import pytest
import torch

from nbscaler.runtime.checkpoint import merge_slices
from tests.multiprocess import (INIT, Case, check_equivalence, pipeline, reference_model, run_ranks, save_checkpoint, zero,
                                train_materialised)


def checkpoints(tmp_path, *names):
    return {name: save_checkpoint(name, str(tmp_path / "checkpoints" / name)) for name in names}


def check_materialised(case: Case, per_rank) -> None:
    """Every rank started from its slices of the reference's values, reading only its share."""
    check_equivalence(case, per_rank)
    reference = reference_model(case)
    expected = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    merged = merge_slices(piece for res in per_rank for piece in res["initial"])
    for name, value in merged.items():
        assert torch.equal(value, expected[name].detach()), f"{case}: rank slices of {name} differ"
    whole = sum(t.numel() * t.element_size() for t in reference.state_dict().values())
    for rank, res in enumerate(per_rank):
        if case.weights == INIT:
            assert res["read_bytes"] == 0, f"{case}: rank {rank} read a checkpoint it was not given"
            continue
        assert res["read_bytes"] == res["share_bytes"], f"{case}: rank {rank} read {res['read_bytes']} bytes " \
                                                        f"for slices of {res['share_bytes']}"
        if case.policy != "dp":
            assert res["share_bytes"] < whole, f"{case}: rank {rank} holds the whole model"


@pytest.mark.multiprocess
def test_meta_models_train_like_one_process_on_two_ranks(tmp_path):
    files = checkpoints(tmp_path, "hf_llama", "hf_qwen2", "llama", "gpt")
    cases = [Case("hf_llama", "tp", 2, 2, weights=files["hf_llama"]),
             Case("hf_qwen2", "tp", 2, 2, weights=files["hf_qwen2"]),
             Case("hf_llama", "pp", 2, 2, config=pipeline("1f1b", 2, 2), weights=files["hf_llama"]),
             Case("llama", "dp", 1, 2, weights=files["llama"]),
             Case("gpt", "tp", 2, 2, weights=files["gpt"]),
             Case("llama", "tp", 2, 2, weights=INIT),
             Case("hf_llama", "tp", 2, 2, weights=INIT),
             Case("hf_llama", "dp", 1, 2, config=zero(stage=3), weights=files["hf_llama"]),     # unit by unit
             Case("llama", "dp", 1, 2, config=zero(stage=3), weights=INIT)]
    per_rank = run_ranks(train_materialised, 2, cases, str(tmp_path), timeout=600)
    for i, case in enumerate(cases):
        check_materialised(case, [res[i] for res in per_rank])


@pytest.mark.multiprocess
def test_meta_models_train_like_one_process_on_four_ranks(tmp_path):
    """Two stages of 2-way tensor parallelism, and 2-way tensor parallelism in 2 data-parallel units."""
    files = checkpoints(tmp_path, "hf_llama", "gpt")
    cases = [Case("hf_llama", "hybrid", 4, 4, config=pipeline("1f1b", 2, 4), weights=files["hf_llama"]),
             Case("gpt", "tp", 2, 4, weights=files["gpt"]),
             Case("gpt", "hybrid", 4, 4, config=pipeline("1f1b", 2, 4), weights=INIT)]
    per_rank = run_ranks(train_materialised, 4, cases, str(tmp_path), timeout=600)
    for i, case in enumerate(cases):
        check_materialised(case, [res[i] for res in per_rank])


LOADED_LLAMA = dict(vocab_size=8000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                    num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=16)


def _meta_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    from tests.models.hf import LossOf
    with torch.device("meta"):
        return LossOf(LlamaForCausalLM(LlamaConfig(**LOADED_LLAMA)))


def load_share(folder: str, gen_dir: str) -> dict:
    """One rank: parallelize a meta-built Llama from ``folder`` under tp; the bytes of the
    parameters it holds, and how far its own (anonymous) memory and the checkpoint's pages it
    held mapped (file-backed) grew while loading."""
    import nbscaler
    from tests.resident import MB, PeakResident, resident_mb
    model, ids = _meta_llama(), torch.zeros(1, 8, dtype=torch.long)
    batch = {"batch": {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}}
    before = resident_mb()
    with PeakResident() as loading:
        model = nbscaler.parallelize(model, batch, "tp", nbscaler.ComputeConfig(plan_ngpus=2, runtime_ngpus=2),
                                     gen_savedir=gen_dir, reuse="override", weights=folder)
    return {"param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "growth_bytes": (loading.peak["RssAnon"] - before["RssAnon"]) * MB,
            "mapped_bytes": (loading.peak["RssFile"] - before["RssFile"]) * MB}


@pytest.mark.multiprocess
def test_each_rank_holds_and_allocates_only_its_share_of_a_checkpoint(tmp_path):
    """A 245 MB Llama loaded on 2 tp ranks: each rank's parameters are half of every matrix (the
    embedding and the head split by vocabulary) plus the norms' vectors whole, and its own memory
    grows by about that while loading, far from the whole model: no rank ever materialises it. Nor
    does it keep the checkpoint's pages mapped: a slice of a row-parallel weight touches every page
    of the tensor, and those pages count in the rank's RSS while the file stays open (with the files
    held open for the whole load, the rank's peak RSS came within 10% of the whole model on 4 ranks)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    folder = str(tmp_path / "checkpoint")
    torch.manual_seed(0)
    whole_model = LlamaForCausalLM(LlamaConfig(**LOADED_LLAMA))
    whole_model.save_pretrained(folder, safe_serialization=True, max_shard_size="100MB")
    del whole_model
    params = list(_meta_llama().parameters())
    whole = sum(p.numel() * p.element_size() for p in params)
    vectors = sum(p.numel() * p.element_size() for p in params if p.dim() == 1)
    share = (whole - vectors) // 2 + vectors
    for rank, res in enumerate(run_ranks(load_share, 2, folder, str(tmp_path / "gen"), timeout=600)):
        assert res["param_bytes"] == share, f"rank {rank} holds {res['param_bytes']} bytes, its share is {share}"
        assert res["growth_bytes"] < 0.75 * whole, \
            f"rank {rank} grew by {res['growth_bytes'] / 2**20:.0f} MB loading a {whole / 2**20:.0f} MB model " \
            f"(its share: {share / 2**20:.0f} MB)"
        assert res["mapped_bytes"] < 0.25 * whole, \
            f"rank {rank} held {res['mapped_bytes'] / 2**20:.0f} MB of the checkpoint mapped while loading"


def load_sharded(folder: str, gen_dir: str) -> dict:
    """One rank: parallelize the meta-built Llama from ``folder`` under ZeRO-3 on 4 ranks; the bytes
    it stores (shards) and has gathered after building, its largest unit and largest single weight,
    and how far its own memory grew while loading."""
    import nbscaler
    from tests.resident import MB, PeakResident, resident_mb
    model, ids = _meta_llama(), torch.zeros(1, 8, dtype=torch.long)
    batch = {"batch": {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}}
    before = resident_mb()
    with PeakResident() as loading:
        model = nbscaler.parallelize(model, batch, "dp", nbscaler.ComputeConfig(1, 4, use_zero=True, zero_stage=3),
                                     gen_savedir=gen_dir, reuse="override", weights=folder)
    shards = model.reducer.stored_shards()
    return {"shard_bytes": sum(p.numel() * p.element_size() for p in shards),
            "gathered_bytes": sum(p.untyped_storage().nbytes() for p in model.parameters()),
            "largest_unit": max(f.numel() * f.element_size() for f in model.reducer.flats),
            "largest_weight": max(p.numel() * p.element_size() for p in model.parameters()),
            "growth_bytes": (loading.peak["RssAnon"] - before["RssAnon"]) * MB}


@pytest.mark.multiprocess
def test_a_zero3_rank_holds_its_shards_and_one_unit_while_loading(tmp_path):
    """The same 245 MB Llama under ZeRO-3 on 4 ranks: each rank keeps a quarter of every unit, and
    while loading holds its shards plus one unit whole (the embedding and head, the largest), never
    the model: a unit is read, cut and freed before the next is read. Reading a weight makes one
    tensor of it (safetensors has no read into a given buffer), which lives until it is copied into
    the gathered unit: so the embedding unit's peak adds one vocabulary matrix (31 MiB)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    folder = str(tmp_path / "checkpoint")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**LOADED_LLAMA)).save_pretrained(folder, safe_serialization=True,
                                                                  max_shard_size="100MB")
    whole = sum(p.numel() * p.element_size() for p in _meta_llama().parameters())
    for rank, res in enumerate(run_ranks(load_sharded, 4, folder, str(tmp_path / "gen"), timeout=600)):
        assert res["gathered_bytes"] == 0 and whole / 4 <= res["shard_bytes"] < whole / 4 + 4096
        bound = res["shard_bytes"] + res["largest_unit"] + res["largest_weight"]
        assert res["growth_bytes"] < bound + 24 * 2**20 < whole, \
            f"rank {rank} grew by {res['growth_bytes'] / 2**20:.0f} MB loading a {whole / 2**20:.0f} MB model " \
            f"(shards, one unit and the weight being read: {bound / 2**20:.0f} MB)"
