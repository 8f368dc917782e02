"""``Hardware``: what a target machine computes, holds and moves, per GPU, with a catalogue of real ones.

A plan is priced on a target from a few facts per GPU: its dense peak FLOP/s in each precision, its
memory (capacity and bandwidth), and the two links a collective can cross: the one between GPUs of
a node (NVLink/NVSwitch) and the one between nodes (InfiniBand/RoCE), each as the bandwidth one GPU
gets in one direction and a latency per message. ``nodes`` and ``gpus_per_node`` say how many GPUs
the job has and where a group of ranks stops being on one node.

Every peak here is *dense* (no 2:4 sparsity): vendors print the sparse figure with an asterisk, twice
the dense one. Link bandwidths are per GPU and per direction, and are what NCCL measurably moves over
the link, nccl-tests' all-reduce ``busbw`` at large messages, not the datasheet's line rate:
NVIDIA's "900 GB/s NVLink" for an H100 is both directions of its 18 links together, 450 GB/s each
way, of which NCCL's ring gets about 370 GB/s. The line rates stay in ``DATASHEET_LINK_BYTES_PER_S``
beside the catalogue, and each target's ``source`` names where its busbw comes from.

>>> hw = Hardware.named("H100-SXM-80GB", nodes=8)
>>> hw.ngpus, hw.peak_flops(torch.bfloat16) / 1e12
(64, 989.4)
>>> custom = dataclasses.replace(hw, name="H100 on 200G RoCE", inter_node_bytes_per_s=25e9)

A target also runs software, where that changes the physics: ``software`` (``cost.software.Software``)
says how attention is computed, which kernels are fused and whether the gradient reduction overlaps
the backward. A 2021 Megatron-LM run on A100s:

>>> megatron_2021 = Hardware.named("A100-SXM-80GB", nodes=4).running(
...     Software(attention="materialized", attention_dropout=0.1, fused_bias_dropout_add=True,
...              overlap_grad_reduce=False, name="Megatron-LM 2021"))

The datasheets' peaks assume the boost clock; under sustained tensor-core load a GPU holds a lower
one at its power limit. ``sustained_clock_ratio`` is that clock over the boost clock, where a source
gives it: the A100 entries hold 1,305 of 1,410 MHz (NVIDIA's HPL clock). No comparable figure was
found for the H100, H200, L4 or T4: they stay at their boost peaks (ratio 1). The roofline divides
compute-bound time by the sustained rate (``sustained_flops``); MFU and HFU stay quoted against the
datasheet's peak, as published runs quote them.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Tuple, Union

import torch

from nbscaler.columns import StrEnum
from nbscaler.cost.software import AttentionKind, Software

__all__ = ["Hardware", "Link", "NumberFormat", "AttentionKind", "Software", "CATALOGUE"]


class NumberFormat(StrEnum):
    """The arithmetic a peak is quoted for; ``of`` maps a torch dtype to it."""

    FP32 = "float32"            # plain fp32 FMA on CUDA cores (what torch runs unless TF32 is allowed)
    TF32 = "tf32"               # fp32 matmuls on tensor cores (torch.backends.cuda.matmul.allow_tf32)
    BF16 = "bfloat16"
    FP16 = "float16"
    FP8 = "float8"              # e4m3 / e5m2

    @classmethod
    def of(cls, dtype: torch.dtype) -> "NumberFormat":
        """The precision a tensor of ``dtype`` computes in (integers count as fp32: they never reach a
        tensor core in a training step's FLOPs)."""
        if dtype == torch.bfloat16:
            return cls.BF16
        if dtype == torch.float16:
            return cls.FP16
        return cls.FP8 if "float8" in str(dtype) else cls.FP32



_GB = 1e9
_TFLOPS = 1e12


@dataclass(frozen=True)
class Hardware:
    """One target: identical GPUs, ``gpus_per_node`` to a node, ``nodes`` nodes.

    ``peak_flops_by_precision`` holds dense peaks in FLOP/s (a precision the GPU lacks, e.g. bf16 on
    a T4, is absent). Bandwidths are bytes/s per GPU in one direction; latencies seconds per message.
    ``intra_node_tree_latency_s`` and ``inter_node_tree_latency_s`` are the latency of one step of NCCL's
    tree, which its tuning table gives apart from the ring's (None: the ring's).
    ``is_local`` marks ``Hardware.local()``: this machine, whose op and collective times come from its
    own calibration rather than from these figures. ``matmul_efficiency`` is the fraction of the bf16
    peak the best-shaped cuBLAS products measurably reach on this GPU (``cost.roofline``).
    ``attention_efficiency`` is the fraction of the bf16 peak FlashAttention-2 (the flash kernel of
    PyTorch's ``scaled_dot_product_attention``) reaches on this GPU, on FLOPs that count a causal
    mask's work as half (``cost.roofline``).
    ``sustained_clock_ratio`` is the clock the GPU holds under sustained tensor-core load over the
    boost clock its peaks assume (1 where no source gives one). ``software`` is what the target runs
    (``cost.software.Software``).
    """

    name: str
    peak_flops_by_precision: Mapping[NumberFormat, float]
    memory_bytes: float
    memory_bytes_per_s: float
    gpus_per_node: int
    intra_node_bytes_per_s: float
    intra_node_latency_s: float
    inter_node_bytes_per_s: float
    inter_node_latency_s: float
    nodes: int = 1
    is_local: bool = False
    source: str = field(default="", compare=False)
    intra_node_tree_latency_s: Optional[float] = None
    inter_node_tree_latency_s: Optional[float] = None
    # the best fraction of the dense peak a large product reaches; 0.80 is an estimate for GPUs without a
    # measured figure (the A100 and H100 entries carry mamf-finder's measurements, see _A100_MAMF)
    matmul_efficiency: float = 0.80
    # FlashAttention-2's fraction of the peak; 0.55, its A100 figure (_FA2_A100), where no GPU's own is published
    attention_efficiency: float = 0.55
    sustained_clock_ratio: float = 1.0
    software: Software = Software()

    def __post_init__(self) -> None:
        if not isinstance(self.software, Software):
            raise ValueError(f"Hardware {self.name!r}: software={self.software!r} must be a nbscaler Software "
                             f"(e.g. Software(attention='materialized')).")
        for name, meaning in (("matmul_efficiency", "a fraction of the peak"),
                              ("attention_efficiency", "a fraction of the peak"),
                              ("sustained_clock_ratio", "the sustained clock over the boost clock")):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value <= 1):
                raise ValueError(f"Hardware {self.name!r}: {name}={value!r} must be {meaning}, in (0, 1].")
        peaks = {NumberFormat(k): float(v) for k, v in dict(self.peak_flops_by_precision).items()}
        object.__setattr__(self, "peak_flops_by_precision", peaks)
        if not peaks:
            raise ValueError(f"Hardware {self.name!r}: peak_flops_by_precision is empty; give at least "
                             f"{{NumberFormat.FP32: flop_per_s}}.")
        for key, value in peaks.items():
            _positive(self.name, f"peak_flops_by_precision[{key.value}]", value, "a dense peak in FLOP/s")
        for name, unit in (("memory_bytes", "bytes"), ("memory_bytes_per_s", "bytes/s"),
                           ("intra_node_bytes_per_s", "bytes/s per GPU and direction"),
                           ("inter_node_bytes_per_s", "bytes/s per GPU and direction")):
            _positive(self.name, name, getattr(self, name), unit)
        for name in ("intra_node_latency_s", "inter_node_latency_s", "intra_node_tree_latency_s",
                     "inter_node_tree_latency_s"):
            value = getattr(self, name)
            if value is None and "tree" in name:
                continue
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"Hardware {self.name!r}: {name}={value!r} must be a latency in seconds, >= 0.")
        for name in ("gpus_per_node", "nodes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Hardware {self.name!r}: {name}={value!r} must be a whole number >= 1.")

    # -- what the cost model asks -----------------------------------------------------------------
    @property
    def ngpus(self) -> int:
        return self.gpus_per_node * self.nodes

    def peak_flops(self, dtype: torch.dtype) -> float:
        """Dense peak FLOP/s of one GPU for matmuls in ``dtype``."""
        precision = NumberFormat.of(dtype)
        if precision not in self.peak_flops_by_precision:
            have = ", ".join(p.value for p in self.peak_flops_by_precision)
            raise ValueError(f"Hardware {self.name!r} has no {precision.value} peak (it has: {have}); "
                             f"plan in one of those dtypes (module_dtype=...) or add the peak.")
        return self.peak_flops_by_precision[precision]

    def sustained_flops(self, dtype: torch.dtype) -> float:
        """FLOP/s of one GPU for matmuls in ``dtype`` at the clock it holds under sustained load: the
        rate compute-bound kernels are priced at (``cost.roofline``)."""
        return self.peak_flops(dtype) * self.sustained_clock_ratio

    def vector_flops(self) -> float:
        """FLOP/s of one GPU's vector units (not its tensor cores) at the clock it holds under sustained
        load: the rate of every op that is not a matrix product (``cost.roofline``). PyTorch computes
        half-precision elementwise ops, norms and reductions in fp32 (``at::opmath_type``, ATen's
        ``OpMathType.h``), so this is the datasheet's fp32 peak; a target that gives none is held to
        its slowest peak, never faster than any."""
        peaks = self.peak_flops_by_precision
        return peaks.get(NumberFormat.FP32, min(peaks.values())) * self.sustained_clock_ratio

    def fits(self, nbytes):
        """Whether ``nbytes`` (a number, or an array or Series of them) fits in one GPU's memory: the
        one test of "fits" the summary's ``fits`` column and the memory view both ask."""
        return nbytes <= self.memory_bytes

    def check_ranks(self, nranks: int) -> None:
        """Raise when a job of ``nranks`` ranks needs more GPUs than the target has."""
        if nranks > self.ngpus:
            raise ValueError(f"the plan runs {nranks} ranks but {self.name} has {self.ngpus} GPUs "
                             f"({self.nodes} node(s) of {self.gpus_per_node}); ask for more nodes: "
                             f"Hardware.named({self.name!r}, nodes={-(-nranks // self.gpus_per_node)}).")

    def node_of(self, rank: int) -> int:
        """The node of global ``rank``: ranks fill a node before the next (as torchrun numbers them)."""
        return rank // self.gpus_per_node

    def link(self, ranks) -> "Link":
        """The slowest link a group of global ``ranks`` crosses: NVLink inside one node, else the
        network. Across nodes, a group with ``k`` ranks on each node runs ``k`` of NCCL's rings side by
        side, each through its own GPU's share of the node's network (a DGX's NIC per GPU), so its bus
        bandwidth is ``k`` shares, and never more than NVLink's: 24 GB/s for one A100 a node, 192 GB/s
        for eight (NVIDIA's DGX A100 figure, ``_A100_HDR_BUSBW``)."""
        per_node = collections.Counter(self.node_of(r) for r in ranks)
        if len(per_node) <= 1:
            return Link("intra-node", self.intra_node_bytes_per_s, self.intra_node_latency_s,
                        self.intra_node_tree_latency_s)
        rings = min(per_node.values())
        return Link("inter-node", min(self.inter_node_bytes_per_s * rings, self.intra_node_bytes_per_s),
                    self.inter_node_latency_s, self.inter_node_tree_latency_s)

    def require_fp8(self, asked: str) -> None:
        """A ValueError naming the fix where ``asked`` (fp8 products, e.g. ``"Recipe(float8='tensorwise')"``)
        meets a GPU without fp8 tensor cores: one without an fp8 peak (an A100, a T4)."""
        if NumberFormat.FP8 not in self.peak_flops_by_precision:
            raise ValueError(f"{asked} on {self.name}: it has no fp8 tensor cores (no fp8 peak in "
                             "Hardware.peak_flops_by_precision); use float8=None ('none' in a sweep), or a GPU "
                             "with them (H100, H200, L4).")

    def running(self, software: Software) -> "Hardware":
        """This target running ``software`` instead of its own."""
        return dataclasses.replace(self, software=software)

    # -- where they come from ---------------------------------------------------------------------
    @classmethod
    def named(cls, name: str, nodes: int = 1) -> "Hardware":
        """A catalogued target (``Hardware.catalogue()``) with ``nodes`` nodes."""
        if name not in CATALOGUE:
            raise ValueError(f"no hardware named {name!r}; known: {', '.join(CATALOGUE)}. "
                             f"Build your own with Hardware(...) or dataclasses.replace(Hardware.named(...), ...).")
        return dataclasses.replace(CATALOGUE[name], nodes=nodes)

    @classmethod
    def resolve(cls, target: Union[str, "Hardware"], *, nodes: Optional[int] = None,
                gpus_per_node: Optional[int] = None, ngpus: Optional[int] = None) -> "Hardware":
        """The one way a name becomes a target: ``target`` (a catalogue name or a ``Hardware``)
        with the ``nodes`` and ``gpus_per_node`` given changed. ``ngpus``: the GPUs the job must
        have; a catalogue name without ``nodes`` gets as many nodes as they fill. Anything else
        raises ``ValueError`` naming the value and the fix."""
        if isinstance(target, str):
            hardware = cls.named(target)
            per_node = gpus_per_node or hardware.gpus_per_node
            if nodes is None and ngpus is not None:
                if ngpus % per_node:
                    raise ValueError(f"hardware={target!r} has {per_node} GPUs a node, and {ngpus} GPUs are not a "
                                     f"whole number of nodes; use a multiple of {per_node}, or pass "
                                     f"Hardware.named({target!r}) with gpus_per_node changed.")
                nodes = ngpus // per_node
        elif isinstance(target, Hardware):
            hardware = target
        else:
            raise ValueError(f"hardware={target!r}: give a Hardware or a catalogue name such as 'H100-SXM-80GB' "
                             f"({', '.join(CATALOGUE)}).")
        changes = {k: v for k, v in (("nodes", nodes), ("gpus_per_node", gpus_per_node)) if v is not None}
        hardware = dataclasses.replace(hardware, **changes) if changes else hardware
        if ngpus is not None and hardware.ngpus != ngpus:
            raise ValueError(f"hardware {hardware.name} has {hardware.ngpus} GPUs but the job runs {ngpus}; make them "
                             "equal (Hardware.named(..., nodes=...)).")
        return hardware

    @staticmethod
    def catalogue() -> Dict[str, "Hardware"]:
        """Every catalogued target by name (one node each)."""
        return dict(CATALOGUE)

    @classmethod
    def local(cls) -> "Hardware":
        """This machine, as nbscaler's calibration sees it (``cost.local_hardware``)."""
        from nbscaler.cost.local_hardware import local_hardware
        return local_hardware()


