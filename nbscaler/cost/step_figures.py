"""One priced training step: its time and parts, FLOPs, memory and what follows from them.

Two callers price a step: ``Plan.summary`` from a whole plan (``cost.timing.StepModel``, every
op replayed), and the plan space from a two-layer copy's facts (``nbscaler.space.pricing``). Each
works out, per plan device, the seconds of its part of the pipeline, of the gradient
synchronisation it waits for and of its optimizer step, its FLOPs and its peak bytes; both hand
them to ``StepFigures``, and every figure read from a step is computed here, once:

- the overlap rule (``overlaps_communication``, ``overlap_window``): whether collectives run beside
  the compute, and how much of the backward the gradient reduction may hide in;
- a device's step: its compute, then its exposed synchronisation, then its update;
- utilisation (``utilisation``: MFU and HFU), throughput (``throughput``: tokens/s) and whether the
  peak fits the target's memory (``Hardware.fits``);
- the shares of the step the sweep reports: the bubble, tensor-parallel, data-parallel,
  pipeline-send and ZeRO-3 gather and reduce-scatter time.

Data-parallel units repeat unit 0's devices, so a rank's figures are its plan device's
(``ComputeConfig.device_of``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Tuple

from nbscaler.cost.hardware import Hardware


def overlaps_communication(hardware: Optional[Hardware]) -> bool:
    """Whether data-parallel collectives run beside the compute, on their own stream: on a target
    whose software does so (DDP, FSDP, Megatron-LM's ``--overlap-grad-reduce``); not on a target
    that waits for them, nor on this machine, whose ranks compute and communicate on the same cores."""
    return hardware is not None and not hardware.is_local and hardware.software.overlap_grad_reduce


def overlap_window(backward_s: Iterable[float], hardware: Optional[Hardware]) -> Optional[float]:
    """The seconds of a device's backward its gradient reduction may run during: its longest
    backward block where collectives overlap the compute (``overlaps_communication``); ``None``
    (all of it waits for the backward's end) where they do not."""
    if not overlaps_communication(hardware):
        return None
    return max(backward_s)


def utilisation(flops: float, seconds: float, peak_flops: float) -> float:
    """The share of ``peak_flops`` (per second) that ``flops`` in ``seconds`` use: MFU with the
    model's FLOPs, HFU with the hardware's (recomputed forwards included)."""
    return flops / (seconds * peak_flops)


def step_tokens(micro_batch_tokens: Optional[int], micro_batches: int, units: int) -> Optional[int]:
    """Tokens a step trains on: each unit's micro-batches of ``micro_batch_tokens`` (None: no sequence)."""
    return None if micro_batch_tokens is None else micro_batch_tokens * micro_batches * units


def throughput(tokens: Optional[float], seconds: float) -> float:
    """Tokens per second of a step of ``seconds`` that trains on ``tokens`` (NaN without tokens)."""
    return tokens / seconds if tokens is not None else float("nan")


@dataclass(frozen=True)
class DeviceStep:
    """One plan device's part of a step, in seconds, FLOPs and bytes.

    ``compute_s``: its forwards and backwards as the schedule plays them (a pipeline's makespan);
    ``sync_s``: the gradient synchronisation it waits for (``cost.timing.exposed_sync``);
    ``update_s``: the optimizer step with the reducer's copies; ``flops`` and ``hardware_flops``:
    the model's and the hardware's (recomputed forwards too) in the step; ``peak_bytes``: the most it
    holds at once; ``tp_s``: of ``compute_s``, the tensor-parallel collectives' seconds; ``fsdp_s``:
    of ``compute_s``, the seconds its blocks wait for ZeRO stage 3's all-gathers and reduce-scatters
    (``cost.fsdp``; 0 without stage 3). A figure its pricer does not count is NaN."""

    compute_s: float
    sync_s: float
    update_s: float
    flops: float = float("nan")
    hardware_flops: float = float("nan")
    peak_bytes: float = float("nan")
    tp_s: float = float("nan")
    fsdp_s: float = 0.0

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.sync_s + self.update_s


@dataclass(frozen=True)
class PipelineParts:
    """What a pipeline's schedule says of a step beyond its makespan: the makespan with the sends'
    latency (``makespan_s``) and without (``instant_s``), and per plan device the busy seconds of
    its pipeline device without sends (``busy_s``)."""

    makespan_s: float
    instant_s: float
    busy_s: Mapping[int, float]


@dataclass(frozen=True)
class StepFigures:
    """A training step of a plan, priced: per plan device (``devices``), and what follows for the
    job of ``units`` data-parallel units on ``runtime_ngpus`` ranks. ``hardware``: the target
    (``Hardware.local()``: this machine as measured; ``None``: this machine, with no peak to
    measure utilisation against); ``peak_flops``: its per device at the compute dtype;
    ``tokens``: the tokens the job trains on in one step."""

    devices: Mapping[int, DeviceStep]
    units: int
    runtime_ngpus: int
    hardware: Optional[Hardware] = None
    peak_flops: Optional[float] = None
    tokens: Optional[float] = None
    pipeline: Optional[PipelineParts] = None

    # -- the step ------------------------------------------------------------------------------
    @property
    def slowest(self) -> Tuple[float, int]:
        """``(step seconds, plan device)`` of the device the step waits for (the last on a tie)."""
        return max((d.step_time_s, device) for device, d in self.devices.items())

    @property
    def step_time_s(self) -> float:
        return self.slowest[0]

    @property
    def peak_bytes(self) -> float:
        return max(d.peak_bytes for d in self.devices.values())

    @property
    def fits(self) -> bool:
        return bool(self.hardware.fits(self.peak_bytes))

    # -- throughput and utilisation of the whole job ---------------------------------------------
    @property
    def tokens_per_s(self) -> float:
        return throughput(self.tokens, self.step_time_s)

    @property
    def flops(self) -> float:
        """Model FLOPs of the whole job in one step."""
        return self.units * sum(d.flops for d in self.devices.values())

    @property
    def hardware_flops(self) -> float:
        """Hardware FLOPs (recomputed forwards too) of the whole job in one step."""
        return self.units * sum(d.hardware_flops for d in self.devices.values())

    @property
    def mfu(self) -> float:
        return utilisation(self.flops, self.step_time_s, self.peak_flops * self.runtime_ngpus)

    @property
    def hfu(self) -> float:
        return utilisation(self.hardware_flops, self.step_time_s, self.peak_flops * self.runtime_ngpus)

    # -- per device ------------------------------------------------------------------------------
    def device_mfu(self, device: int) -> float:
        """MFU of one plan device's ranks over their own step."""
        d = self.devices[device]
        return utilisation(d.flops, d.step_time_s, self.peak_flops)

    def device_hfu(self, device: int) -> float:
        d = self.devices[device]
        return utilisation(d.hardware_flops, d.step_time_s, self.peak_flops)

    # -- the step's parts, as shares of it -------------------------------------------------------
    @property
    def bubble(self) -> float:
        """The share of the step the slowest device's pipeline device idles in its schedule (none
        without a pipeline)."""
        p = self.pipeline
        if p is None:
            return 0.0
        return max(0.0, p.instant_s - p.busy_s[self.slowest[1]]) / self.step_time_s

    @property
    def tp_comm_share(self) -> float:
        return self.devices[self.slowest[1]].tp_s / self.step_time_s

    @property
    def dp_comm_share(self) -> float:
        return self.devices[self.slowest[1]].sync_s / self.step_time_s

    @property
    def fsdp_comm_share(self) -> float:
        """The share of the step the slowest device waits for ZeRO stage 3's gathers and
        reduce-scatters (``DeviceStep.fsdp_s``)."""
        return self.devices[self.slowest[1]].fsdp_s / self.step_time_s

    @property
    def pp_send_share(self) -> float:
        """The share of the step the pipeline's sends add to its makespan (none without a pipeline)."""
        p = self.pipeline
        return 0.0 if p is None else (p.makespan_s - p.instant_s) / self.step_time_s

