"""Hugging Face decoders trace as their users call them (``input_ids``, ``labels``, an optional 2-D
``attention_mask``), and train under ``dp`` equal to one process. Small configs, random init,
nothing downloaded.

transformers builds its masks with checks like ``(position_ids[:, -1] == 0).all()`` on ids made by
``torch.arange`` (static: shapes only) and ``attention_mask.all()`` (input data: one guard)."""

import warnings

import pytest
import torch

import nbscaler
from nbscaler import ComputeConfig, build_optimizer, merge_state_dicts, parallelize
from nbscaler.trace import trace_module
from tests.models import hf
from tests.models.hf import SEQ, VOCAB
from tests.multiprocess import assert_close, run_ranks

transformers = pytest.importorskip("transformers")

STEPS = 3
MODELS = ["llama", "qwen2", "mistral", "mixtral", "qwen3_moe", "gpt2", "bert"]


def small_model(name: str, seed: int = 0) -> torch.nn.Module:
    """The two-layer model of family ``name`` from ``tests.models.hf``, called directly (no loss
    wrapper) and without a key/value cache in its outputs."""
    torch.manual_seed(seed)
    model = getattr(hf, name)()
    model.config.use_cache = False
    return model


def sample(seed: int, mask: bool = True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    args = {"input_ids": ids, "labels": ids.clone()}
    if mask:
        args["attention_mask"] = torch.ones(2, SEQ, dtype=torch.long)
    return args


@pytest.mark.parametrize("mask", [False, True], ids=["no_mask", "mask"])
@pytest.mark.parametrize("name", MODELS)
def test_traces_on_shapes_with_one_guard_for_the_mask(name, mask):
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*traced on real tensors")    # no fallback
        graph = trace_module(small_model(name), sample(0, mask))
    guards = [n for n in graph.nodes if n.op == "guard"]
    assert len(guards) == int(mask)
    if mask:
        assert guards[0].outputs is True and guards[0].source[0].endswith("masking_utils.py")


def _train_dp(names, gen_dir):
    """On each rank: parallelize every model under dp, train, then feed a padded mask."""
    import torch.distributed as dist
    from nbscaler.runtime.guards import GuardError
    unit = dist.get_rank()
    out = {}
    for name in names:
        model = parallelize(small_model(name), sample(12345), "dp", ComputeConfig(1, 2), gen_savedir=gen_dir,
                            instance_name=name, reuse="override")
        opt = build_optimizer(model, torch.optim.SGD, lr=0.1)
        losses = []
        for step in range(STEPS):
            loss = model(**sample(step * 100 + unit))["loss"]
            loss.backward()
            opt.sync_shard_grad()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        padded = sample(7)
        padded["attention_mask"][:, -2:] = 0
        try:
            model(**padded)
            refused = ""
        except GuardError as err:
            refused = str(err)
        out[name] = {"losses": losses, "state": model.state_dict(), "refused": refused}
    return out


def _train_single(name):
    model = small_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        per_unit = [model(**sample(step * 100 + unit))["loss"] for unit in range(2)]
        sum(per_unit).backward()
        opt.step()
        opt.zero_grad()
        losses.append([l.item() for l in per_unit])
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.multiprocess
def test_decoders_train_under_dp_equal_to_one_process(tmp_path):
    names = ["llama", "gpt2", "bert"]
    per_rank = run_ranks(_train_dp, 2, names, str(tmp_path), timeout=600)
    for name in names:
        losses, params = _train_single(name)
        for rank, res in enumerate(per_rank):
            assert_close(torch.tensor(res[name]["losses"]), torch.tensor([l[rank] for l in losses]), f"{name} rank {rank} losses")
            assert "masking_utils.py" in res[name]["refused"] and "this input gives False" in res[name]["refused"]
        merged, _ = merge_state_dicts([res[name]["state"] for res in per_rank])
        for pname, expected in params.items():
            assert_close(merged[pname], expected, f"{name} final {pname}")


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_a_mixture_of_experts_built_on_meta_is_planned_on_shapes(act):
    """Mixtral's own experts (SiLU) are recorded as one ``dropless_experts`` op a layer, views of its
    parameters as their weights. Experts nbscaler does not record so (here with GELU) multiply with
    ``torch._grouped_mm`` on fp32 weights, whose shape function takes bf16 only: traced and replayed
    through ``nbscaler.experts.grouped_mm`` in its place. Either way a Mixtral on the meta device (no
    values to fall back to) is planned, its memory counted."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = hf.mixtral(hidden_act=act)
    model.config.use_cache = False
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(traced on real tensors|could not replay torch._grouped_mm)")
        plan = nbscaler.plan(model, sample(0, mask=False), "dp", ComputeConfig(1, 1))
        memory = plan.memory()
    recorded = sum(n.target == "nbscaler.experts.routing.dropless_experts" for n in plan.graph.nodes)
    grouped = sum(n.target == "torch._grouped_mm" for n in plan.graph.nodes)
    assert (recorded, grouped) == ((2, 0) if act == "silu" else (0, 2 * 2))     # 2 layers; gate_up, down
    assert memory["activation_bytes"][0] > 0
