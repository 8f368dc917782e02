"""The memory model against exact measured counts (``nbscaler.runtime.memory``).

On the CPU both sides are deterministic, so every category must match to the byte: parameters,
gradients, optimizer state (by optimizer, without ZeRO and with ZeRO stages 1 and 2), buffers and the activations
saved for the backward (per pipeline schedule, over the micro-batches in flight, zero-bubble
schedules holding them from the forward to the weight-gradient block).
"""

import pytest
import torch

from nbscaler.columns import MEMORY_COLUMNS
from nbscaler.config import ComputeConfig
from nbscaler.recipe import AS_HELD, Recipe
from nbscaler.cost.memory import PlacedGraphs, gradients, in_flight_peak, memory_per_rank, optimizer_state_bytes, weight_memory
from nbscaler.experts import RoutingLog
from nbscaler.cost.moments import Gradients
from nbscaler.cost.ranks import LocalWeight
from nbscaler.schedule import PipelineGeometry, build_schedule
from tests.models import build
from tests.multiprocess import (OPTIMIZERS, Case, buckets, context_parallel, expert_parallel, granular, measure_memory,
                                pipeline, plan_inputs, predicted_memory, recompute, run_cases, samples, sequence_parallel,
                                single_steps, zero)


@pytest.mark.parametrize("optimizer, kwargs, expected", [
    (torch.optim.SGD, {"lr": 0.1}, 0),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, 10 * 4),
    (torch.optim.Adam, {}, 2 * 10 * 4 + 4),
    (torch.optim.AdamW, {"amsgrad": True}, 3 * 10 * 4 + 4),
])
def test_optimizer_state_is_learnt_per_class(optimizer, kwargs, expected):
    assert optimizer_state_bytes(optimizer, kwargs, 10, torch.float32) == expected


def test_in_flight_activations_follow_the_schedule():
    saved = {0: 100, 1: 10}
    gpipe = PipelineGeometry(build_schedule("gpipe", 2, 4), 2)
    one_f_one_b = PipelineGeometry(build_schedule("1f1b", 2, 4), 2)
    assert in_flight_peak(saved, gpipe, 0) == 400            # every forward before any backward
    assert in_flight_peak(saved, one_f_one_b, 0) == 200      # stage 0 of 2 holds two micro-batches
    assert in_flight_peak(saved, one_f_one_b, 1) == 10
    assert in_flight_peak({None: 7}, None, 0) == 7


def test_gradients_follow_the_reducers():
    """Three float parameters of 10, 20 and 30 elements in two buckets, ZeRO over 2 ranks (shards
    of 15 elements): what each backward and step holds at most, and what they leave."""
    w = [LocalWeight(f"w{i}", "param", (n,), torch.float32, True) for i, n in enumerate((10, 20, 30))]
    buckets, shards = [w[:2], w[2:]], [60, 60]
    plain, stage1, stage2 = Gradients(buckets, [], 0), Gradients(buckets, shards, 1), Gradients(buckets, shards, 2)
    assert (plain.backward(None), plain.step(w), plain.held) == (240, 240, 240)
    assert (stage1.backward(None), stage1.step(w), stage1.held) == (240, 240, 120)   # all until the step
    # Stage 2: the last bucket is made (120) and reduced (60) before the first is made (60 + 120).
    assert (stage2.backward(None), stage2.held) == (180, 120)
    assert (stage2.backward(None), stage2.step(w), stage2.held) == (120 + 120, 120, 120)


def test_the_model_buckets_as_the_config_says():
    """The same three parameters (40, 80 and 120 bytes) under ZeRO-2: one bucket by default, whose
    gradients are all held before it is reduced; in buckets of at most 120 bytes the last (120) is
    reduced to its shard (60) before the first two (120) are made."""
    w = [LocalWeight(f"w{i}", "param", (n,), torch.float32, True) for i, n in enumerate((10, 20, 30))]
    whole = gradients(w, ComputeConfig(1, 2, use_zero=True, zero_stage=2), AS_HELD)
    split = gradients(w, ComputeConfig(1, 2, use_zero=True, zero_stage=2, reduce_bucket_bytes=120), AS_HELD)
    assert [[x.name for x in b] for b in split.buckets] == [["w0", "w1"], ["w2"]]
    assert (whole.backward(None), split.backward(None)) == (240, 60 + 120)


def test_split_backward_frees_activations_at_the_weight_block():
    saved = {0: 100, 1: 10}
    zb_h1 = PipelineGeometry(build_schedule("zb_h1", 2, 4), 2)
    assert in_flight_peak(saved, zb_h1, 0) == 200            # as 1F1B: two micro-batches on stage 0
    assert in_flight_peak(saved, zb_h1, 1) == 20             # its W runs one backward late


