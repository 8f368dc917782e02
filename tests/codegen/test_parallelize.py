"""parallelize in one process: the files it writes, reuse, atomic replacement and its keywords."""

import json
import os
import py_compile

import pytest
import torch

import nbscaler.planning.planner as plan_mod
from nbscaler import ComputeConfig, ParallelModule, parallelize
from nbscaler.genfiles import GenDir, module_dir
from tests.models import MLP, batch, build


def gen_path(tmp_path, cls=MLP, instance=None):
    return module_dir(cls, tmp_path, instance)


def test_files_on_disk(tmp_path):
    parallelize(build("llama"), batch("llama", 0), "tp", ComputeConfig(2, 4), gen_savedir=tmp_path, load_module=False)
    path = gen_path(tmp_path, type(build("llama")))
    assert path == tmp_path / "_parallel_modules" / "nbscaler.models.llama.Llama" / "_"
    names = sorted(os.listdir(path))
    assert names == ["config.json", "gencode0.py", "gencode1.py", "gencode2.py", "gencode3.py", "graph.pkl",
                     "plan.json", "weights.pt"]
    for r in range(4):
        py_compile.compile(str(path / f"gencode{r}.py"), doraise=True)
    code = (path / "gencode1.py").read_text()
    assert "plan device 1 of 2, unit 0 of 2" in code
    assert "# blocks.0.attn.q: q = self.q(x).view(B, T, self.n_head, self.hd).transpose(1, 2)        # (B, nh, T, hs)    (llama.py:" in code
    assert "comm.all_reduce(" in code and "split_dim=0, parts=2, index=1" in code
    plan = json.loads((path / "plan.json").read_text())
    assert plan["weights"]["blocks.0.attn.q.weight"]["layout"] == "S(0)"
    assert not any(p.name.startswith(".") for p in path.parent.iterdir())      # no temporary folders left


def test_generated_code_says_the_dtype_of_what_it_holds(tmp_path):
    parallelize(build("mlp"), batch("mlp", 0), "tp", ComputeConfig(2, 2), gen_savedir=tmp_path, load_module=False,
                module_dtype=torch.bfloat16)
    code = (gen_path(tmp_path) / "gencode0.py").read_text()
    assert "# held as compiled (params in bfloat16); the optimizer's master copies and state are in " \
           "build_optimizer's master_dtype" in code
    assert "torch.float32" not in code


def test_single_rank_module_matches_the_original(tmp_path):
    model = build("branch")
    pm = parallelize(model, batch("branch", 0), "tp", ComputeConfig(1, 1), gen_savedir=tmp_path)
    assert isinstance(pm, ParallelModule)
    data = batch("branch", 3)
    for mode in ("train", "eval"):
        model.train(mode == "train")
        pm.train(mode == "train")
        assert torch.allclose(pm(**data), model(**data)), mode


def test_reuse_match_moo_override_graph(tmp_path, monkeypatch):
    args = (build("mlp"), batch("mlp", 0), "tp")
    parallelize(*args, ComputeConfig(2, 2), gen_savedir=tmp_path, load_module=False)
    code = gen_path(tmp_path) / "gencode0.py"
    stamp = code.stat().st_mtime_ns
    parallelize(*args, ComputeConfig(2, 2), gen_savedir=tmp_path, load_module=False)    # match: reused
    assert code.stat().st_mtime_ns == stamp

    with pytest.raises(ValueError, match="runtime_ngpus was 2, now 4.*nothing was changed"):
        parallelize(*args, ComputeConfig(2, 4), gen_savedir=tmp_path, load_module=False)
    assert code.stat().st_mtime_ns == stamp and not (gen_path(tmp_path) / "gencode3.py").exists()

    parallelize(*args, ComputeConfig(2, 4), gen_savedir=tmp_path, load_module=False, reuse="moo")
    assert (gen_path(tmp_path) / "gencode3.py").exists()

    def no_trace(*a, **k):
        raise AssertionError("the graph should have been reused")

    monkeypatch.setattr(plan_mod, "trace_modes", no_trace)
    parallelize(*args, ComputeConfig(2, 2), gen_savedir=tmp_path, load_module=False, reuse="graph")
    assert not (gen_path(tmp_path) / "gencode3.py").exists()
    with pytest.raises(AssertionError, match="reused"):
        parallelize(*args, ComputeConfig(2, 2), gen_savedir=tmp_path, load_module=False, reuse="override")


