"""The two sides of every comparison in ``benchmarks/native.py``: one GPT, one batch maker, and for
each kind of parallelism a way to train it with nbscaler and with PyTorch's own implementation
(expert parallelism trains the shipped MoE Llama instead, against a layer written by hand).

A *side* is built on every rank and offers ``step() -> float`` (one optimizer step; returns this
rank's loss of the first micro-batch, or NaN where this rank sees no loss), and ``nbytes()`` (the
parameters, gradients and optimizer state this rank holds right now, as ``(param, grad, optim)``).
Both sides of a pair start from the same weights and see the same batches, so their first losses
must agree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from nbscaler import ComputeConfig, build_optimizer, parallelize


@dataclass(frozen=True)
class Setup:
    """The model and data of one benchmark run."""

    n_layer: int = 4
    d_model: int = 256
    n_head: int = 8
    vocab: int = 512
    seq_len: int = 64
    micro_batch: int = 4         # sequences per micro-batch (per rank for data parallelism)
    micros: int = 8              # micro-batches per pipeline step


# -- the model ---------------------------------------------------------------------------------
class Attention(nn.Module):
    """Causal self-attention with separate q, k, v projections. Head counts are read from the
    local width (``-1``), so the same code runs on a column-split (tensor-parallel) copy."""

    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.hd = d // n_head
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, -1, self.hd).transpose(1, 2)          # (B, nh, T, hs)
        k = self.k(x).view(B, T, -1, self.hd).transpose(1, 2)
        v = self.v(x).view(B, T, -1, self.hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)     # (B, nh, T, hs)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class Block(nn.Module):
    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), Attention(d, n_head)
        self.ln2, self.fc, self.proj = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class BenchGPT(nn.Module):
    """Embeddings, ``n_layer`` blocks, a head; ``forward(batch)`` returns the next-token loss."""

    def __init__(self, s: Setup):
        super().__init__()
        self.tok, self.pos = nn.Embedding(s.vocab, s.d_model), nn.Embedding(s.seq_len, s.d_model)
        self.blocks = nn.ModuleList(Block(s.d_model, s.n_head) for _ in range(s.n_layer))
        self.ln_f, self.head = nn.LayerNorm(s.d_model), nn.Linear(s.d_model, s.vocab, bias=False)

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        return lm_loss(self.logits(batch["idx"], batch.get("pos")), batch["targets"])

    def logits(self, idx: torch.Tensor, pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``pos``: each token's position, ``(B, T)``; ``0 .. T-1`` when not given. PyTorch's context
        parallelism passes them, sharded with the tokens, so each shard embeds its own positions."""
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1)) if pos is None else pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))                                  # (B, T, vocab)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