def test_a_split_backward_frees_what_w_does_not_read_at_b():
    """Of stage 1's 10 bytes, W reads 6 (the loss above its last weight is the other 4): ``f0 b0 f1``
    holds 6 + 10, where keeping everything until W held 20."""
    saved, held_for_w = {0: 100, 1: 10}, {0: 100, 1: 6}
    zb_h1 = PipelineGeometry(build_schedule("zb_h1", 2, 4), 2)
    assert in_flight_peak(saved, zb_h1, 0, held_for_w) == 200
    assert in_flight_peak(saved, zb_h1, 1, held_for_w) == 16


def test_w_holds_what_feeds_a_weighted_op():
    """``held_for_weights`` on a replayed GPT stage that ends with its loss: everything but the
    loss's saved bytes (log-softmax, targets) stays for W; the ops before the head all feed it."""
    from nbscaler.comm.placed import PlacedGraphs
    from nbscaler.cost.memory import held_for_weights, stage_runs
    from nbscaler.ir.backward_split import backward_parts
    from tests.multiprocess import plan_inputs
    case = Case("gpt", "pp", 2, 2, config=pipeline("zb_h1", 2, 4))
    placed = PlacedGraphs(*plan_inputs(case))
    graph = placed.graphs.get("train", placed.graphs.get("any"))
    parts = {n.name: p for n, p in zip(graph.nodes, backward_parts(graph))}
    first, last = stage_runs(placed, 0)[0], stage_runs(placed, 1)[1]
    loss = next(op for op in last.ops if op.node.op == "loss")
    assert held_for_weights(first, parts) == first.saved_bytes          # no data path: W walks it all
    assert loss.saved_bytes > 0 and held_for_weights(last, parts) == last.saved_bytes - loss.saved_bytes


def test_a_split_backward_makes_gradients_and_frees_activations_at_the_weight_block():
    """zb_h1 on 2 stages, 4 micro-batches: stage 1 (``f0 b0 f1 b1 w0 f2 ...``) holds two micro-batches'
    activations at its peak, and its weight (40 bytes) has a gradient only once ``w0`` has run;
    each ``B`` frees nothing and makes no gradient. Once counted as a whole backward each, B and W
    freed a micro-batch twice and made the gradient a block early."""
    from nbscaler.columns import StepMoment
    from nbscaler.cost.moments import step_moments
    w = [LocalWeight("w", "param", (10,), torch.float32, True, stages=(1,))]
    geometry = PipelineGeometry(build_schedule("zb_h1", 2, 4), 2)
    moments = step_moments(Gradients([w], [], 0), w, {0: 100, 1: 10}, geometry, 1)
    held = [(m.moment, m.grad_bytes, m.activation_bytes) for m in moments]
    assert held[:6] == [(StepMoment.FORWARD, 0, 10), (StepMoment.FORWARD, 0, 20), (StepMoment.BACKWARD, 40, 20),
                        (StepMoment.FORWARD, 40, 20), (StepMoment.BACKWARD, 40, 20), (StepMoment.FORWARD, 40, 20)]
    assert held[-1] == (StepMoment.STEP, 40, 0)


def test_mixed_precision_bytes_per_parameter():
    """bf16 parameters, fp32 masters, AdamW, no ZeRO: 2 + 2 (bf16 gradient) + 4 (master) + 8 (state)
    = 16 bytes per parameter during the backward and 2 + 4 + 4 + 8 = 18 after the step, where the
    gradient is the master's fp32 one; plus AdamW's fp32 step counter (4 bytes) per parameter."""
    n = 1000
    w = [LocalWeight("w", "param", (n,), torch.bfloat16, True)]
    precision = Recipe(master_dtype=torch.float32)
    row = weight_memory(w, ComputeConfig(1, 1), precision)
    assert (row["param_bytes"], row["optimizer_bytes"]) == (2 * n, (4 + 8) * n + 4)
    grads = gradients(w, ComputeConfig(1, 1), precision)
    assert grads.backward(None) == 2 * n
    assert row["param_bytes"] + grads.held + row["optimizer_bytes"] - 4 == 16 * n
    assert (grads.step(w), grads.held) == (4 * n, 4 * n)
    # Without masters (fp32 master of an fp32 module is no copy) the model is the fp32 one: 4 + 4 + 8.
    w32 = [LocalWeight("w", "param", (n,), torch.float32, True)]
    assert weight_memory(w32, ComputeConfig(1, 1), precision)["optimizer_bytes"] == 8 * n + 4
    assert gradients(w32, ComputeConfig(1, 1), precision).shard_bytes == []


