"""The column names of per-rank summaries, predicted (``plan.summary()``) and measured (telemetry).

The cost model and the runtime both produce one row per runtime rank; using the same names lets a
notebook subtract one table from the other. The terms, fixed once:

- ``rank``: the runtime rank (``0 .. runtime_ngpus - 1``).
- ``flops``: floating-point operations the rank runs in one training step, forward and backward.
- ``bytes_sent`` / ``bytes_received``: bytes the rank sends to / receives from other ranks in one
  training step (collectives inside a unit, pipeline sends, gradient synchronisation).
- ``param_bytes``: the rank's share of the model's parameters (its local slices, each storage once;
  with ZeRO, the flat buckets including their padding). Held at every moment of a step. Under ZeRO
  stage 3 only this rank's shard of each unit, in the parameters' dtype, and nothing when master
  copies are what the optimizer updates (the shard is then the master copy, in ``optimizer_bytes``).
- ``optimizer_bytes``: what the optimizer keeps between steps: its state (momentum, Adam's moments
  and step counters) and, with mixed precision (``master_dtype``), the master copies of the
  parameters it updates (there is no column of their own); with ZeRO, for this rank's shard only
  (without master copies the shards are views of the parameters). The state is created by the
  first ``step()`` and then held at every moment; the master copies by ``build_optimizer``.
  Gradients are in the parameters' dtype until the synchronisation moves them onto the master
  copies (in theirs), so for bf16 parameters, fp32 masters and AdamW a rank holds 2 + 2 + 4 + 8 = 16
  bytes per parameter during the backward (parameter, gradient, master, state) and 2 + 4 + 4 + 8 =
  18 after the step (micro-batches add into the bf16 gradients: no fp32 accumulation buffer).
- ``buffer_bytes``: the rank's buffers and captured constants (e.g. BatchNorm statistics, masks).
  Held at every moment.
- ``grad_bytes`` and ``activation_bytes``: what the rank holds at the peak moment of a training step
  (``StepMoment``) of gradients (the ``.grad`` of the local parameters and of the optimizer's
  own parameters: ZeRO's shards, master copies) and of activations (tensors autograd saved for
  the backward, each storage once, parameters and buffers excluded). They are not each category's
  own maximum over the step. Without a pipeline the peak is the backward: the forward's
  activations with every gradient, the full gradients under ZeRO stage 1 too (they are
  reduce-scattered only when the optimizer steps); with master copies it can be the step instead,
  where the masters' fp32 gradients may outweigh the bf16 ones with the activations.
  With a pipeline it is the backward of the micro-batch that starts with the most in flight.
- ``gathered_bytes``: ZeRO stage 3's parameters all-gathered at the peak moment: whole units (flat,
  padded), in the parameters' dtype, gathered for their forward or backward and freed after it (a
  unit that runs at both ends of the forward, such as the embeddings and the head, stays gathered
  from the forward until its gradients are reduced). In the forward the peak is the last op before
  a unit is freed; in the backward the most held at once while it runs. Zero without stage 3.
- ``peak_bytes``: the sum of the six categories above at the peak moment, the largest such sum over
  the moments of a step. A backward counts as holding its starting activations and its gradients
  at once (``StepMoment.BACKWARD``), so this is the most a rank can hold, not always an instant it
  reaches. It leaves out short-lived workspace (the gradient flowing between two ops, temporaries,
  the reducers' packed copy of one bucket and its reduce-scattered slice, collective buffers),
  which ``cuda_max_allocated_bytes`` includes.
- ``cuda_max_allocated_bytes``: measured only, on CUDA: ``torch.cuda.max_memory_allocated`` over the
  measured step.
- ``step_time_s``: seconds of one training step on the rank (every micro-batch, the gradient
  synchronisation and the optimizer step).

On a target (``plan.summary(hardware=hw)``; ``nbscaler.Hardware``), the summary adds:

- ``device_memory_bytes``: the memory of one of the target's GPUs (its datasheet capacity).
- ``fits``: ``peak_bytes <= device_memory_bytes``. The workspace ``peak_bytes`` leaves out (the
  allocator's slack, temporaries, collective buffers) is a few GB on a real run: read a rank within
  a few GB of its device's capacity as not fitting.
- ``hardware_flops``: the FLOPs the target's kernels perform: ``flops`` plus the forwards a
  recomputed region runs again in the backward, less the query-key pairs a causal FlashAttention
  kernel skips (``cost.roofline.skips_masked_pairs``). ``flops`` itself counts each op's forward and
  backward once, attention over every pair: the model FLOPs, as published counts (Megatron-LM's,
  PaLM's, torchtitan's) count them.
- ``mfu``: model FLOPs utilisation, ``flops / (step_time_s * peak)``, with ``peak`` the GPU's dense
  peak FLOP/s in the dtype of the model's parameters: the published convention (recomputation does
  not count; a causal attention's masked pairs do).
- ``hfu``: hardware FLOPs utilisation, ``hardware_flops / (step_time_s * peak)``, never above 1.
  What Megatron-LM's papers report as TFLOP/s per GPU counts the recomputed forward but every
  attention pair: ``(hardware_flops + skipped pairs) / step_time_s``, i.e. ``hfu * peak`` wherever
  attention's scores are materialised, as they were in 2021.
- ``tokens_per_s``: tokens the whole job trains on per second: the traced batch's tokens (its first
  integer input of two or more dimensions, batch times sequence) times the micro-batches of a step
  times the data-parallel units, over the slowest rank's ``step_time_s``; the same on every row, and
  empty when no input has a sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

try:
    from enum import StrEnum
except ImportError:                  # Python 3.10
    from enum import Enum

    class StrEnum(str, Enum):        # type: ignore[no-redef]
        def __str__(self) -> str:
            return str(self.value)


class SummaryColumn(StrEnum):
    """A column of a per-rank summary; see the module docstring for what each one counts."""

    RANK = "rank"
    FLOPS = "flops"
    BYTES_SENT = "bytes_sent"
    BYTES_RECEIVED = "bytes_received"
    PARAM_BYTES = "param_bytes"
    GRAD_BYTES = "grad_bytes"
    OPTIMIZER_BYTES = "optimizer_bytes"
    BUFFER_BYTES = "buffer_bytes"
    ACTIVATION_BYTES = "activation_bytes"
    GATHERED_BYTES = "gathered_bytes"
    PEAK_BYTES = "peak_bytes"
    CUDA_MAX_ALLOCATED_BYTES = "cuda_max_allocated_bytes"
    STEP_TIME_S = "step_time_s"
    DEVICE_MEMORY_BYTES = "device_memory_bytes"
    FITS = "fits"
    HARDWARE_FLOPS = "hardware_flops"
    MFU = "mfu"
    HFU = "hfu"
    TOKENS_PER_S = "tokens_per_s"


MEMORY_CATEGORIES = (SummaryColumn.PARAM_BYTES, SummaryColumn.GRAD_BYTES, SummaryColumn.OPTIMIZER_BYTES,
                     SummaryColumn.BUFFER_BYTES, SummaryColumn.ACTIVATION_BYTES, SummaryColumn.GATHERED_BYTES)
"""The categories whose sum is ``peak_bytes``."""

MEMORY_COLUMNS = (SummaryColumn.RANK, *MEMORY_CATEGORIES, SummaryColumn.PEAK_BYTES)
"""The columns of a memory table, predicted or measured."""

TARGET_COLUMNS = (SummaryColumn.DEVICE_MEMORY_BYTES, SummaryColumn.FITS, SummaryColumn.HARDWARE_FLOPS,
                  SummaryColumn.MFU, SummaryColumn.HFU, SummaryColumn.TOKENS_PER_S)
"""The columns ``Plan.summary(hardware=...)`` adds: those only a target with a peak and a capacity has."""

PREDICTED_COLUMNS = tuple(c for c in SummaryColumn
                          if c is not SummaryColumn.CUDA_MAX_ALLOCATED_BYTES and c not in TARGET_COLUMNS)
"""The columns of ``Plan.summary()``: every one but those only a measurement or a target has."""


class StepMoment(StrEnum):
    """The moments of a training step at which memory is counted (``nbscaler.columns``).

    Gradients are set to ``None`` before the step (``optimizer.zero_grad()``); parameters, buffers
    and optimizer state are held throughout, so the moments differ in gradients and activations:

    - ``forward``: the end of a forward (one per micro-batch of a pipeline): the activations saved
      so far, with the gradients earlier backwards left.
    - ``backward``: one backward (per micro-batch), counted at its worst as one moment: the
      activations held when it starts, with the most gradients held at any point of it. A backward
      frees its activations as it makes its gradients, so no instant inside it holds more, and how
      much less depends on their order: one that makes a large gradient early (a big output layer)
      comes close; on a 4-layer Llama (vocabulary 128, d=64, dp, AdamW) no instant of the backward
      held more activations and gradients than the end of the forward did, 657,664 bytes under
      this count. The most gradients are those after it, except under ZeRO stage 2, where a
      bucket's gradients are all held at once just before they are reduce-scattered into this
      rank's shard (buckets completing in the reverse of parameter order).
    - ``step``: the optimizer step and what it leaves: under ZeRO stage 1 it starts with every
      gradient and frees each bucket's full gradients as it reduce-scatters them; without ZeRO the
      synchronisation gives every parameter a gradient (with master copies, the masters' in their
      dtype, in place of the parameters' own).

    The peak is the first moment with the largest sum.
    """

    FORWARD = "forward"
    BACKWARD = "backward"
    STEP = "step"


@dataclass(frozen=True)
class Held:
    """Gradient and activation bytes (and ZeRO-3's gathered parameters) a rank holds at one moment
    of a step (predicted or measured)."""

    moment: StepMoment
    grad_bytes: int
    activation_bytes: int
    gathered_bytes: int = 0

    @property
    def nbytes(self) -> int:
        return self.grad_bytes + self.activation_bytes + self.gathered_bytes


class UnitColumn(StrEnum):
    """A column of ``plan.unit_collectives()``: one row per plan device (its rank in unit 0) and
    ZeRO stage 3 unit (``policy.shard_units``), what the unit's collectives move and cost in one
    training step (``cost.fsdp``).

    - ``rank``: the runtime rank of unit 0 (a plan device; the other units' ranks do the same).
    - ``unit``: the unit, as the generated code's ``shard_units`` names it (``'(rest)'``: every
      parameter outside the repeated layers).
    - ``gather_bytes``: the whole unit as one all-gather makes it on each rank: its flat buckets
      (one per parameter dtype, each padded to a multiple of the ZeRO group size) in the module
      dtype; each rank sends ``(N-1)/N`` of it.
    - ``reduce_bytes``: the unit's gradients as its reduce-scatter reads them: the same buckets in
      the recipe's reduce dtype (fp32 for a bf16 model with fp32 masters).
    - ``gather_s`` / ``reduce_s``: one all-gather / one reduce-scatter (with the all-reduce of its
      slice across ZeRO groups, ``zero_ngroups > 1``) alone on the link the ZeRO group spans.
    - ``gathers`` / ``reduces``: how many the step runs: a gather per forward (once a step for a
      unit an earlier forward still holds, the rest of the model on a 1F1B stage before the last)
      and again per backward for a unit released after its forward; a reduce-scatter per backward;
      none over a ZeRO group of one rank, which moves nothing.
    - ``exposed_s``: the seconds of the step the rank's compute waits for this unit's
      collectives: a gather not yet done where the unit's compute starts (the first of each forward
      and backward, and any that outruns the compute it runs under), and a reduce-scatter still
      running when the block's compute ends (the last of each backward). The rest runs under the
      compute; the sum over units is ``DeviceStep.fsdp_s``, part of ``step_time_s``.
    """

    RANK = "rank"
    UNIT = "unit"
    GATHER_BYTES = "gather_bytes"
    REDUCE_BYTES = "reduce_bytes"
    GATHER_S = "gather_s"
    REDUCE_S = "reduce_s"
    GATHERS = "gathers"
    REDUCES = "reduces"
    EXPOSED_S = "exposed_s"


class SweepColumn(StrEnum):
    """A column of ``nbscaler.sweep``: one row per configuration of a run, priced on a target.

    The configuration:

    - ``tp``, ``cp``, ``ep``, ``pp``, ``dp``: tensor-parallel size (devices splitting each op of a stage),
      context-parallel size (devices splitting each stage's sequence, ``pas_config['context_parallel']``;
      1 without, and 1 wherever ``tp > 1``: the two do not share a stage), expert-parallel size
      (devices splitting each stage's routed experts, the ops around them split by batch,
      ``pas_config['expert_parallel']``; 1 without, and 1 wherever ``tp`` or ``cp`` is above 1),
      pipeline stages' devices, data-parallel units; ``tp * cp * ep * pp * dp`` is the target's GPUs.
    - ``context_parallel_kind``: how context-parallel attention reads the other devices' keys:
      ``all_gather`` or ``ring`` (``pas_config['context_parallel_kind']``); read only where ``cp > 1``.
    - ``micro_batch``: sequences in one micro-batch; ``micro_batches``: micro-batches per step and
      unit, so ``micro_batch * micro_batches * dp`` is the global batch.
    - ``recompute``: what runs again in the backward: ``none``, ``selective`` (each layer's attention
      core) or ``full`` (every layer of the model's stack).
    - ``sequence_parallel``: the ops between the tensor-parallel linears (norms, dropout, residual
      adds) on a slice of the sequence (``pas_config['sequence_parallel']``); only where ``tp > 1``.
    - ``zero_stage``: 0 without ZeRO, 1 (optimizer state sharded over ``dp``), 2 (gradients too),
      3 (parameters too, gathered a unit at a time: fully sharded data parallelism).
    - ``zero_reshard_after_forward``: under ZeRO stage 3, whether each layer's gathered parameters
      are freed after its forward and gathered again for its backward (``True``) or kept until the
      backward (``False``); ``True`` on the rows of other stages, which gather nothing.
    - ``scheduler``: the pipeline scheduler; ``virtual_stages``: stages per pipeline device (1
      for ``1f1b``, more for interleaved schedulers).
    - ``float8``: the linear layers' products in fp8 with this scaling (``Recipe.float8``:
      ``tensorwise``, ``rowwise``), or ``none``; ``compiled``: the target's software compiles the
      model, each element-wise chain one kernel (``Software.compiled``).

    The prediction, each as the summary of that configuration on the target gives it
    (``SummaryColumn``):

    - ``step_time_s``: the slowest rank's step; ``tokens_per_s``: the job's tokens over it.
    - ``mfu`` / ``hfu``: the job's model (hardware) FLOPs per second over the peak of all its GPUs.
    - ``peak_bytes``: the largest rank's peak; ``fits``: every rank fits its GPU's memory.
    - ``bubble``: the share of the step the slowest pipeline device idles, waiting on the others
      (sends left out); ``pp_send_share``: the share the pipeline's sends add to the step (the
      simulated step less the same schedule with instant sends); ``tp_comm_share``: the share of
      the step that device spends in tensor-parallel collectives (forward, backward and recomputed
      forward; under ``cp`` or ``ep`` the stage group's own: keys gathered or passed, tokens sent to
      their experts and back); ``dp_comm_share``: the share of the gradient synchronisation between units
      (all-reduce, or ZeRO's reduce-scatter and all-gather) that the backward does not hide.
    """

    TP = "tp"
    CP = "cp"
    EP = "ep"
    PP = "pp"
    DP = "dp"
    MICRO_BATCH = "micro_batch"
    MICRO_BATCHES = "micro_batches"
    RECOMPUTE = "recompute"
    SEQUENCE_PARALLEL = "sequence_parallel"
    CONTEXT_PARALLEL_KIND = "context_parallel_kind"
    ZERO_STAGE = "zero_stage"
    ZERO_RESHARD_AFTER_FORWARD = "zero_reshard_after_forward"
    SCHEDULER = "scheduler"
    VIRTUAL_STAGES = "virtual_stages"
    FLOAT8 = "float8"
    COMPILED = "compiled"
    STEP_TIME_S = "step_time_s"
    TOKENS_PER_S = "tokens_per_s"
    MFU = "mfu"
    HFU = "hfu"
    PEAK_BYTES = "peak_bytes"
    FITS = "fits"
    BUBBLE = "bubble"
    TP_COMM_SHARE = "tp_comm_share"
    DP_COMM_SHARE = "dp_comm_share"
    PP_SEND_SHARE = "pp_send_share"
    FSDP_COMM_SHARE = "fsdp_comm_share"