class StageOf(nn.Module):
    """Blocks ``[lo, hi)`` of a ``BenchGPT``, with the embeddings on the first stage and the head
    on the last: one stage of the hand-split pipeline ``torch.distributed.pipelining`` runs."""

    def __init__(self, model: BenchGPT, lo: int, hi: int, first: bool, last: bool):
        super().__init__()
        self.first, self.last = first, last
        self.tok, self.pos = (model.tok, model.pos) if first else (None, None)
        self.blocks = nn.ModuleList(model.blocks[lo:hi])
        self.ln_f, self.head = (model.ln_f, model.head) if last else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.tok(x) + self.pos(torch.arange(x.size(1)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def make_batch(s: Setup, seed: int, rows: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, s.vocab, (rows, s.seq_len + 1), generator=g)
    return {"idx": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}


def build_model(s: Setup) -> BenchGPT:
    torch.manual_seed(0)
    return BenchGPT(s)


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


# -- bytes held ----------------------------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t       # a DTensor's own shard


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors by their local shard)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        storage = _local(t).untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            total += storage.nbytes()
    return total


def held_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> Tuple[int, int, int]:
    """``(parameters, gradients, optimizer state)`` this rank holds: storages counted once, the
    gradients of the module's and the optimizer's parameters, and optimizer parameters that are
    not views of the module's (a copy the optimizer updates) as state."""
    inner = getattr(optimizer, "optim", optimizer)          # ZeroRedundancyOptimizer wraps its local one
    params = list(module.parameters())
    own = {_local(p).untyped_storage()._cdata for p in params}
    updated = [p for g in inner.param_groups for p in g["params"]]
    extra = [p for p in updated if _local(p).untyped_storage()._cdata not in own]
    state = [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return (storage_bytes(params), storage_bytes([p.grad for p in params + updated]), storage_bytes(extra + state))


def peak_step_bytes(side: "Side") -> Tuple[int, int, int]:
    """``(total, activations, temporaries)``: the most bytes this rank held at once during one step,
    and how many of them were activations (allocated in the forward and still alive) and backward
    temporaries (allocated in the backward: gradients of activations, collective buffers), as
    PyTorch's ``MemTracker`` counts them (every tensor allocated in the step, plus the module's, the
    optimizer's parameters and its state held from before); the same instrument for both sides, so
    nothing nbscaler-specific decides the comparison."""
    from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
    inner = getattr(side.optimizer, "optim", side.optimizer)
    tracker = MemTracker()
    tracker.track_external(side.module, inner, *[p for g in inner.param_groups for p in g["params"]])
    with tracker:
        side.step()
    peak = tracker.get_tracker_snapshot("peak").values()
    return tuple(int(sum(per_device[key] for per_device in peak))
                 for key in ("Total", _MemRefType.ACT, _MemRefType.TEMP))


def counting_saved(side: "Side") -> Tuple[float, int]:
    """One ``side.step()`` under ``SavedTensorMeter``: its loss and the most bytes autograd held saved
    for the backward at once (DTensors by their local shard; the module's weights left out)."""
    from nbscaler.runtime.memory import SavedTensorMeter

    class LocalSavedMeter(SavedTensorMeter):
        @staticmethod
        def storage(t: torch.Tensor) -> torch.UntypedStorage:
            return _local(t).untyped_storage()
    weights = [_local(t).untyped_storage()._cdata for t in list(side.module.parameters()) + list(side.module.buffers())]
    with LocalSavedMeter(weights) as meter:
        loss = side.step()
    return loss, meter.peak


# -- sides -------------------------------------------------------------------------------------
class Side:
    """One way of training the model on this rank."""

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, step: Callable[[int], float]):
        self.module, self.optimizer, self._step = module, optimizer, step
        self.calls = 0

    def step(self) -> float:
        loss = self._step(self.calls)
        self.calls += 1
        return loss

    def nbytes(self) -> Tuple[int, int, int]:
        return held_bytes(self.module, self.optimizer)


def _plain_step(module, optimizer, batch_of: Callable[[int], Dict[str, torch.Tensor]]) -> Callable[[int], float]:
    def step(i: int) -> float:
        optimizer.zero_grad()
        loss = module(batch_of(i))
        loss.backward()
        optimizer.step()
        return float(loss)
    return step


def _rank_world() -> Tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _compile(s: Setup, policy: str, cfg: ComputeConfig, name: str, gen_dir: str, dtype=None):
    sample = make_batch(s, 0, s.micro_batch)
    return parallelize(build_model(s), {"batch": sample}, policy, cfg, gen_savedir=gen_dir,
                       instance_name=name, reuse="override", module_dtype=dtype)


def block_bytes(s: Setup, dtype: torch.dtype) -> int:
    """Bytes of one block's parameters in ``dtype``: the unit FSDP2 reduces when ``fully_shard``
    wraps every block (``torch_fsdp``)."""
    return sum(p.numel() for p in Block(s.d_model, s.n_head).parameters()) * dtype.itemsize


def nbscaler_data(s: Setup, gen_dir: str, zero_stage: int = 0, mixed: bool = False,
                  per_block: bool = False, reshard_after_forward: bool = True) -> Side:
    """Data parallelism (``dp``), with ZeRO stage 1, 2 or 3 when ``zero_stage`` says so; ``mixed``:
    the module in bf16, fp32 masters, state and gradient sums; ``per_block``: gradients reduced in
    buckets of one block's bytes (``block_bytes``), as FSDP2 reduces them, else in the default
    25 MiB buckets, as DDP does. Stage 3 reduces (and gathers) one unit at a time, each block and
    the rest of the model, whatever ``per_block`` says; ``reshard_after_forward`` is its
    ``ComputeConfig.zero_reshard_after_forward``, FSDP2's ``fully_shard`` argument of that name."""
    rank, world = _rank_world()
    zero: Dict[str, object] = {"use_zero": True, "zero_stage": zero_stage} if zero_stage else {}
    dtype = torch.bfloat16 if mixed else None
    if per_block:
        zero["reduce_bucket_bytes"] = block_bytes(s, dtype or torch.float32)
    name = f"dp_zero{zero_stage}_{dtype}_{world}" + ("_per_block" if per_block else "")
    if zero_stage == 3:
        zero["zero_reshard_after_forward"] = reshard_after_forward
        name += "_reshard" if reshard_after_forward else "_keep"
    pm = _compile(s, "dp", ComputeConfig(1, world, **zero), name, gen_dir, dtype)
    opt = build_optimizer(pm, torch.optim.AdamW, lr=1e-4, master_dtype=torch.float32 if mixed else None,
                          grad_reduce_dtype=torch.float32 if mixed else None)
    return Side(pm, opt, _plain_step(pm, opt, lambda i: make_batch(s, 100 * i + rank, s.micro_batch)))


def torch_ddp(s: Setup, zero: bool = False) -> Side:
    """``DistributedDataParallel``, with ``ZeroRedundancyOptimizer`` when ``zero``."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel
    rank, _ = _rank_world()
    model = DistributedDataParallel(build_model(s))
    opt = (ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4) if zero
           else adamw(model.parameters()))
    return Side(model, opt, _plain_step(model, opt, lambda i: make_batch(s, 100 * i + rank, s.micro_batch)))


def torch_ddp_autocast(s: Setup) -> Side:
    """``DistributedDataParallel`` on the fp32 model, the forward under bf16 ``torch.autocast``."""
    from torch.nn.parallel import DistributedDataParallel
    rank, _ = _rank_world()
    model = DistributedDataParallel(build_model(s))
    opt = adamw(model.parameters())
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def forward(batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast(device, dtype=torch.bfloat16):
            return model(batch)
    return Side(model, opt, _plain_step(forward, opt, lambda i: make_batch(s, 100 * i + rank, s.micro_batch)))


def torch_fsdp(s: Setup, mixed: bool = False, reshard_after_forward: bool = True) -> Side:
    """FSDP2: ``fully_shard`` on every block, then on the whole model; ``mixed``: with
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``.

    FSDP2 keeps only its fp32 shard of each parameter between steps (ZeRO-3). With
    ``reshard_after_forward=False`` it keeps the gathered (bf16) parameters from the forward until
    the backward has used them, as ZeRO-2 keeps them, and frees them after the backward."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    rank, _ = _rank_world()
    model = build_model(s)
    policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if mixed else MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    opt = adamw(model.parameters())
    return Side(model, opt, _plain_step(model, opt, lambda i: make_batch(s, 100 * i + rank, s.micro_batch)))


def nbscaler_tensor(s: Setup, gen_dir: str, sequence_parallel: bool = False) -> Side:
    """Tensor parallelism (``tp``) over all ranks, sequence parallel if asked; every rank sees the
    same batch."""
    _, world = _rank_world()
    pas = {"sequence_parallel": True} if sequence_parallel else {}
    pm = _compile(s, "tp", ComputeConfig(world, world, pas_config=pas), f"tp_sp{int(sequence_parallel)}_{world}", gen_dir)
    opt = build_optimizer(pm, torch.optim.AdamW, lr=1e-4)
    return Side(pm, opt, _plain_step(pm, opt, lambda i: make_batch(s, 100 * i, s.micro_batch)))


def torch_tensor(s: Setup, sequence_parallel: bool = False) -> Side:
    """DTensor ``parallelize_module``, Megatron-style: q, k, v and fc split by columns, o and proj
    by rows, the rest replicated. ``sequence_parallel`` (torchtitan's plan): the norms as
    ``SequenceParallel``, the residual stream between the blocks sharded along the sequence
    (``Shard(1)``), all-gathered before attention and fc and reduce-scattered after o and proj."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    _, world = _rank_world()
    mesh = init_device_mesh("cpu", (world,))
    model = build_model(s)
    plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(), "fc": ColwiseParallel(), "proj": RowwiseParallel()}
    if sequence_parallel:
        seq = Shard(1)                                                   # (B, T/n, d) per rank
        plan.update({"ln1": SequenceParallel(), "ln2": SequenceParallel(),
                     "attn": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                                use_local_output=True),
                     "attn.o": RowwiseParallel(output_layouts=seq, use_local_output=False),
                     "fc": ColwiseParallel(input_layouts=seq),
                     "proj": RowwiseParallel(output_layouts=seq, use_local_output=False)})
        # The embeddings' output enters the first block as a sequence slice; the head reads it whole.
        parallelize_module(model, mesh, {
            "blocks.0": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(seq,)),
            "ln_f": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                       use_local_output=True)})
    for block in model.blocks:
        parallelize_module(block, mesh, plan)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)   # DTensors and tensors mixed
    return Side(model, opt, _plain_step(model, opt, lambda i: make_batch(s, 100 * i, s.micro_batch)))


def _pipeline_batches(s: Setup, i: int) -> List[Dict[str, torch.Tensor]]:
    return [make_batch(s, 100 * i + m, s.micro_batch) for m in range(s.micros)]


# scheduler -> (stages per rank, stages a rank holds: "loop" r, r + p, ... or "v" r, 2p - 1 - r)
STAGES_PER_RANK = {"gpipe": (1, "loop"), "1f1b": (1, "loop"), "zb_h1": (1, "loop"),
                   "1f1b_interleaved": (2, "loop"), "zbv": (2, "v")}


def _local_stages(scheduler: str, rank: int, world: int) -> List[int]:
    per, style = STAGES_PER_RANK[scheduler]
    if style == "v":
        return [rank, 2 * world - 1 - rank]
    return [rank + k * world for k in range(per)]


def nbscaler_pipeline(s: Setup, gen_dir: str, scheduler: str) -> Side:
    """Pipeline parallelism (``pp``): one stage per rank, two for ``1f1b_interleaved`` and ``zbv``."""
    _, world = _rank_world()
    cfg = ComputeConfig(world, world, use_end2end=True, use_pipeline=True,
                        pipeline_nstages=world * STAGES_PER_RANK[scheduler][0],
                        pipeline_nmicros=s.micros, pipeline_scheduler=scheduler)
    pm = _compile(s, "pp", cfg, f"pp_{scheduler}_{world}", gen_dir)
    opt = build_optimizer(pm, torch.optim.AdamW, lr=1e-4)

    def step(i: int) -> float:
        opt.zero_grad()
        losses = pm.train_step(_pipeline_batches(s, i))
        opt.step()
        return float(losses[0])
    return Side(pm, opt, step)


# nbscaler's scheduler -> the ``torch.distributed.pipelining`` schedule compared with it
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "1f1b_interleaved": "ScheduleInterleaved1F1B",
                   "zb_h1": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}


def torch_pipeline(s: Setup, scheduler: str) -> Side:
    """``torch.distributed.pipelining``: the blocks split evenly over the stages, the embeddings on
    the first, the head on the last; the schedule of ``TORCH_SCHEDULES`` on the stages
    ``nbscaler_pipeline`` gives this rank, with the same micro-batches."""
    from torch.distributed import pipelining
    rank, world = _rank_world()
    model = build_model(s)
    mine = _local_stages(scheduler, rank, world)
    nstages = world * STAGES_PER_RANK[scheduler][0]
    per = math.ceil(s.n_layer / nstages)
    modules = [StageOf(model, i * per, min(s.n_layer, (i + 1) * per), i == 0, i == nstages - 1) for i in mine]
    stages = [pipelining.PipelineStage(m, i, nstages, torch.device("cpu")) for m, i in zip(modules, mine)]
    schedule_cls = getattr(pipelining, TORCH_SCHEDULES[scheduler])
    # Losses summed, not averaged over micro-batches, as nbscaler's train_step does.
    single = issubclass(schedule_cls, pipelining.schedules.PipelineScheduleSingle)
    schedule = schedule_cls(stages[0] if single else stages, s.micros, loss_fn=lm_loss, scale_grads=False)
    params = [p for m in modules for p in m.parameters()]
    opt = adamw(params)

    def step(i: int) -> float:
        batches = _pipeline_batches(s, i)
        kwargs: Dict[str, object] = {}
        args = (torch.cat([b["idx"] for b in batches]),) if 0 in mine else ()
        losses: List[torch.Tensor] = []
        if nstages - 1 in mine:
            kwargs = {"target": torch.cat([b["targets"] for b in batches]), "losses": losses}
        opt.zero_grad()
        schedule.step(*args, **kwargs)
        opt.step()
        return float(losses[0].detach()) if losses else float("nan")
    return Side(nn.ModuleList(modules), opt, step)


# -- context parallelism ---------------------------------------------------------------------
def nbscaler_context(s: Setup, gen_dir: str, kind: str) -> Side:
    """Context parallelism (``tp`` with ``pas_config={"context_parallel": n}``) over all ranks: the
    sequence in ``2n`` chunks, rank ``i`` holding ``i`` and ``2n-1-i``; attention as a ring or over
    all-gathered keys (``kind``). Every rank is given the same whole batch and keeps its chunks."""
    _, world = _rank_world()
    pas = {"context_parallel": world, "context_parallel_kind": kind}
    pm = _compile(s, "tp", ComputeConfig(world, world, pas_config=pas), f"cp_{kind}_{world}", gen_dir)
    opt = build_optimizer(pm, torch.optim.AdamW, lr=1e-4)
    return Side(pm, opt, _plain_step(pm, opt, lambda i: make_batch(s, 100 * i, s.micro_batch)))


def torch_context(s: Setup, rotate: str) -> Side:
    """PyTorch's ``context_parallel`` (load-balanced, its default) around forward and backward, with
    ``set_rotate_method(rotate)`` (``"alltoall"``: the ring; ``"allgather"``: keys and values
    gathered once), on a mesh of all ranks. The token ids, targets and positions are its buffers,
    sharded along the sequence (each rank's head and tail chunks). The weights' gradients are
    averaged over the ranks by ``DistributedDataParallel``, as torchtitan reduces them over its
    ``dp_cp`` mesh: each rank's mean loss covers the same number of tokens, so their mean is the
    whole sequence's. On CPU, PyTorch's ring runs the CPU flash kernel through
    ``benchmarks.torch_cp_cpu`` (PyTorch registers it for CUDA kernels only). The loss returned is
    the ranks' mean (one scalar all-reduce)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._context_parallel import set_rotate_method
    from torch.nn.parallel import DistributedDataParallel

    from benchmarks.torch_cp_cpu import register_cpu_ring
    _, world = _rank_world()
    register_cpu_ring()
    mesh = init_device_mesh("cpu", (world,))
    model = DistributedDataParallel(build_model(s))
    opt = adamw(model.parameters())

    def step(i: int) -> float:
        # Own storage for each buffer: context_parallel shards them in place, and with one sequence
        # make_batch's token ids and targets are views of one tensor.
        batch = {k: v.clone() for k, v in make_batch(s, 100 * i, s.micro_batch).items()}
        batch["pos"] = torch.arange(s.seq_len).expand(s.micro_batch, -1).contiguous()
        buffers = [batch["idx"], batch["targets"], batch["pos"]]
        set_rotate_method(rotate)
        opt.zero_grad()
        with context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)):
            loss = model(batch)
            loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return float(mean) / world
    return Side(model, opt, step)


