"""The bytes priced are the bytes the runtime moves, per backend.

On gloo the ranks run under ``torch.profiler``, which names each collective the backend itself
runs (``gloo:all_reduce``, ``gloo:all_to_all``, ...) with its local input: that is measured apart
from ``nbscaler.layouts.EMULATED``, so a wrong row there (or a runtime that emulates where the
table says it does not) shows up as a difference. nccl needs a GPU per rank, so its side is
checked by what the runtime calls there and by what the table and the models price.
"""

from typing import Dict, List, Tuple

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import nbscaler
from nbscaler.cost.comm_model import CommModel
from nbscaler.cost.nccl import NcclModel
from nbscaler.cost.hardware import Hardware
from nbscaler.layouts import COLLECTIVES, WIRE_SHARE, Backend, Collective, runs, wire_factor
from nbscaler.planning.tables import traffic_per_rank
from nbscaler.runtime import collectives as comm
from nbscaler import losses as vocab_losses
from nbscaler.runtime.groups import get_group
from tests.models import batch, build
from nbscaler.recipe import Recipe
from tests.multiprocess import (OPTIMIZERS, Case, context_parallel, expert_parallel, parallel_model, run_ranks, samples,
                                sequence_parallel, step_losses, zero)

N = 2
CASES = [
    Case("gpt", "tp", 2, 2, config=sequence_parallel()),        # reduce-scatters forward and backward
    Case("mlp", "dp", 1, 2, config=zero(stage=2)),              # ZeRO-2's gradient reduce-scatter
    Case("gpt", "dp", 1, 2, config=zero(stage=3)),              # ZeRO-3: each unit gathered twice, reduced once
    Case("mlp", "dp", 1, 2, optimizer="adamw", module_dtype=torch.bfloat16, master_dtype=torch.float32,
         grad_reduce_dtype=torch.float32),                       # bf16 gradients all-reduced in fp32
    Case("mlp", "dp", 1, 2, optimizer="adamw", config=zero(stage=2), module_dtype=torch.bfloat16,
         master_dtype=torch.float32, grad_reduce_dtype=torch.float32),   # fp32 reduce-scatter, bf16 all-gather
    # experts over the 2 ranks, their capacity buffers out and back by all-to-all (fixed sizes: dropless
    # routing sends as many rows as the routing gives each device, which the table prices balanced)
    Case("moe_capacity", "tp", 2, 2, config=expert_parallel(2)),
    # the batch cut in halves, with no gather in the backward: the input takes no gradient
    Case("mlp", "data", 2, 2),
    # ZeRO over the context-parallel pair: one reduce-scatter sums the halves' gradients and splits them
    Case("gpt", "tp", 2, 2, config=context_parallel(2) + zero()),
    Case("gpt", "tp", 2, 2, config=context_parallel(2) + zero(stage=3)),
]


def _sent(prof: profile, n: int = N) -> float:
    """Bytes this rank sent in the collectives the backend ran, with ring algorithms over ``n``, and
    in its sends (a context-parallel ring's passes), whole."""
    total = 0.0
    for e in prof.events():
        if e.name.startswith("gloo:") and e.input_shapes:
            name = e.name.removeprefix("gloo:")
            if name == "recv":              # what the peer sent, counted on its side
                continue
            numel = torch.Size(e.input_shapes[0]).numel()
            itemsize = {"float": 4, "c10::BFloat16": 2, "long int": 8}[e.input_dtypes[0]]
            total += (1.0 if name == "send" else WIRE_SHARE[Collective(name)](n)) * numel * itemsize
    return total


def _each_collective(dtype: torch.dtype) -> Dict[str, Tuple[float, int]]:
    """Forward and backward of every collective once on a tensor of whole size ``T``: bytes sent
    (measured) and ``T``."""
    group, rank = get_group(range(N)), dist.get_rank()
    full = torch.randn(4 * N, 6, dtype=dtype)
    piece = full.chunk(N, 0)[rank]
    inputs = {"all_gather": piece, "all_gather_sum_grad": piece, "chunk": full, "all_reduce": full,
              "reduce_scatter": full, "all_to_all": piece, "sum_grad": full, "first_only": full}
    calls = {"all_gather": lambda x: comm.all_gather(x, 0, group), "chunk": lambda x: comm.chunk(x, 0, group),
             "all_gather_sum_grad": lambda x: comm.all_gather_sum_grad(x, 0, group),
             "all_reduce": lambda x: comm.all_reduce(x, group), "sum_grad": lambda x: comm.sum_grad(x, group),
             "reduce_scatter": lambda x: comm.reduce_scatter(x, 0, group),
             "all_to_all": lambda x: comm.all_to_all(x, 1, 0, group), "first_only": lambda x: comm.first_only(x, group)}
    out = {}
    for fn, x in inputs.items():
        x = x.clone().requires_grad_()
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            calls[fn](x).float().pow(2).sum().backward()
        out[fn] = (_sent(prof), full.numel() * full.element_size())
    return out