@dataclass(frozen=True)
class Link:
    """The link a collective's group crosses: bytes/s per GPU and direction (NCCL's bus bandwidth),
    seconds per ring step, and seconds per tree step (``tree_latency_s``; None: the ring's)."""

    kind: str
    bytes_per_s: float
    latency_s: float
    tree_latency_s: Optional[float] = None

    def __post_init__(self) -> None:
        if self.tree_latency_s is None:
            object.__setattr__(self, "tree_latency_s", self.latency_s)


def _positive(hw: str, name: str, value, unit: str) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"Hardware {hw!r}: {name}={value!r} must be a positive number ({unit}).")


# -- the catalogue --------------------------------------------------------------------------------
# Per-step latencies are NCCL's own figures for its LL128 protocol, the one it picks for messages up
# to a few MB (NVIDIA/nccl, src/graph/tuning.cc, table hwLat, LL128 column, as of commit b647562;
# the ring's row has not changed since NCCL 2.12). The ring's row: NVLink 1.9 us, PCI 2.5 us, NET 4.0 us. The tree's own row: NVLink
# 1.25 us, PCI 1.9 us, NET 8.5 us, paid for each step of its chain in a node and tree across nodes. NCCL adds a fixed
# start-up per collective (baseLat, 6-14 us) that is not counted here.
_NVLINK_LAT, _PCIE_LAT, _NET_LAT = 1.9e-6, 2.5e-6, 4.0e-6
_NVLINK_TREE_LAT, _PCIE_TREE_LAT, _NET_TREE_LAT = 1.25e-6, 1.9e-6, 8.5e-6
# Link bandwidths are NCCL's bus bandwidth as nccl-tests' all_reduce_perf reports it (busbw) at the
# large-message plateau (GB-sized messages), per GPU and direction; the datasheet line rates they
# fall short of are in DATASHEET_LINK_BYTES_PER_S below.
# - A100 NVLink 3 / NVSwitch, 8 GPUs of a node: 232 GB/s (nccl-tests issue #175, all_reduce_perf
#   -b 8 -e 4G -g 8 on an 8x A100 NVSwitch node: 232.54 GB/s; an earlier NCCL's tuning model capped
#   sm80's bus bandwidth at 235 GB/s, tuning.cc at commit 01afd20). Line rate 300 GB/s.
# - A100 network, DGX A100's 8x ConnectX-6 HDR 200 Gb/s: 24 GB/s per GPU (NVIDIA/nccl issue #812,
#   NVIDIA's A. Laddy: "on an Nvidia DGX-A100 system we have 8x200Gbit/s IB cards and we measure
#   192GB/s AllReduce BusBW", 192 / 8 NICs; NVIDIA/nccl issue #412, S. Jeaugey: 24 GB/s per HDR
#   NIC at an 8 GB message). Line rate 25 GB/s.
# - H100/H200 NVLink 4 / NVSwitch: 370 GB/s (NVIDIA/nccl-tests issue #212, S. Jeaugey: "With the
#   protocol overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s", the busbw of
#   the ring, NCCL_ALGO=RING, at sizes above 256 MB). NCCL's all-reduce on 8 GPUs takes NVLink SHARP
#   (NVLS) by default and reports ~480 GB/s busbw (same thread; an 8x H200 node, nccl-tests issue
#   #272: 475 GB/s at 4 GB); NVLS is not modelled here, so an all-reduce inside a node is priced as
#   NCCL's ring and tree would run it. Line rate 450 GB/s.
# - H100/H200 network, DGX H100/H200's 8x ConnectX-7 NDR 400 Gb/s: 47 GB/s per GPU (NVIDIA/nccl-tests
#   issue #290, A. Laddy: "For NDR @ 400Gbps you should see 46-48GB/s per NIC", the middle of it;
#   issue #267: "up to 48-49GB/s per NIC"). Line rate 50 GB/s.
# - L4 and T4: no published nccl-tests busbw was found for 8 of them on PCIe, nor for Google
#   Cloud's g2 or AWS's g4dn Ethernet: they keep the datasheet line rates (an upper bound).
_A100_NVLINK_BUSBW, _A100_HDR_BUSBW = 232 * _GB, 24 * _GB
_H100_NVLINK_BUSBW, _H100_NDR_BUSBW = 370 * _GB, 47 * _GB
# Measured matmul ceilings: the best bf16 cuBLAS throughput over a sweep of shapes (S. Bekman,
# *Machine Learning Engineering*, "Maximum Achievable Matmul FLOPS comparison table", mamf-finder,
# CUDA 12.1): A100 SXM 267.9 of 312 TFLOP/s (85.9%), H100 SXM 792.1 of 989 (80.1%). The H200 has
# the H100's compute and the 40 GB A100 the 80 GB one's; the L4 and T4 have no published figure and
# keep the default 0.80.
_A100_MAMF, _H100_MAMF = 0.859, 0.801
# FlashAttention-2's throughput, the kernel behind PyTorch's SDPA flash backend: 50-73% of the A100's
# peak in the forward and less in the backward (Dao, "FlashAttention-2", 2023: 0.55 is taken across
# both), and "only 35% utilization on the H100 GPU" (Shah et al., "FlashAttention-3", 2024, its
# abstract), its kernels not using the Hopper's asynchronous tensor-core instructions. The H200 has
# the H100's compute.
_FA2_A100, _FA2_H100 = 0.55, 0.35
# The A100's clock under sustained tensor-core load: NVIDIA computed its HPL peak at 1,305 MHz, the
# clock an A100 holds at its power limit, against the 1,410 MHz boost clock of its 312 TFLOP/s
# (G. Lockwood, "Peak FLOPS", glennklockwood.com). mamf-finder's README (S. Bekman) defines the
# ceiling above (MAMF) as a best-of-sweep burst at the boost clock and a separate sustained figure
# (MSMF) as what training sees, so the two are not the same loss counted twice.
_A100_SUSTAINED_CLOCK = 1305 / 1410
P = NumberFormat