def _equal(case, predicted, measured):
    assert len(predicted) == len(measured) == case.runtime_ngpus
    for p, m in zip(predicted, measured):
        for column in MEMORY_COLUMNS:
            assert p[column] == m[column], f"{case} rank {m['rank']}: {column} predicted {p[column]}, measured {m[column]}"
    assert all(m["param_bytes"] + m["gathered_bytes"] > 0 for m in measured)   # ZeRO-3 with masters stores none


def _check(case, predicted, measured):
    _equal(case, predicted, measured)
    assert all(m["activation_bytes"] > 0 for m in measured)


BF16, FP32 = torch.bfloat16, torch.float32


def mixed(model: str, policy: str, plan: int, runtime: int, config: tuple = ()) -> Case:
    """The mixed-precision recipe: a bf16 module, fp32 masters and AdamW state."""
    return Case(model, policy, plan, runtime, optimizer="adamw", config=config, module_dtype=BF16, master_dtype=FP32)


def slow(case: Case):
    """A case whose rule a test above checks on hand-made counts: measured in ``make test`` only."""
    return pytest.param(case, marks=pytest.mark.slow, id=str(case))


IN_PROCESS = [
    Case("mlp", "dp", 1, 1),
    Case("mlp", "dp", 1, 1, optimizer="momentum"),
    Case("llama", "dp", 1, 1, optimizer="adamw"),
    Case("cnn", "dp", 1, 1, optimizer="adam_amsgrad"),               # buffers, train/eval graphs
    slow(Case("gpt", "dp", 1, 1, optimizer="adamw", config=zero())),   # ZeRO with one rank
    slow(Case("gpt", "pp", 1, 1, config=pipeline("gpipe", 1, 3))),     # three micro-batches in flight
    Case("gpt", "pp", 1, 1, optimizer="momentum", config=pipeline("1f1b", 1, 3)),
    slow(Case("gpt", "dp", 1, 1, config=recompute("gpt.blocks"))),    # only the blocks' inputs are kept
    Case("gpt", "pp", 1, 1, config=pipeline("1f1b", 1, 3) + recompute("Block")),
    Case("gpt", "dp", 1, 1, config=granular("selective")),        # each scaled_dot_product_attention rebuilt
    Case("llama", "dp", 1, 1, optimizer="adamw", config=granular("selective")),   # q @ k.T to @ v rebuilt
    slow(Case("gpt", "pp", 1, 1, config=pipeline("zb_h1", 1, 3))),      # each W frees its forward's saves
    Case("gpt", "pp", 1, 1, optimizer="adamw", config=pipeline("zbv", 2, 3)),    # both stages of a V on one rank
    Case("moe", "dp", 1, 1, optimizer="adamw"),                   # pairs sorted by expert, grouped products
    Case("moe_capacity", "dp", 1, 1, optimizer="adamw"),          # capacity buffers of every expert
    Case("moe_window", "dp", 1, 1, optimizer="adamw"),            # a sliding window's attention keeps no mask
]


@pytest.mark.parametrize("case", IN_PROCESS, ids=str)
def test_memory_model_is_exact_in_one_process(case, tmp_path):
    _check(case, predicted_memory(case), [measure_memory([case], str(tmp_path))[0]])


MULTI = [
    Case("llama", "tp", 2, 2, optimizer="adamw"),
    Case("gpt", "tp", 2, 2, optimizer="momentum"),
    Case("mlp", "data", 2, 2, optimizer="adamw"),
    Case("llama", "dp", 1, 2, optimizer="adamw", config=zero()),
    Case("gpt", "pp", 2, 2, config=pipeline("1f1b", 2, 4)),
    Case("gpt", "pp", 2, 2, optimizer="adamw", config=pipeline("gpipe", 2, 4) + zero()),
    Case("llama", "dp", 1, 2, optimizer="adamw", config=zero(stage=2)),
    Case("llama", "dp", 1, 2, optimizer="adamw", config=zero(stage=2) + buckets(16 * 1024)),    # 7 buckets
    Case("llama", "dp", 1, 2, optimizer="adamw", config=zero() + buckets(16 * 1024)),
    Case("gpt", "pp", 2, 2, optimizer="adamw", config=pipeline("1f1b", 2, 4) + zero(stage=2) + buckets(16 * 1024)),
    Case("gpt", "tp", 2, 2, config=recompute("gpt.blocks.1", "gpt.blocks.3")),
    Case("llama", "tp", 2, 2, config=granular("selective", sequence_parallel=True)),
    Case("gpt", "tp", 2, 2, optimizer="adamw", config=sequence_parallel()),     # activations on a sequence slice
    Case("llama", "tp", 2, 2, config=sequence_parallel()),
    Case("gpt", "pp", 2, 2, config=pipeline("1f1b_interleaved", 4, 4)),
    Case("gpt", "pp", 2, 2, config=pipeline("zb_h1", 2, 4)),       # activations live from F to W, not to B
    Case("llama_e2e", "pp", 2, 2, optimizer="adamw", config=pipeline("zbv", 4, 4)),
    Case("llama_e2e", "tp", 2, 2, optimizer="adamw"),              # the cross-entropy split by vocabulary
]


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    return run_cases(measure_memory, 2, MULTI, str(tmp_path_factory.mktemp("gen")))


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", MULTI, ids=str)
def test_memory_model_is_exact_on_two_ranks(measured, case):
    _check(case, predicted_memory(case), measured[case])


