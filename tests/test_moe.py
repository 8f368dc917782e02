"""The shipped mixture-of-experts Llama (``nbscaler.models.moe``) and its routed experts
(``nbscaler.experts``) in one process: the experts against a plain loop over tokens, the
grouped product's gradients against autograd's, capacity dropping exactly the pairs past it, and
the model on the meta device and through nbscaler's tracer on shapes alone."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import nbscaler
from nbscaler import ComputeConfig
from nbscaler.experts import RoutingLog, capacity_experts, dropless_experts, grouped_mm
from nbscaler.models.moe import MoEConfig, MoELlama, sample_batch

E, D, H, K = 4, 8, 16, 2


def expert(x: torch.Tensor, e: int, w1, w3, w2) -> torch.Tensor:
    return (F.silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]


@pytest.fixture
def routed():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 6, D, generator=g, dtype=torch.float32)
    w1, w3 = torch.randn(E, D, H, generator=g, dtype=torch.float32), torch.randn(E, D, H, generator=g, dtype=torch.float32)
    w2 = torch.randn(E, H, D, generator=g, dtype=torch.float32)
    top, chosen = torch.randn(2, 6, E, generator=g, dtype=torch.float32).softmax(-1).topk(K)
    return x, top / top.sum(-1, keepdim=True), chosen, w1, w3, w2


def loop(x, weights, chosen, w1, w3, w2, capacity=None):
    """Token by token, each sequence's pairs in token order, an expert serving at most ``capacity``."""
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        served = [0] * E
        for t in range(x.shape[1]):
            for j in range(K):
                e = int(chosen[b, t, j])
                if capacity is None or served[e] < capacity:
                    served[e] += 1
                    out[b, t] += weights[b, t, j] * expert(x[b, t], e, w1, w3, w2)
    return out