def test_failed_regeneration_keeps_the_old_files(tmp_path):
    parallelize(build("mlp"), batch("mlp", 0), "tp", ComputeConfig(2, 2), gen_savedir=tmp_path, load_module=False)
    before = {p.name: p.read_bytes() for p in gen_path(tmp_path).iterdir()}

    def broken(graph, cfg):
        raise RuntimeError("policy bug")

    with pytest.raises(RuntimeError, match="policy bug"):
        parallelize(build("mlp"), batch("mlp", 0), broken, ComputeConfig(2, 2), gen_savedir=tmp_path,
                    load_module=False, reuse="override")
    assert {p.name: p.read_bytes() for p in gen_path(tmp_path).iterdir()} == before


def test_instance_names_keep_compiles_apart(tmp_path):
    for name in ("a", "b"):
        parallelize(build("mlp"), batch("mlp", 0), "tp", ComputeConfig(2, 2), gen_savedir=tmp_path,
                    instance_name=name, load_module=False)
    assert GenDir(gen_path(tmp_path, instance="a")).exists() and GenDir(gen_path(tmp_path, instance="b")).exists()


def test_module_class_module_fn_dtype_and_init(tmp_path):
    cls = parallelize(MLP, batch("mlp", 0), "dp", ComputeConfig(1, 1), gen_savedir=tmp_path,
                      module_fn=lambda: MLP(hidden=8), module_dtype=torch.float64)
    assert isinstance(cls, type) and issubclass(cls, ParallelModule)
    pm = cls()
    assert pm.fc1_weight.shape == (8, 16) and pm.fc1_weight.dtype == torch.float64
    empty = cls(init_params=False)
    assert not torch.equal(empty.fc1_weight, pm.fc1_weight)


def test_plain_process_can_compile_but_not_load_a_multi_rank_plan(tmp_path):
    assert parallelize(build("mlp"), batch("mlp", 0), "tp", ComputeConfig(2, 2), gen_savedir=tmp_path,
                       load_module=False) is None
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized.*load_module=False"):
        parallelize(build("mlp"), batch("mlp", 0), "tp", ComputeConfig(2, 2), gen_savedir=tmp_path)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="reuse='sometimes' is not one of"):
        parallelize(build("mlp"), batch("mlp", 0), "tp", ComputeConfig(1, 1), gen_savedir=tmp_path, reuse="sometimes")
    with pytest.raises(RuntimeError, match="torch.distributed is not initialized"):
        parallelize(build("mlp"), batch("mlp", 0), "tp", ComputeConfig(1, 1), gen_savedir=tmp_path,
                    broadcast_strategy="all")
    with pytest.raises(TypeError, match="ComputeConfig"):
        parallelize(build("mlp"), batch("mlp", 0), "tp", {"plan_ngpus": 1}, gen_savedir=tmp_path)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        parallelize(object(), {}, "tp", ComputeConfig(1, 1), gen_savedir=tmp_path)


def test_end2end_module_refuses_forward(tmp_path):
    from nbscaler.models.gpt import GPT, GPTConfig, sample_batch
    cfg = GPTConfig()
    pm = parallelize(GPT(cfg), {"batch": sample_batch(cfg, 2)}, "dp", ComputeConfig(1, 1, use_end2end=True),
                     gen_savedir=tmp_path)
    with pytest.raises(RuntimeError, match="call train_step"):
        pm(sample_batch(cfg, 2))
    losses = pm.train_step([sample_batch(cfg, 2, seed=s) for s in range(2)])
    assert len(losses) == 2 and all(l.ndim == 0 for l in losses)


def test_recompiling_with_the_same_weights_links_the_old_file(tmp_path):
    model = build("mlp")
    parallelize(model, batch("mlp", 0), "tp", ComputeConfig(2, 2), gen_savedir=tmp_path, load_module=False)
    weights = gen_path(tmp_path) / "weights.pt"
    inode = weights.stat().st_ino
    parallelize(model, batch("mlp", 0), "data", ComputeConfig(2, 2), gen_savedir=tmp_path, load_module=False,
                reuse="override")
    assert weights.stat().st_ino == inode                     # same file: nothing written again
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    parallelize(model, batch("mlp", 0), "tp", ComputeConfig(2, 2), gen_savedir=tmp_path, load_module=False,
                reuse="override")
    assert weights.stat().st_ino != inode
    saved = torch.load(weights, weights_only=True)
    assert torch.equal(saved[next(iter(dict(model.named_parameters())))], next(model.parameters()).detach())