@pytest.mark.multiprocess
def test_zero2_in_small_buckets_holds_fewer_gradients_at_once(measured):
    """Llama (22,688 fp32 parameters), ZeRO-2 on 2 ranks: in one 25 MiB bucket every full gradient
    is held just before the one reduce-scatter (90,752 bytes, the peak's backward moment); in 16 KiB
    buckets each is reduce-scattered and freed as the backward completes it, and the peak holds
    52,608 bytes of gradients: the full gradients of the buckets in flight and the shards of those
    already reduced."""
    whole, small = (measured[c] for c in MULTI if c.model == "llama" and c.compute_config.zero_stage == 2)
    assert [m["grad_bytes"] for m in whole] == [90752, 90752]
    assert [m["grad_bytes"] for m in small] == [52608, 52608]


MIXED = [
    mixed("llama", "dp", 1, 2),
    mixed("llama", "tp", 2, 2),
    mixed("llama", "dp", 1, 2, zero()),
    mixed("llama", "dp", 1, 2, zero(stage=2)),
    mixed("llama", "dp", 1, 2, zero(stage=2) + buckets(16 * 1024)),
    mixed("llama", "dp", 1, 2, buckets(16 * 1024)),                  # the fp32 copy made a bucket at a time
    mixed("gpt", "pp", 2, 2, pipeline("1f1b", 2, 4)),
    mixed("llama_e2e", "tp", 2, 2),                                  # a bf16 cross-entropy split by vocabulary
]


@pytest.mark.multiprocess
def test_memory_model_is_exact_with_mixed_precision(tmp_path):
    """bf16 parameters, gradients and activations, fp32 masters (in ``optimizer_bytes``) and state,
    fp32 gradients after the step: the plan equals the meter to the byte. The fp32 gradients can
    make the step the peak moment: the pipeline's last stage (rank 1) peaks there, with 110,080
    bytes of fp32 gradients (twice its bf16 ones) and no activations."""
    for case, measured in run_cases(measure_memory, 2, MIXED, str(tmp_path)).items():
        _equal(case, predicted_memory(case), measured)
        for m in measured:
            sharing = 2 if case.compute_config.use_zero else 1      # ranks that split the masters and state
            assert m["optimizer_bytes"] * sharing >= (4 + 8) * m["param_bytes"] // 2, (case, m)   # per 2-byte parameter
        assert measured[0]["activation_bytes"] > 0
        if case.compute_config.use_pipeline:
            assert measured[1]["grad_bytes"] == 110080 and measured[1]["activation_bytes"] == 0


ZERO3 = [
    Case("llama", "dp", 1, 2, optimizer="adamw", config=zero(stage=3)),
    Case("gpt", "dp", 1, 2, optimizer="adamw", config=zero(stage=3) + (("zero_reshard_after_forward", False),)),
    mixed("llama", "dp", 1, 2, zero(stage=3)),                       # fp32 master shards only: no bf16 shard kept
    Case("gpt", "pp", 2, 2, optimizer="adamw", config=pipeline("1f1b", 2, 4) + zero(stage=3)),
    Case("gpt", "pp", 2, 2, optimizer="adamw", config=pipeline("zb_h1", 2, 4) + zero(stage=3)),   # gathered B to W
    Case("gpt", "pp", 2, 2, config=pipeline("1f1b_interleaved", 4, 4) + zero(stage=3)),
]


@pytest.mark.multiprocess
def test_memory_model_is_exact_under_zero3(tmp_path):
    """Shards, gathered units and gradients reduce-scattered per unit: the plan equals the meter."""
    for case, measured in run_cases(measure_memory, 2, ZERO3, str(tmp_path)).items():
        _check(case, predicted_memory(case), measured)
        assert all(m["gathered_bytes"] > 0 for m in measured), (case, measured)