def _storages() -> Dict[str, Tuple[int, int]]:
    """Bytes of the storage a reduce-scatter and an all-to-all return on this rank, and of what
    the fake replay (``cost.local``) makes for them: the memory model counts the same."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from nbscaler.cost.local import _collective
    group, rank = get_group(range(N)), dist.get_rank()
    made = {"reduce_scatter": comm.reduce_scatter(torch.ones(4 * N, 6), 0, group),
            "all_to_all": comm.all_to_all(torch.ones(4, 2 * N), 1, 0, group)}
    with FakeTensorMode():
        fake = {"reduce_scatter": _collective("reduce_scatter", torch.ones(4 * N, 6), 0, None, N, rank),
                "all_to_all": _collective("all_to_all", torch.ones(4, 2 * N), 1, 0, N, rank)}
    return {fn: (t.untyped_storage().nbytes(), fake[fn].untyped_storage().nbytes()) for fn, t in made.items()}


@pytest.mark.multiprocess
def test_the_fake_replay_holds_what_the_collectives_return():
    """A dim-0 reduce-scatter returns a slice of its own, not a view of a whole summed tensor (as
    the all-reduce it replaced did), and the memory model counts that."""
    for per_rank in run_ranks(_storages, N):
        assert all(real == fake for real, fake in per_rank.values()), per_rank
        assert per_rank["reduce_scatter"][0] == 4 * 6 * 4          # its slice, fp32


def _priced(fn: str, tensor_bytes: int, backend: str) -> float:
    """The traffic table's bytes (``comm.traffic``) for ``fn``'s forward and backward on ``backend``."""
    spec = COLLECTIVES[fn]
    forward = spec.forward_share(N) * tensor_bytes * wire_factor(backend, spec.priced_as, N) if spec.priced_as else 0
    if spec.backward is None:
        return forward
    primitive = COLLECTIVES[spec.backward].priced_as
    return forward + spec.backward_share(N) * tensor_bytes * wire_factor(backend, primitive, N)


@pytest.mark.multiprocess
def test_each_collective_sends_what_its_row_prices_on_gloo():
    for dtype in (torch.float32, torch.bfloat16):
        for fn, (sent, tensor_bytes) in run_ranks(_each_collective, N, dtype)[0].items():
            assert sent == pytest.approx(_priced(fn, tensor_bytes, Backend.GLOO)), (fn, dtype)


def _step_sent(cases: List[Case], gen_dir: str, n: int = N) -> List[float]:
    """Bytes this rank sent in one training step of each case, less what the vocabulary-parallel
    cross-entropy's two inside all-reduces sent (``nbscaler.losses``: not in the plan's table)."""
    inside, out = [0.0], []
    all_reduce = vocab_losses._all_reduce

    def counted(x, op, group):
        inside[0] += WIRE_SHARE[Collective.ALL_REDUCE](n) * x.numel() * x.element_size()
        return all_reduce(x, op, group)

    vocab_losses._all_reduce = counted
    try:
        for case in cases:
            model = parallel_model(case, gen_dir)
            opt = case.make_optimizer(model)
            inside[0] = 0.0
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                losses = step_losses(model, case, samples(case, 0, dist.get_rank() // case.plan_ngpus))
                if not case.compute_config.use_end2end:
                    sum(losses).backward()
                opt.sync_shard_grad()
                opt.step()
            out.append(_sent(prof, n) - inside[0])
    finally:
        vocab_losses._all_reduce = all_reduce
    return out


@pytest.mark.multiprocess
def test_a_training_step_sends_what_the_plan_prices_on_gloo(tmp_path):
    """Sequence parallelism, ZeRO-2 and ZeRO-3 on 2 gloo ranks: each rank's bytes in one step are the
    plan's traffic as gloo runs it (its reduce-scatters as all-reduces; ZeRO-3's per unit,
    ``cost.fsdp.sent_bytes``)."""
    measured = run_ranks(_step_sent, N, CASES, str(tmp_path))
    for i, case in enumerate(CASES):
        plan = nbscaler.plan(build(case.model), batch(case.model, 0), case.policy, case.compute_config,
                             module_dtype=case.module_dtype)
        recipe = Recipe(*OPTIMIZERS[case.optimizer], master_dtype=case.master_dtype,
                        grad_reduce_dtype=case.grad_reduce_dtype)
        memory = plan.memory(recipe=recipe)
        params = dict(zip(memory["rank"], memory["param_bytes"]))
        priced = traffic_per_rank(plan, params, Backend.GLOO, recipe)["bytes_sent"]
        ideal = traffic_per_rank(plan, params, Backend.NCCL, recipe)["bytes_sent"]
        for rank in range(N):
            assert measured[rank][i] == pytest.approx(priced[rank]), (case, rank)
            # a reduce-scatter in the step
            emulated = case.compute_config.use_zero or (case.policy == "tp" and case.model != "moe_capacity")
            assert measured[rank][i] > ideal[rank] if emulated else measured[rank][i] == ideal[rank], case


def test_on_nccl_the_runtime_calls_the_real_collectives(monkeypatch):
    """On nccl (no row in ``EMULATED``) a reduce-scatter and an all-to-all call the backend's own,
    which NCCL runs natively; the traffic table and both models price the ideal collectives."""
    called = []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: N)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    for name in ("reduce_scatter_single", "reduce_scatter_tensor"):
        monkeypatch.setattr(dist, name, lambda out, x, group=None: called.append("reduce_scatter"), raising=False)
    monkeypatch.setattr(dist, "all_to_all_single", lambda out, x, group=None: called.append("all_to_all"))
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: called.append("all_reduce"))
    group = object()
    comm.reduce_scatter(torch.ones(4, 3), 0, group)
    comm.all_to_all(torch.ones(2, 4), 1, 0, group)
    assert called == ["reduce_scatter", "all_to_all"]
    assert runs(Backend.NCCL, Collective.REDUCE_SCATTER) == Collective.REDUCE_SCATTER
    nccl, gloo = NcclModel(Hardware.named("H100-SXM-80GB")), CommModel(1e-5, 1e-10, backend=Backend.GLOO)
    MB = 2 ** 20
    # at 64 MB bandwidth rules (at 1 MB the tree's few steps let an all-reduce beat the ring's seven)
    assert nccl.forward("reduce_scatter", 64 * MB, 8) < nccl.forward("all_reduce", 64 * MB, 8)
    assert gloo.forward("reduce_scatter", MB, 8) == gloo.forward("all_reduce", MB, 8)
    assert CommModel(1e-5, 1e-10, backend=Backend.NCCL).forward("reduce_scatter", MB, 8) < gloo.forward(
        "reduce_scatter", MB, 8)


def _sent_as_priced_on_4_ranks(cases: List[Case], tmp_path, n: int) -> List[List[float]]:
    """Each of 4 ranks' bytes in one step of each case (collectives priced over groups of ``n``),
    checked against the plan's traffic table; returns them per rank."""
    measured = run_ranks(_step_sent, 4, cases, str(tmp_path), n)
    for i, case in enumerate(cases):
        plan = nbscaler.plan(build(case.model), batch(case.model, 0), case.policy, case.compute_config)
        params = dict(zip(plan.memory()["rank"], plan.memory()["param_bytes"]))
        priced = traffic_per_rank(plan, params, Backend.GLOO, Recipe(*OPTIMIZERS[case.optimizer]))["bytes_sent"]
        for rank in range(4):
            assert measured[rank][i] == pytest.approx(priced[rank]), (case, rank)
    return measured