def test_dropless_experts_serve_every_token_with_its_chosen_experts(routed):
    x, weights, chosen, w1, w3, w2 = routed
    got = dropless_experts(x.reshape(12, D), weights.reshape(12, K), chosen.reshape(12, K), w1, w3, w2)
    torch.testing.assert_close(got.view(2, 6, D), loop(*routed), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("capacity", [1, 2, 3, 12])
def test_capacity_experts_drop_the_pairs_past_each_experts_capacity_per_sequence(routed, capacity):
    torch.testing.assert_close(capacity_experts(*routed, capacity), loop(*routed, capacity=capacity),
                               rtol=1e-5, atol=1e-5)


def test_grouped_products_backward_is_autograds_of_the_runs():
    g = torch.Generator().manual_seed(1)
    rows, weights = torch.randn(10, D, generator=g, requires_grad=True), torch.randn(E, D, H, generator=g, requires_grad=True)
    ends = torch.tensor([3, 3, 7, 10], dtype=torch.int32)           # expert 1 gets no rows
    grad = torch.randn(10, H, generator=g)
    torch.autograd.backward(grouped_mm(rows, weights, ends), grad)
    r, w = rows.detach().requires_grad_(), weights.detach().requires_grad_()
    runs = [(0, 3), (3, 3), (3, 7), (7, 10)]
    torch.autograd.backward(torch.cat([r[lo:hi] @ w[e] for e, (lo, hi) in enumerate(runs)]), grad)
    torch.testing.assert_close(rows.grad, r.grad)
    torch.testing.assert_close(weights.grad, w.grad)
    assert weights.grad[1].abs().max() == 0


def config(**fields) -> MoEConfig:
    small = dict(vocab_size=64, seq_len=16, n_layer=2, d_model=32, n_head=4, n_kv_head=2, expert_hidden=16)
    return MoEConfig(**{**small, **fields})


@pytest.mark.parametrize("fields", [{}, {"router": "sigmoid", "n_shared_experts": 1},
                                    {"capacity_factor": 0.5, "router": "sigmoid"}])
def test_the_model_trains_builds_on_meta_and_traces_on_shapes_alone(fields):
    cfg = config(**fields)
    model = MoELlama(cfg)
    loss = model(**sample_batch(cfg, 2))
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    with torch.device("meta"):
        assert MoELlama(cfg).blocks[0].moe.experts.w1.is_meta
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # traced on shapes, every op known
        plan = nbscaler.plan(model, sample_batch(cfg, 2), "data", ComputeConfig(2, 2))
    routed = [n for n in plan.graph.nodes if n.target.startswith("nbscaler.experts.routing.")]
    # each device routes its own tokens (dropless) or sequences (capacity) through every expert
    assert [n.placement.split for n in routed] == ["b" if cfg.capacity_factor else "n"] * cfg.n_layer


def test_the_load_balancing_loss_is_one_when_the_router_has_no_preference():
    cfg = config(aux_loss_coef=1.0)
    model = MoELlama(cfg)
    for block in model.blocks:
        torch.nn.init.zeros_(block.moe.router.weight)       # every expert scored alike
    _, aux = model.blocks[0].moe(torch.randn(3, 8, cfg.d_model))
    torch.testing.assert_close(aux, torch.ones(3))


@pytest.mark.parametrize("fields, words", [({"top_k": 5}, "top_k=5"), ({"router": "relu"}, "router='relu'"),
                                           ({"capacity_factor": 0.0}, "capacity_factor=0.0")])
def test_a_wrong_config_names_the_field(fields, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(")):
        config(**fields)


def test_the_routing_log_counts_each_experts_pairs_and_what_capacity_dropped(routed):
    """Every call made while a log is open: pairs routed to each expert (k per token in all), kept
    (all under dropless routing), dropped past each expert's capacity; none while tracing."""
    x, weights, chosen, w1, w3, w2 = routed
    with RoutingLog() as log:
        dropless_experts(x.reshape(12, D), weights.reshape(12, K), chosen.reshape(12, K), w1, w3, w2)
        capacity_experts(*routed, 2)
    frame = log.frame()
    first, second = frame[frame.call == 0], frame[frame.call == 1]
    expected = torch.bincount(chosen.reshape(-1), minlength=E).tolist()
    assert first.routed.tolist() == second.routed.tolist() == expected and first.dropped.sum() == 0
    per_sequence = [torch.bincount(chosen[b].reshape(-1), minlength=E).clamp(max=2) for b in range(2)]
    assert second.served.tolist() == sum(per_sequence).tolist()        # capacity 2 per sequence
    assert log.imbalance().tolist() == [max(expected) / (sum(expected) / E)] * 2
    cfg = config()
    with RoutingLog() as quiet:
        nbscaler.plan(MoELlama(cfg), sample_batch(cfg, 2), "dp", ComputeConfig(1, 1))
    assert quiet.frame().empty


def test_the_first_capacity_overflow_of_a_process_is_reported_without_a_log(routed, monkeypatch, recwarn):
    """Pairs past an expert's capacity are dropped by design, but never silently: the first call that
    drops any warns, naming how many and the fixes; later ones are left to a RoutingLog. A call that
    drops none, dropless routing and shape-only calls say nothing."""
    from nbscaler.experts import CapacityOverflowWarning
    from nbscaler.experts import log as routing_log
    monkeypatch.setattr(routing_log, "_DROPS_REPORTED", [False])
    x, weights, chosen, w1, w3, w2 = routed
    dropless_experts(x.reshape(12, D), weights.reshape(12, K), chosen.reshape(12, K), w1, w3, w2)
    capacity_experts(*routed, 12)                               # room for every pair
    with torch.device("meta"):
        capacity_experts(*(t.to("meta") for t in routed), 1)
    assert not [w for w in recwarn if issubclass(w.category, CapacityOverflowWarning)]
    with pytest.warns(CapacityOverflowWarning, match=r"dropped \d+ of 24 .*capacity_factor"):
        capacity_experts(*routed, 1)
    recwarn.clear()
    capacity_experts(*routed, 1)
    assert not [w for w in recwarn if issubclass(w.category, CapacityOverflowWarning)]


def test_calls_on_made_up_inputs_report_no_drops(routed, monkeypatch, recwarn):
    """The cost model times an op on random inputs (``unreal_inputs``): their drops are not the
    run's, so they neither warn nor use up the process's one report."""
    from nbscaler.experts import CapacityOverflowWarning
    from nbscaler.experts import log as routing_log
    monkeypatch.setattr(routing_log, "_DROPS_REPORTED", [False])
    with routing_log.unreal_inputs():
        capacity_experts(*routed, 1)
    assert not [w for w in recwarn if issubclass(w.category, CapacityOverflowWarning)]
    with pytest.warns(CapacityOverflowWarning):
        capacity_experts(*routed, 1)
