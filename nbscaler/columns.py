"""The names of the per-rank figures, predicted (``Plan.summary``) and measured (telemetry) alike.

Both sides use these names, so a prediction and a measurement line up column by column. Each
figure is for one *training step* of one runtime rank:

=====================  ===========================================================================
``rank``               the runtime rank
``flops``              floating-point operations it runs, forward and backward
``bytes_sent``         bytes it sends to other ranks (collectives, pipeline sends, gradient sync)
``bytes_received``     bytes it receives
``param_bytes``        its parameters (its slices of split ones)
``grad_bytes``         the gradients it holds at their largest
``optimizer_bytes``    optimizer state (momentum, Adam's moments; its ZeRO share)
``buffer_bytes``       buffers (BatchNorm's running statistics, ...)
``activation_bytes``   tensors saved for backward during the forward: for a pipeline, the peak
                       over the micro-batches it holds in flight
``peak_bytes``         the most it holds at once
``step_time_s``        seconds for one training step
=====================  ===========================================================================
"""

from __future__ import annotations

from enum import Enum


class SummaryColumn(str, Enum):
    """One column of a per-rank summary (see the module docstring for what each one counts)."""

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
    STEP_TIME_S = "step_time_s"

    def __str__(self) -> str:
        return self.value


#: The memory columns, in the order the views stack them.
MEMORY_COLUMNS = (SummaryColumn.PARAM_BYTES, SummaryColumn.GRAD_BYTES, SummaryColumn.OPTIMIZER_BYTES,
                  SummaryColumn.BUFFER_BYTES, SummaryColumn.ACTIVATION_BYTES)