FOUR = [
    Case("gpt", "hybrid", 4, 4, optimizer="adamw", config=pipeline("1f1b", 2, 4)),
    Case("gpt", "pp", 4, 4, config=pipeline("chimera_direct", 4, 4)),
    Case("mlp", "dp", 1, 4, optimizer="adamw", config=zero(2)),
    Case("llama", "tp", 2, 4, optimizer="momentum", config=zero()),
    Case("mlp", "dp", 1, 4, optimizer="adamw", config=zero(2, stage=2)),
    Case("mlp", "dp", 1, 4, optimizer="adamw", config=zero(stage=2) + buckets(2048)),
    Case("gpt", "pp", 2, 4, optimizer="adamw", config=pipeline("1f1b", 2, 4) + zero(stage=2)),
    Case("gpt", "tp", 4, 4, config=sequence_parallel()),
    Case("gpt", "pp", 4, 4, config=pipeline("zb_h1", 4, 4)),
    Case("gpt", "hybrid", 4, 4, optimizer="adamw", config=pipeline("zbv", 4, 4)),
    Case("llama", "tp", 2, 4, optimizer="adamw", config=zero(stage=3)),          # 2D: shards of tp slices
    Case("mlp", "dp", 1, 4, optimizer="adamw", config=zero(2, stage=3)),         # hybrid sharding, one unit
]


@pytest.mark.multiprocess
def test_memory_model_is_exact_on_four_ranks(tmp_path):
    for case, measured in run_cases(measure_memory, 4, FOUR, str(tmp_path)).items():
        _check(case, predicted_memory(case), measured)


# -- against a count of the tensors themselves -------------------------------------------------------

def _nbytes(tensors) -> int:
    """Bytes of distinct storages, counted here from the tensors (not with nbscaler's meter)."""
    seen = {}
    for t in tensors:
        if t is not None:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _saved_by_graph(loss, weights) -> int:
    """Bytes of the tensors the autograd graph behind ``loss`` keeps for the backward (its nodes'
    ``_saved_*`` attributes and custom functions' ``saved_tensors``), weights left out, and the
    Python numbers autograd wraps into 0-d double tensors (``x / scale``), which it keeps as numbers."""
    skip = {w.untyped_storage().data_ptr() for w in weights}
    found, seen, todo = [], set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        values = [getattr(node, a) for a in dir(node) if a.startswith("_saved_")]
        values += list(getattr(node, "saved_tensors", None) or ())
        for v in values:
            for t in (v if isinstance(v, (list, tuple)) else [v]):
                number = isinstance(t, torch.Tensor) and t.dim() == 0 and t.dtype == torch.float64
                if isinstance(t, torch.Tensor) and not number and t.untyped_storage().data_ptr() not in skip:
                    found.append(t)
        todo += [fn for fn, _ in node.next_functions]
    return _nbytes(found)