# -- expert parallelism ----------------------------------------------------------------------
def moe_config(s: Setup, capacity_factor: Optional[float]):
    """The shipped MoE Llama at the setup's sizes: 8 routed SwiGLU experts of twice the model's
    width, 2 per token, softmax router; dropless (``capacity_factor=None``) or with a capacity."""
    from nbscaler.models.moe import MoEConfig
    return MoEConfig(vocab_size=s.vocab, seq_len=s.seq_len, n_layer=s.n_layer, d_model=s.d_model, n_head=s.n_head,
                     n_kv_head=max(1, s.n_head // 2), n_experts=8, top_k=2, expert_hidden=2 * s.d_model,
                     capacity_factor=capacity_factor)


def build_moe(cfg):
    from nbscaler.models.moe import MoELlama
    torch.manual_seed(0)
    return MoELlama(cfg)


def moe_batch(s: Setup, cfg, i: int, world: int) -> Dict[str, torch.Tensor]:
    """Step ``i``'s batch of the whole group: ``micro_batch`` sequences per rank."""
    from nbscaler.models.moe import sample_batch
    return sample_batch(cfg, s.micro_batch * world, seed=100 * i)


def nbscaler_experts(s: Setup, gen_dir: str, capacity_factor: Optional[float]) -> Side:
    """Expert parallelism (``tp`` with ``pas_config={"expert_parallel": n}``) over all ranks: each
    rank holds ``8/n`` experts and every other weight whole; every rank is given the group's whole
    batch and keeps its share of the sequences."""
    _, world = _rank_world()
    cfg = moe_config(s, capacity_factor)
    name = f"ep_{'dropless' if capacity_factor is None else 'capacity'}_{world}"
    pm = parallelize(build_moe(cfg), moe_batch(s, cfg, 0, world), "tp",
                     ComputeConfig(world, world, pas_config={"expert_parallel": world}),
                     gen_savedir=gen_dir, instance_name=name, reuse="override")
    opt = build_optimizer(pm, torch.optim.AdamW, lr=1e-4)

    def step(i: int) -> float:
        opt.zero_grad()
        loss = pm(**moe_batch(s, cfg, i, world))
        loss.backward()
        opt.step()
        return float(loss.detach())
    return Side(pm, opt, step)


class _GroupedMM(torch.autograd.Function):
    """``torch._grouped_mm`` with a backward that runs on CPU (PyTorch 2.13's own refuses there):
    rows ``(m, a)`` in runs ending at ``offsets``, run ``e`` times ``weight[e]`` ``(a, b)``."""

    @staticmethod
    def forward(ctx, rows, weight, offsets):
        ctx.save_for_backward(rows, weight, offsets)
        return torch._grouped_mm(rows, weight, offs=offsets)

    @staticmethod
    def backward(ctx, grad):
        rows, weight, offsets = ctx.saved_tensors
        grad = grad.contiguous()
        d_rows = torch._grouped_mm(grad, weight.transpose(1, 2).contiguous(), offs=offsets)
        d_weight = torch._grouped_mm(rows.t(), grad, offs=offsets)
        return d_rows, d_weight, None


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` of rows, ``send[j]`` to rank ``j`` and ``recv[j]`` from it; the
    backward sends the gradients back the other way (``None``: equal sizes)."""

    @staticmethod
    def forward(ctx, rows, send, recv):
        ctx.send, ctx.recv = send, recv
        out = rows.new_empty((rows.shape[0] if recv is None else sum(recv),) + rows.shape[1:])
        dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv, input_split_sizes=send)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, ctx.recv, ctx.send), None, None


class PlainExpertParallel(nn.Module):
    """A hand-written expert-parallel MoE layer in place of ``nbscaler.models.moe.MoE``: the same
    router and aux loss, this rank's ``E/n`` experts (dim 0 of the shipped weights), and
    ``torch.distributed.all_to_all_single`` (made differentiable by ``_AllToAll``) carrying each (token,
    expert) pair to its expert's rank and the result back.

    Dropless: the pairs sorted by expert, one all-to-all of per-expert counts, the rows out with
    those split sizes, regrouped by local expert, one grouped product per weight, the rows back.
    Capacity: each sequence's first ``capacity`` pairs per expert placed in ``(E, b*capacity, d)``
    buffers, the buffers of each rank's experts exchanged (equal sizes), ``torch.bmm`` per weight."""

    def __init__(self, moe: nn.Module, rank: int, world: int):
        super().__init__()
        self.cfg, self.router, self.shared = moe.cfg, moe.router, moe.shared
        self.world, self.mine = world, moe.cfg.n_experts // world
        lo, hi = rank * self.mine, (rank + 1) * self.mine
        e = moe.experts
        self.w1, self.w3, self.w2 = (nn.Parameter(w.detach()[lo:hi].clone()) for w in (e.w1, e.w3, e.w2))

    def forward(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        logits = self.router(x)
        scores = logits.softmax(-1) if cfg.router == "softmax" else logits.sigmoid()
        top, chosen = scores.topk(cfg.top_k, dim=-1)
        weights = top / top.sum(-1, keepdim=True)
        capacity = cfg.capacity(x.shape[1])
        out = self._dropless(x, weights, chosen) if capacity is None else self._capacity(x, weights, chosen, capacity)
        if self.shared is not None:
            out = out + self.shared(x)
        routed = F.one_hot(chosen, cfg.n_experts).sum(2).float()
        share = routed.mean(1) / cfg.top_k
        probs = (scores / scores.sum(-1, keepdim=True)).mean(1)
        return out, cfg.n_experts * (share * probs).sum(-1)

    def _swiglu_grouped(self, rows, offsets):
        gate, up = _GroupedMM.apply(rows, self.w1, offsets), _GroupedMM.apply(rows, self.w3, offsets)
        return _GroupedMM.apply(F.silu(gate) * up, self.w2, offsets)

    def _dropless(self, x, weights, chosen):
        B, T, C = x.shape
        k, n, mine = chosen.shape[-1], self.world, self.mine
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)                       # pairs by expert, so by destination rank
        token = order // k
        counts = torch.bincount(flat, minlength=self.cfg.n_experts)
        incoming = torch.empty_like(counts)
        dist.all_to_all_single(incoming, counts)                # [source][local expert] pair counts
        send = counts.view(n, mine).sum(1).tolist()
        recv = incoming.view(n, mine).sum(1).tolist()
        xs = x.reshape(B * T, C)
        rows = _AllToAll.apply(xs[token], send, recv)
        local = torch.arange(mine).repeat(n).repeat_interleave(incoming)
        perm = local.argsort(stable=True)                       # received rows grouped by local expert
        offsets = incoming.view(n, mine).sum(0).cumsum(0).to(torch.int32)
        done = self._swiglu_grouped(rows[perm], offsets)
        done = done[perm.argsort()]                              # back in the order received
        back = _AllToAll.apply(done, recv, send)
        back = back * weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(xs).index_add(0, token, back).view(B, T, C)

    def _capacity(self, x, weights, chosen, capacity):
        B, T, C = x.shape
        k, n, mine, E = chosen.shape[-1], self.world, self.mine, self.cfg.n_experts
        pairs = chosen.reshape(B, T * k)
        onehot = F.one_hot(pairs, E)                            # (B, T*k, E)
        slot = (onehot.cumsum(1) * onehot).sum(-1) - 1          # each pair's place in its expert's queue
        kept = (slot < capacity).reshape(-1)
        seq = torch.arange(B).unsqueeze(1)
        where = ((pairs * B + seq) * capacity + slot.clamp(max=capacity - 1)).reshape(-1)
        where = torch.where(kept, where, 0)
        token = (seq * T + torch.arange(T * k) // k).reshape(-1)
        xs = x.reshape(B * T, C)
        rows = xs[token] * kept.unsqueeze(-1).to(x.dtype)
        slots = B * capacity
        buffer = x.new_zeros(E * slots, C).index_add(0, where, rows)        # (E, slots) rows, expert-major
        arrived = _AllToAll.apply(buffer, None, None)   # [source][local expert][slot]
        arrived = arrived.view(n, mine, slots, C).transpose(0, 1).reshape(mine, n * slots, C)
        done = torch.bmm(F.silu(torch.bmm(arrived, self.w1)) * torch.bmm(arrived, self.w3), self.w2)
        done = done.view(mine, n, slots, C).transpose(0, 1).reshape(E * slots, C)
        back = _AllToAll.apply(done, None, None)[where]
        back = back * (weights.reshape(-1) * kept).unsqueeze(-1)
        return x.new_zeros(B * T, C).index_add(0, token, back).view(B, T, C)


def torch_experts(s: Setup, capacity_factor: Optional[float]) -> Side:
    """Expert parallelism written by hand with PyTorch's pieces: the shipped MoE Llama with each
    block's MoE replaced by ``PlainExpertParallel`` (this rank's experts), this rank's sequences of
    the group's batch (the share nbscaler's batch split gives it), and ``DistributedDataParallel``
    over everything but the experts (their gradients averaged over the ranks, overlapped with the
    backward). Each expert lives on one rank and its gradient already sums every rank's pairs,
    through the all-to-all's backward; divided by ``n`` it is the gradient of the mean of the ranks'
    losses, the whole batch's loss. The loss returned is the ranks' mean (one scalar all-reduce)."""
    from torch.nn.parallel import DistributedDataParallel
    rank, world = _rank_world()
    cfg = moe_config(s, capacity_factor)
    model = build_moe(cfg)
    for block in model.blocks:
        block.moe = PlainExpertParallel(block.moe, rank, world)
    experts = [n for n, _ in model.named_parameters() if n.rsplit(".", 1)[-1] in ("w1", "w2", "w3")]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, experts)
    ddp = DistributedDataParallel(model)
    expert_params = [p for n, p in model.named_parameters() if n in experts]
    opt = adamw(model.parameters())
    rows = slice(rank * s.micro_batch, (rank + 1) * s.micro_batch)

    def step(i: int) -> float:
        batch = {key: v[rows] for key, v in moe_batch(s, cfg, i, world).items()}
        opt.zero_grad()
        loss = ddp(**batch)
        loss.backward()
        torch._foreach_div_([p.grad for p in expert_params], world)
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return float(mean) / world
    return Side(model, opt, step)