CATALOGUE: Dict[str, Hardware] = {h.name: h for h in (
    Hardware(
        "H100-SXM-80GB",
        # NVIDIA H100 Tensor Core GPU datasheet, SXM column, dense (half the starred sparse figures):
        # FP32 67 TF, TF32 989/2, BF16/FP16 1,979/2, FP8 3,958/2.
        {P.FP32: 66.9 * _TFLOPS, P.TF32: 494.7 * _TFLOPS, P.BF16: 989.4 * _TFLOPS, P.FP16: 989.4 * _TFLOPS,
         P.FP8: 1978.9 * _TFLOPS},
        memory_bytes=80 * _GB, memory_bytes_per_s=3350 * _GB,       # datasheet: 80 GB HBM3, 3.35 TB/s
        gpus_per_node=8,                                            # DGX/HGX H100: 8 GPUs on NVSwitch
        # NVLink 4 (900 GB/s both ways, 450 each) measured at 370 GB/s busbw; DGX H100 system: 8x
        # ConnectX-7 400 Gb/s InfiniBand, one per GPU (50 GB/s each way) measured at 47 GB/s.
        intra_node_bytes_per_s=_H100_NVLINK_BUSBW, intra_node_latency_s=_NVLINK_LAT,
        inter_node_bytes_per_s=_H100_NDR_BUSBW, inter_node_latency_s=_NET_LAT,
        intra_node_tree_latency_s=_NVLINK_TREE_LAT, inter_node_tree_latency_s=_NET_TREE_LAT,
        matmul_efficiency=_H100_MAMF, attention_efficiency=_FA2_H100,
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM); NVIDIA DGX H100 datasheet; NCCL busbw: "
               "NVIDIA/nccl-tests issues #212 (NVLink, ring) and #290 (NDR 400 Gb/s per NIC)"),
    Hardware(
        "H200-SXM-141GB",
        # NVIDIA H200 Tensor Core GPU datasheet: the H100's compute (same dense peaks as above).
        {P.FP32: 66.9 * _TFLOPS, P.TF32: 494.7 * _TFLOPS, P.BF16: 989.4 * _TFLOPS, P.FP16: 989.4 * _TFLOPS,
         P.FP8: 1978.9 * _TFLOPS},
        memory_bytes=141 * _GB, memory_bytes_per_s=4800 * _GB,      # datasheet: 141 GB HBM3e, 4.8 TB/s
        gpus_per_node=8,
        # The H100's NVLink 4 (450 GB/s each way) and DGX H200's 8x ConnectX-7 400 Gb/s (50 GB/s): the
        # H100's measured busbw (an 8x H200 node's NVLS all-reduce, 475 GB/s, matches the H100's 480).
        intra_node_bytes_per_s=_H100_NVLINK_BUSBW, intra_node_latency_s=_NVLINK_LAT,
        inter_node_bytes_per_s=_H100_NDR_BUSBW, inter_node_latency_s=_NET_LAT,
        intra_node_tree_latency_s=_NVLINK_TREE_LAT, inter_node_tree_latency_s=_NET_TREE_LAT,
        matmul_efficiency=_H100_MAMF, attention_efficiency=_FA2_H100,
        source="NVIDIA H200 Tensor Core GPU datasheet; NVIDIA DGX H200 datasheet; NCCL busbw: the H100's "
               "(NVIDIA/nccl-tests issues #212, #290; an H200 node in #272)"),
    Hardware(
        "A100-SXM-80GB",
        # NVIDIA A100 Tensor Core GPU datasheet, dense: FP32 19.5 TF, TF32 156, BF16/FP16 312; no FP8.
        {P.FP32: 19.5 * _TFLOPS, P.TF32: 156 * _TFLOPS, P.BF16: 312 * _TFLOPS, P.FP16: 312 * _TFLOPS},
        memory_bytes=80 * _GB, memory_bytes_per_s=2039 * _GB,       # datasheet: 80 GB HBM2e, 2,039 GB/s
        gpus_per_node=8,                                            # DGX A100: 8 GPUs on NVSwitch
        # NVLink 3 (600 GB/s both ways, 300 each) measured at 232 GB/s busbw; DGX A100 system: 8x
        # ConnectX-6 200 Gb/s HDR InfiniBand for compute, one per GPU (25 GB/s each way), measured at 24.
        intra_node_bytes_per_s=_A100_NVLINK_BUSBW, intra_node_latency_s=_NVLINK_LAT,
        inter_node_bytes_per_s=_A100_HDR_BUSBW, inter_node_latency_s=_NET_LAT,
        intra_node_tree_latency_s=_NVLINK_TREE_LAT, inter_node_tree_latency_s=_NET_TREE_LAT,
        matmul_efficiency=_A100_MAMF, attention_efficiency=_FA2_A100, sustained_clock_ratio=_A100_SUSTAINED_CLOCK,
        source="NVIDIA A100 Tensor Core GPU datasheet (SXM); NVIDIA DGX A100 datasheet; NCCL busbw: "
               "NVIDIA/nccl-tests issue #175 (NVLink), NVIDIA/nccl issues #812 and #412 (HDR 200 Gb/s)"),
    Hardware(
        "A100-SXM-40GB",
        {P.FP32: 19.5 * _TFLOPS, P.TF32: 156 * _TFLOPS, P.BF16: 312 * _TFLOPS, P.FP16: 312 * _TFLOPS},
        memory_bytes=40 * _GB, memory_bytes_per_s=1555 * _GB,       # datasheet: 40 GB HBM2, 1,555 GB/s
        gpus_per_node=8,
        # The 80 GB one's NVLink 3 and, in DGX A100 (40 GB), its 8x HDR 200 Gb/s: the same measured busbw.
        intra_node_bytes_per_s=_A100_NVLINK_BUSBW, intra_node_latency_s=_NVLINK_LAT,
        inter_node_bytes_per_s=_A100_HDR_BUSBW, inter_node_latency_s=_NET_LAT,
        intra_node_tree_latency_s=_NVLINK_TREE_LAT, inter_node_tree_latency_s=_NET_TREE_LAT,
        matmul_efficiency=_A100_MAMF, attention_efficiency=_FA2_A100, sustained_clock_ratio=_A100_SUSTAINED_CLOCK,
        source="NVIDIA A100 Tensor Core GPU datasheet (SXM 40GB); NVIDIA DGX A100 datasheet; NCCL busbw: "
               "NVIDIA/nccl-tests issue #175 (NVLink), NVIDIA/nccl issues #812 and #412 (HDR 200 Gb/s)"),
    Hardware(
        "L4",
        # NVIDIA L4 Tensor Core GPU datasheet, dense: FP32 30.3 TF, TF32 120/2, BF16/FP16 242/2, FP8 485/2.
        {P.FP32: 30.3 * _TFLOPS, P.TF32: 60 * _TFLOPS, P.BF16: 121 * _TFLOPS, P.FP16: 121 * _TFLOPS,
         P.FP8: 242.5 * _TFLOPS},
        memory_bytes=24 * _GB, memory_bytes_per_s=300 * _GB,        # datasheet: 24 GB GDDR6, 300 GB/s
        # No NVLink: GPUs of a node talk over PCIe Gen4 x16 (64 GB/s both ways, datasheet). A node of 8 L4
        # with 100 Gb/s Ethernet as Google Cloud's g2-standard-96 is: 12.5 GB/s shared by 8 GPUs.
        # Datasheet line rates: no published nccl-tests busbw was found for either.
        gpus_per_node=8, intra_node_bytes_per_s=32 * _GB, intra_node_latency_s=_PCIE_LAT,
        inter_node_bytes_per_s=12.5 * _GB / 8, inter_node_latency_s=_NET_LAT,
        intra_node_tree_latency_s=_PCIE_TREE_LAT, inter_node_tree_latency_s=_NET_TREE_LAT,
        source="NVIDIA L4 Tensor Core GPU datasheet; Google Cloud G2 machine types; links at their line "
               "rates (no published NCCL busbw found)"),
    Hardware(
        "T4",
        # NVIDIA T4 datasheet: FP32 8.1 TF, mixed FP16 65 TF (dense); Turing has no BF16, TF32 or FP8.
        {P.FP32: 8.1 * _TFLOPS, P.FP16: 65 * _TFLOPS},
        memory_bytes=16 * _GB, memory_bytes_per_s=320 * _GB,        # datasheet: 16 GB GDDR6, 320+ GB/s
        # PCIe Gen3 x16 (32 GB/s both ways, datasheet). A node of 8 T4 with 100 Gb/s networking as
        # AWS's g4dn.metal is: 12.5 GB/s shared by 8 GPUs. Datasheet line rates: no published
        # nccl-tests busbw was found for either.
        gpus_per_node=8, intra_node_bytes_per_s=16 * _GB, intra_node_latency_s=_PCIE_LAT,
        inter_node_bytes_per_s=12.5 * _GB / 8, inter_node_latency_s=_NET_LAT,
        intra_node_tree_latency_s=_PCIE_TREE_LAT, inter_node_tree_latency_s=_NET_TREE_LAT,
        source="NVIDIA T4 Tensor Core GPU datasheet; AWS EC2 G4 instance types (g4dn.metal); links at "
               "their line rates (no published NCCL busbw found)"),
)}