@pytest.mark.multiprocess
def test_expert_groups_send_what_the_plan_prices_on_4_ranks(tmp_path):
    """Experts over 2 groups of 2 ranks, each rank half of its group's hidden units
    (``expert_tensor_parallel``): every capacity buffer goes to both ranks of its experts' group and
    both partial sums come back, more bytes than expert parallelism over the 4 ranks alone; each
    rank's bytes in one step equal the plan's traffic."""
    cases = [Case("moe_capacity", "tp", 4, 4, config=expert_parallel(2, hidden=2)),
             Case("moe_capacity", "tp", 4, 4, config=expert_parallel(4))]
    measured = _sent_as_priced_on_4_ranks(cases, tmp_path, 4)
    grouped, alone = (sum(measured[r][i] for r in range(4)) for i in range(2))
    assert grouped > alone


@pytest.mark.multiprocess
def test_tp_inside_cp_sends_what_the_plan_prices_on_4_ranks(tmp_path):
    """tp 2 inside cp 2: the row-parallel all-reduces inside each pair, the keys gathered (or passed
    round the ring) across, the token count, the vocabulary-split loss, and each weight slice's
    gradient summed with its counterpart's. Each rank's bytes in one step equal the plan's traffic
    (every group, of either axis, has 2 ranks, which the measure assumes: sequence parallelism would
    sum its norms' gradients over all 4)."""
    cases = [Case("gpt", "tp", 4, 4, config=context_parallel(2)),
             Case("gpt", "tp", 4, 4, config=context_parallel(2, "ring")),
             Case("llama_one_sequence", "tp", 4, 4, config=context_parallel(2))]
    _sent_as_priced_on_4_ranks(cases, tmp_path, 2)
