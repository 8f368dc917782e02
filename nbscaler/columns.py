"""The column names of per-rank summaries, predicted (``plan.summary()``) and measured (telemetry).

The cost model and the runtime both produce one row per runtime rank; using the same names lets a
notebook subtract one table from the other. The terms, fixed once:

- ``rank``: the runtime rank (``0 .. runtime_ngpus - 1``).
- ``flops``: floating-point operations the rank runs in one training step, forward and backward.
- ``bytes_sent`` / ``bytes_received``: bytes the rank sends to / receives from other ranks in one
  training step (collectives inside a unit, pipeline sends, gradient synchronisation).
- ``param_bytes``: the rank's share of the model's parameters (its local slices, each storage once).
- ``grad_bytes``: gradients held after the backward and the gradient synchronisation: the ``.grad``
  of the local parameters; with ZeRO, only the gradient of this rank's shard of each flat bucket
  (the full gradients are freed once reduce-scattered).
- ``optimizer_bytes``: what the optimizer adds: its state (momentum, Adam's moments and step
  counters); with ZeRO, for this rank's shard only (the shards are views of the parameters).
- ``buffer_bytes``: the rank's buffers and captured constants (e.g. BatchNorm statistics, masks).
- ``activation_bytes``: tensors autograd saves for the backward during one training step's forward,
  each storage counted once, parameters and buffers excluded; for a pipeline, the most that is
  saved at any one time over the micro-batches in flight on the rank.
- ``peak_bytes``: the sum of the five categories above: what the rank holds at the busiest point of
  a step, counting the gradients and the saved activations as coexisting (as they do in a pipeline
  after its first backward). It leaves out short-lived workspace (temporaries, collective buffers),
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
- ``hardware_flops``: ``flops`` plus the forwards a recomputed region runs again in the backward:
  what the GPU computes. ``flops`` itself counts each op's forward and backward once: the model FLOPs.
- ``mfu``: model FLOPs utilisation, ``flops / (step_time_s * peak)``, with ``peak`` the GPU's dense
  peak FLOP/s in the dtype of the model's parameters; recomputation does not count.
- ``hfu``: hardware FLOPs utilisation, ``hardware_flops / (step_time_s * peak)``; what Megatron-LM's
  papers report as TFLOP/s per GPU is ``hfu * peak``.
- ``tokens_per_s``: tokens the whole job trains on per second: the traced batch's tokens (its first
  integer input of two or more dimensions, batch times sequence) times the micro-batches of a step
  times the data-parallel units, over the slowest rank's ``step_time_s``; the same on every row, and
  empty when no input has a sequence.
"""

from __future__ import annotations

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
                     SummaryColumn.BUFFER_BYTES, SummaryColumn.ACTIVATION_BYTES)
"""The categories whose sum is ``peak_bytes``."""

MEMORY_COLUMNS = (SummaryColumn.RANK, *MEMORY_CATEGORIES, SummaryColumn.PEAK_BYTES)
"""The columns of a memory table, predicted or measured."""

TARGET_COLUMNS = (SummaryColumn.DEVICE_MEMORY_BYTES, SummaryColumn.FITS, SummaryColumn.HARDWARE_FLOPS,
                  SummaryColumn.MFU, SummaryColumn.HFU, SummaryColumn.TOKENS_PER_S)
"""The columns ``Plan.summary(hardware=...)`` adds: those only a target with a peak and a capacity has."""

PREDICTED_COLUMNS = tuple(c for c in SummaryColumn
                          if c is not SummaryColumn.CUDA_MAX_ALLOCATED_BYTES and c not in TARGET_COLUMNS)
"""The columns of ``Plan.summary()``: every one but those only a measurement or a target has."""