#: The datasheets' line rates of each catalogued target's links, per GPU and direction, in bytes/s:
#: name -> (inside a node, between nodes). The catalogue prices collectives at NCCL's measured bus
#: bandwidth, below these where a measurement exists (see the comments above the catalogue).
DATASHEET_LINK_BYTES_PER_S: Dict[str, Tuple[float, float]] = {
    "H100-SXM-80GB": (450 * _GB, 50 * _GB),       # NVLink 4: 900 GB/s both ways; ConnectX-7 400 Gb/s per GPU
    "H200-SXM-141GB": (450 * _GB, 50 * _GB),      # the same NVLink 4; DGX H200: ConnectX-7 400 Gb/s per GPU
    "A100-SXM-80GB": (300 * _GB, 25 * _GB),       # NVLink 3: 600 GB/s both ways; ConnectX-6 HDR 200 Gb/s per GPU
    "A100-SXM-40GB": (300 * _GB, 25 * _GB),
    "L4": (32 * _GB, 12.5 * _GB / 8),             # PCIe Gen4 x16; 100 Gb/s Ethernet shared by 8 GPUs
    "T4": (16 * _GB, 12.5 * _GB / 8),             # PCIe Gen3 x16; 100 Gb/s shared by 8 GPUs
}


#: Former names that still resolve, each with a DeprecationWarning: name -> (today's name, why).
FORMER_NAMES = {"Precision": ("NumberFormat", "the arithmetic a peak is quoted for; a run's dtypes are nbscaler.Recipe")}


def former_name(name: str, module: str):
    """What ``module``'s former ``name`` is now (``FORMER_NAMES``), with a DeprecationWarning; an
    ``AttributeError`` for any other name."""
    if name not in FORMER_NAMES:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    import warnings
    now, why = FORMER_NAMES[name]
    warnings.warn(f"{module}.{name} is now {module}.{now} ({why}).", DeprecationWarning, stacklevel=3)
    return globals()[now]


def __getattr__(name: str):
    return former_name(name, __name__)
