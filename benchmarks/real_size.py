"""Memory per rank when a model no rank holds whole is loaded from safetensors: the loading table.

A Hugging Face ``LlamaForCausalLM`` of about 2 GB in fp32 (hidden 2048, intermediate 5632, 8 layers,
16 heads, 4 key-value heads, vocabulary 32,000: 491.7M parameters) is written once by
``save_pretrained(..., safe_serialization=True)`` in shards, by a process of its own that exits
before any rank starts. Then 4 ``tp`` ranks (``nbscaler.runtime.launch.spawn``, gloo) each build it
on the meta device, ``parallelize`` it with ``weights=`` the folder, and train 2 steps (SGD, one
sequence of 32 tokens). Each rank reports:

- share: the bytes of the parameters and buffers it holds after ``parallelize``;
- peak RSS (``ru_maxrss``) at start (torch, transformers and nbscaler imported, gloo up, nothing
  built), after ``parallelize`` and after training;
- its anonymous RSS (its own pages) at start and at its peaks while loading and while training, and
  the peak of its file-backed RSS while loading (the checkpoint's pages it has mapped: page cache
  shared by all ranks), sampled apart by ``tests.resident.PeakResident``;
- load: the seconds ``parallelize`` took (planning, code, slice reads).

The fixed overhead is the same run with a tiny Llama (hidden 64, 2 layers, vocabulary 256), whose
weights weigh nothing: what a rank costs before it holds any of the model.

    python -m benchmarks.real_size                 # prints the markdown tables
    python -m benchmarks.real_size --layers 2      # a smaller model, quicker
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import warnings
from typing import Dict, List

import torch
import torch.multiprocessing as mp

from nbscaler.models import torchvision_compat
from tests.models.hf import LossOf
from tests.resident import MB, PeakResident, peak_mb, resident_mb

torchvision_compat.declare_missing_ops()   # transformers imports torchvision, whose C++ ops may not load here
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402  (outside any meta context)

SEQ = 32
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)


def llama_config(layers: int) -> dict:
    """The benchmark's model: Llama's shape at about 2 GB in fp32 with 8 layers."""
    return dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=16,
                num_key_value_heads=4, vocab_size=32000, max_position_embeddings=SEQ, attention_dropout=0.0)


def build(config: dict) -> LossOf:
    return LossOf(LlamaForCausalLM(LlamaConfig(**config)))


def sample(vocab: int, seed: int) -> dict:
    ids = torch.randint(0, vocab, (1, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"batch": {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}}


def _save(config: dict, folder: str) -> None:
    torch.manual_seed(0)
    build(config).model.save_pretrained(folder, safe_serialization=True, max_shard_size="500MB")


def save_checkpoint(config: dict, folder: str) -> None:
    """Write the model's shards from a process of its own, which holds it whole and then exits."""
    proc = mp.get_context("spawn").Process(target=_save, args=(config, folder))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"writing the checkpoint into {folder} failed (exit code {proc.exitcode})")


def rank_run(config: dict, folder: str, gen_dir: str, steps: int) -> Dict[str, float]:
    """One rank: build on meta, load its slices from ``folder``, train ``steps``; memory and times."""
    import nbscaler
    warnings.simplefilter("ignore")
    out = {"start": peak_mb(), "start_anon": resident_mb()["RssAnon"]}
    with torch.device("meta"):
        model = build(config)
    cfg = nbscaler.ComputeConfig(plan_ngpus=4, runtime_ngpus=4)
    begin = time.perf_counter()
    with PeakResident() as loading:
        model = nbscaler.parallelize(model, sample(config["vocab_size"], 0), "tp", cfg, gen_savedir=gen_dir,
                                     reuse="override", weights=folder)
    out["load_s"] = time.perf_counter() - begin
    out["loaded"] = peak_mb()
    out["anon_loading"], out["file_loading"] = loading.peak["RssAnon"], loading.peak["RssFile"]
    out["share"] = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / MB
    opt = nbscaler.build_optimizer(model, torch.optim.SGD, lr=1e-3)
    out["losses"] = []
    with PeakResident() as training:
        for step in range(steps):
            loss = model(**sample(config["vocab_size"], step + 1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            out["losses"].append(loss.item())
    out["trained"], out["anon_training"] = peak_mb(), training.peak["RssAnon"]
    return out


def measure(config: dict, steps: int) -> List[Dict[str, float]]:
    """Per rank figures for ``config``, saved into a temporary folder and loaded on 4 tp ranks."""
    from nbscaler.runtime.launch import spawn
    with tempfile.TemporaryDirectory() as root:
        folder = os.path.join(root, "checkpoint")
        save_checkpoint(config, folder)
        on_disk = sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder)) / MB
        per_rank = spawn(rank_run, 4, config, folder, os.path.join(root, "gen"), steps, timeout=1800)
    for res in per_rank:
        res["on_disk"] = on_disk
    return per_rank


def table(per_rank: List[Dict[str, float]], whole_mb: float) -> str:
    lines = [f"Whole model: {whole_mb:,.0f} MB in fp32 ({per_rank[0]['on_disk']:,.0f} MB of safetensors on disk).",
             "",
             "| rank | share (MB) | peak RSS: start / loaded / trained (MB) | anonymous RSS: start / loading / "
             "training, peaks (MB) | file-backed RSS while loading, peak (MB) | load (s) |",
             "| ---: | ---: | ---: | ---: | ---: | ---: |"]
    for rank, r in enumerate(per_rank):
        lines.append(f"| {rank} | {r['share']:,.0f} | {r['start']:,.0f} / {r['loaded']:,.0f} / {r['trained']:,.0f} "
                     f"| {r['start_anon']:,.0f} / {r['anon_loading']:,.0f} / {r['anon_training']:,.0f} "
                     f"| {r['file_loading']:,.0f} | {r['load_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    opts = parser.parse_args()
    config = llama_config(opts.layers)
    with torch.device("meta"):
        whole = sum(p.numel() * p.element_size() for p in build(config).parameters()) / MB
        tiny_whole = sum(p.numel() * p.element_size() for p in build({**TINY, "max_position_embeddings": SEQ})
                         .parameters()) / MB
    tiny = measure({**TINY, "max_position_embeddings": SEQ}, opts.steps)
    big = measure(config, opts.steps)
    print(f"HF LlamaForCausalLM {config}, tp on 4 gloo ranks, {opts.steps} SGD steps on 1 x {SEQ} tokens.\n")
    print(table(big, whole))
    print("\nFixed overhead: the same run with a tiny Llama\n")
    print(table(tiny, tiny_whole))
    print("\nLosses per rank:", [r["losses"] for r in big])


if __name__ == "__main__":
    main()