def counted_in_step(cases, gen_dir):
    """Per case, on this rank, the second step counted directly: activations at the end of the
    forward (not for end2end modules, whose forward and backward run in one call), gradients at
    the end of the backward, the most gradients held at any point of it (a tensor hook on every
    parameter sees each gradient just before it is accumulated), and the gradients, parameters,
    buffers and optimizer state after the step; and ``MemoryMeter``'s row of the same step."""
    import torch.distributed as dist
    from nbscaler.runtime.memory import MemoryMeter
    from tests.multiprocess import parallel_model, samples, step_losses
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = []
    for case in cases:
        model = parallel_model(case, gen_dir)
        opt = case.make_optimizer(model)
        params = list(model.parameters())
        shards = [p for g in opt.param_groups for p in g["params"]]
        grads = lambda: _nbytes([p.grad for p in params + shards])
        most = [0]

        def before_accumulating(g, p):
            most[0] = max(most[0], grads() + (g.untyped_storage().nbytes() if p.grad is None else 0))
        handles = [p.register_hook(lambda g, p=p: before_accumulating(g, p)) for p in params]
        for step in range(2):
            opt.zero_grad()
            most[0], activations = 0, None
            with MemoryMeter(model, opt) as meter:
                losses = step_losses(model, case, samples(case, step, rank // case.plan_ngpus))
                if not case.compute_config.use_end2end:
                    activations = _saved_by_graph(sum(losses), params + list(model.buffers()))
                    sum(losses).backward()
                backward = grads()
                opt.step()
        for h in handles:
            h.remove()
        out.append({"meter": meter.stats(), "activations": activations, "backward": backward, "most": most[0], "step": grads(),
                    "held": _nbytes(params) + _nbytes(model.buffers())
                    + _nbytes(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))})
    return out


COUNTED = [
    Case("llama", "dp", 1, 2, optimizer="adamw"),
    Case("llama", "dp", 1, 2, optimizer="adamw", config=zero()),
    Case("llama", "dp", 1, 2, optimizer="adamw", config=zero(stage=2)),
    Case("gpt", "pp", 2, 2, optimizer="adamw", config=pipeline("1f1b", 2, 4)),
    Case("gpt", "pp", 2, 2, optimizer="adamw", config=pipeline("gpipe", 2, 4)),
    Case("gpt", "pp", 2, 2, optimizer="momentum", config=pipeline("1f1b_plus", 2, 4)),
]


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    return run_cases(counted_in_step, 2, COUNTED, str(tmp_path_factory.mktemp("count")))


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", COUNTED, ids=str)
def test_peak_holds_what_a_count_of_the_tensors_finds(counted, case):
    """The plan's peak against the tensors counted on the ranks. Every moment counted (the end of
    the forward, every instant of the backward, after the step) fits under ``peak_bytes``, and the
    gradients at the peak are the most the backward held: on the Llama, dp with AdamW on two
    ranks, 90,752 bytes, all of them, under ZeRO stage 1 too (they are reduce-scattered only when
    the optimizer steps) and, as the model fits in one bucket, under stage 2. Without a pipeline
    the peak is the backward, counted as the forward's activations with those gradients."""
    _check(case, predicted_memory(case), [c["meter"] for c in counted[case]])
    for p, c in zip(predicted_memory(case), counted[case]):
        always = p["param_bytes"] + p["buffer_bytes"] + p["optimizer_bytes"]
        assert always == c["held"]
        assert p["grad_bytes"] >= max(c["backward"], c["step"]) and p["grad_bytes"] <= c["most"]
        assert p["peak_bytes"] >= always + max(c["most"], c["step"])
        if not case.compute_config.use_pipeline:
            assert p["grad_bytes"] == c["most"] == 90752, (case, p, c)
            assert p["activation_bytes"] == c["activations"]
            assert p["peak_bytes"] == always + c["activations"] + c["most"]
        else:
            assert p["grad_bytes"] == c["backward"]          # every gradient of the stage, after its first backward


def test_zero1_plan_keeps_the_full_gradients_until_the_step():
    """The Llama of the report (vocabulary 128, 4 layers, d=64), dp on 2 ranks with AdamW: right
    after the backward a rank holds all 657,664 bytes of gradients; the plan said 328,832 (the
    shard they are reduce-scattered into at the step), and a peak without the other half."""
    import nbscaler
    from nbscaler import ComputeConfig
    from nbscaler.models.llama import Llama, LlamaConfig
    torch.manual_seed(0)
    model = Llama(LlamaConfig(vocab_size=128, n_layer=4, d_model=64, n_head=4, n_kv_head=2))
    idx = torch.randint(0, 128, (4, 33))
    plan = nbscaler.plan(model, {"idx": idx[:, :-1].contiguous(), "targets": idx[:, 1:].contiguous()}, "dp",
                         ComputeConfig(1, 2, use_zero=True, zero_stage=1))
    row = plan.memory(torch.optim.AdamW).loc[0]
    assert row["grad_bytes"] == sum(p.numel() * 4 for p in model.parameters()) == 657664
    assert row["peak_bytes"] == sum(row[str(c)] for c in MEMORY_COLUMNS[1:-1])


@pytest.mark.parametrize("hardware", [
    "H100-SXM-80GB",
    pytest.param(None, marks=pytest.mark.slow, id="here"),      # profiles every bf16 op on this CPU first
])
def test_summary_counts_the_master_copies(hardware):
    """``plan.summary(..., master_dtype=)`` and ``plan.memory(..., master_dtype=)`` price the bf16
    module's fp32 masters and state, as the meter counts them (the exact tests above), as the
    default recipe does; with ``master_dtype=None`` the optimizer state is bf16. The memory columns are the same on a target
    and on this machine, whose step time is profiled."""
    import nbscaler
    from nbscaler import ComputeConfig as Config, Hardware
    from nbscaler.models.llama import Llama, LlamaConfig
    model = Llama(LlamaConfig(vocab_size=128, n_layer=2, d_model=64, n_head=4, n_kv_head=2)).to(torch.bfloat16)
    idx = torch.randint(0, 128, (4, 33))
    plan = nbscaler.plan(model, {"idx": idx[:, :-1].contiguous(), "targets": idx[:, 1:].contiguous()}, "dp",
                         Config(1, 1))
    n, counters = sum(p.numel() for p in model.parameters()), 4 * len(list(model.parameters()))
    target = Hardware.named(hardware) if hardware else None
    summary = plan.summary(torch.optim.AdamW, hardware=target, master_dtype=torch.float32).loc[0]
    memory = plan.memory(torch.optim.AdamW, master_dtype=torch.float32).loc[0]
    assert all(summary[str(c)] == memory[str(c)] for c in MEMORY_COLUMNS)
    assert (memory["param_bytes"], memory["optimizer_bytes"]) == (2 * n, (4 + 8) * n + counters)
    assert memory["grad_bytes"] in (2 * n, 4 * n)           # bf16 in the backward, fp32 at the step
    assert plan.memory(torch.optim.AdamW, master_dtype=None).loc[0, "optimizer_bytes"] == (2 + 2) * n + counters
    assert plan.memory().equals(plan.memory(torch.optim.AdamW, master_dtype=torch.float32))   # the one default


CONTEXT = [
    Case("gpt", "tp", 2, 2, optimizer="adamw", config=context_parallel(2, "ring")),        # keys round a ring
    Case("gpt", "tp", 2, 2, config=context_parallel(2)),                                  # keys gathered
    Case("llama", "tp", 2, 2, optimizer="adamw", config=context_parallel(2)),             # a written-out attention
    Case("llama_e2e", "hybrid", 2, 2, config=pipeline("1f1b", 1, 2) + context_parallel(2)),
    # ZeRO over the context-parallel devices: each keeps half of the state (and gradients, weights)
    Case("gpt", "tp", 2, 2, optimizer="adamw", config=context_parallel(2) + zero()),
    Case("gpt", "tp", 2, 2, optimizer="adamw", config=context_parallel(2, "ring") + zero(stage=2)),
    Case("llama", "tp", 2, 2, optimizer="adamw", config=context_parallel(2) + zero(stage=3)),
]


@pytest.mark.multiprocess
def test_memory_model_is_exact_under_context_parallelism(tmp_path):
    """The sequence split over 2 ranks: activations on this device's chunks, keys and values
    gathered for the attention (or passed round a ring, which saves only this device's block):
    the plan equals the meter."""
    for case, measured in run_cases(measure_memory, 2, CONTEXT, str(tmp_path)).items():
        _check(case, predicted_memory(case), measured)


@pytest.mark.multiprocess
def test_memory_model_is_exact_with_tensor_parallelism_inside_context_parallelism(tmp_path):
    """4 ranks as 2 context-parallel groups of 2 tensor-parallel neighbours: each rank holds half the
    weights and a quarter of each layer's activations, gathers its group's keys and values (or
    passes them round its ring) and all-reduces its row-parallel outputs inside its pair. The plan
    equals the meter."""
    cases = [Case("gpt", "tp", 4, 4, optimizer="adamw", config=context_parallel(2, "ring")),
             Case("llama", "tp", 4, 4, optimizer="adamw", config=context_parallel(2)),
             Case("llama_one_sequence", "tp", 4, 4, optimizer="adamw", config=context_parallel(2)),   # logits split
             Case("gpt", "tp", 4, 4, optimizer="adamw", config=context_parallel(2, sequence_parallel=True)),
             # ZeRO over the two holders of each slice: each rank keeps half of its slice's state
             Case("gpt", "tp", 4, 4, optimizer="adamw", config=context_parallel(2) + zero(stage=2)),
             Case("llama", "tp", 4, 4, optimizer="adamw", config=context_parallel(2) + zero(stage=3))]
    for case, measured in run_cases(measure_memory, 4, cases, str(tmp_path)).items():
        _check(case, predicted_memory(case), measured)


EXPERTS = [
    Case("moe_capacity", "tp", 2, 2, optimizer="adamw", config=expert_parallel(2)),
    Case("moe_capacity", "tp", 2, 2, config=expert_parallel(2) + zero(stage=2)),
]


@pytest.mark.multiprocess
def test_memory_model_is_exact_under_expert_parallelism(tmp_path):
    """Experts split over 2 ranks, each device's capacity buffers sent to them and back: the plan
    equals the meter. (Dropless routing sends as many rows as the routing gives each device; the
    model prices a routing that loads every expert alike, as the one-process dropless case above
    is exact for the routing it sees.)"""
    for case, measured in run_cases(measure_memory, 2, EXPERTS, str(tmp_path)).items():
        _check(case, predicted_memory(case), measured)


@pytest.mark.multiprocess
def test_memory_model_is_exact_with_experts_cut_by_hidden_unit_too(tmp_path):
    """4 ranks as 2 expert groups of 2, each rank half of its group's experts' hidden units: every
    buffer sent to both ranks of its group and both partial sums back. The plan equals the meter,
    and each rank holds a quarter of the experts' bytes."""
    cases = [Case("moe_capacity", "tp", 4, 4, optimizer="adamw", config=expert_parallel(2, hidden=2)),
             Case("moe_capacity", "tp", 4, 4, config=expert_parallel(2, around="tp", hidden=2) + zero(stage=2))]
    for case, measured in run_cases(measure_memory, 4, cases, str(tmp_path)).items():
        _check(case, predicted_memory(case), measured)
    whole = predicted_memory(Case("moe_capacity", "dp", 1, 4))[0]["param_bytes"]
    expert_bytes = sum(t.numel() * 4 for name, t in build("moe_capacity").named_parameters() if ".experts." in name)
    assert whole - predicted_memory(cases[0])[0]["param_bytes"] == expert_bytes * 3 // 4
    # Mixtral's own experts, through their chunk and transposes: the state is exact (its activations
    # follow the routing, as the next test says), and each rank keeps a quarter of the experts
    mixtral = Case("hf_mixtral", "tp", 4, 4, optimizer="adamw", config=expert_parallel(2, hidden=2))
    measured = run_cases(measure_memory, 4, [mixtral], str(tmp_path / "hf"))[mixtral]
    for p, m in zip(predicted_memory(mixtral), measured):
        for column in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert p[column] == m[column], f"rank {m['rank']}: {column} predicted {p[column]}, measured {m[column]}"
    whole = predicted_memory(Case("hf_mixtral", "dp", 1, 4))[0]["param_bytes"]
    expert_bytes = sum(t.numel() * 4 for name, t in build("hf_mixtral").named_parameters() if ".experts." in name)
    assert whole - predicted_memory(mixtral)[0]["param_bytes"] == expert_bytes * 3 // 4


@pytest.mark.multiprocess
def test_hugging_face_experts_keep_their_share_split_either_way(tmp_path):
    """Mixtral's own experts on 2 ranks. Tensor parallel inside the experts: each rank stores half of
    every expert's hidden units (``gate_up_proj`` cut strided, ``down_proj`` by column), and every
    category equals the meter. Expert parallel: each rank stores half of the experts, with half their
    gradients and AdamW state, and the plan's weights, gradients and optimizer state equal the meter's
    (its activations depend on the routing, which these random weights do not balance; the docstring
    above says why only capacity routing is exact there). Either way half the experts' bytes are gone."""
    split = Case("hf_mixtral", "tp", 2, 2, optimizer="adamw")
    experts = Case("hf_mixtral", "tp", 2, 2, optimizer="adamw", config=expert_parallel(2))
    measured = run_cases(measure_memory, 2, [split, experts], str(tmp_path))
    _check(split, predicted_memory(split), measured[split])
    predicted = predicted_memory(experts)
    for p, m in zip(predicted, measured[experts]):
        for column in ("param_bytes", "grad_bytes", "optimizer_bytes"):
            assert p[column] == m[column], f"rank {m['rank']}: {column} predicted {p[column]}, measured {m[column]}"
    whole = predicted_memory(Case("hf_mixtral", "dp", 1, 2, optimizer="adamw"))[0]["param_bytes"]
    expert_bytes = sum(t.numel() * 4 for name, t in build("hf_mixtral").named_parameters() if ".experts." in name)
    assert whole - predicted[0]["param_bytes"] == expert_bytes // 2
    assert whole - predicted_memory(split)[0]["param_bytes"] > expert_bytes // 2     # attention split too


@pytest.mark.multiprocess
def test_a_routing_imbalance_costs_what_the_meter_measures_per_pair(tmp_path):
    """Dropless experts over 2 ranks: the real routing of the step measured gives one rank more
    (token, expert) pairs than the balanced share and the other fewer. Priced with one more pair
    from each device in each exchange (``Recipe(expert_imbalance=...)``), the memory model adds per
    pair exactly what each rank's meter shows per pair over or under the balanced share, in its
    activations and at its peak."""
    case = Case("moe", "tp", 2, 2, optimizer="adamw", config=expert_parallel(2))
    measured = run_cases(measure_memory, 2, [case], str(tmp_path))[case]
    model = build(case.model)                           # the routing of the step measured, the second
    single_steps(model, case.make_optimizer(model), case, range(1), case.units)
    with RoutingLog() as log:
        model(**samples(case, 1, 0)[0])
    routed = log.frame().groupby("expert").routed.sum()     # both blocks' pairs
    experts, blocks, devices = len(routed), 2, 2
    pairs = [int(routed.loc[r * experts // devices:(r + 1) * experts // devices - 1].sum()) for r in range(devices)]
    balanced = sum(pairs) // devices
    assert pairs[0] != balanced, pairs                  # the check needs a rank off the balanced share
    # each device routes 2 sequences of 8 tokens, top-2: 32 rows, 16 to each device; 17/16 of the
    # mean makes each exchange bring one row more from each device, in each block
    more = blocks * devices
    cls, kwargs = OPTIMIZERS[case.optimizer]
    even, heavier = (memory_per_rank(PlacedGraphs(*plan_inputs(case)), Recipe(cls, kwargs, expert_imbalance=imbalance))
                     for imbalance in (1.0, 17 / 16))
    for column in ("activation_bytes", "peak_bytes"):
        per_pair = (heavier[column][0] - even[column][0]) / more
        assert per_pair > 0
        for rank in range(devices):
            assert measured[rank][column] - even[column][rank] == per_pair * (pairs[rank] - balanced), (column, rank)
