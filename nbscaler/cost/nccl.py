"""Collective times on a target: NCCL's ring and tree costs on the link a group spans.

A collective over a group of ``n`` ranks moves, per rank, a share of the data NCCL calls the *bus*
bytes, over the group's slowest link (``Hardware.link``: NVLink when every rank is on one node,
else the network, whose per-GPU bandwidth is a node's NICs shared by its GPUs), and pays that
link's latency once per algorithm step. With ``b`` the local input's bytes, ``B`` the link's
bandwidth per GPU and direction, ``a`` its latency per ring step and ``t`` per tree step
(``Link.tree_latency_s``), and, for the tree, ``r`` ranks on each of ``m`` nodes:

==================  =========================================  ===============================================================
collective          ring                                       tree (all-reduce only)
==================  =========================================  ===============================================================
``all_reduce``      ``2(n-1) a + 2(n-1)/n b / B``               ``2((r-1) t_node + ceil(log2 m) t) + 2(n-1)/n b / (0.92 B)``
``all_gather``      ``(n-1) a + (n-1) b / B`` (output ``n b``)
``reduce_scatter``  ``(n-1) a + (n-1)/n b / B``
``all_to_all``      ``(n-1) a + (n-1)/n b / B``
send/recv           ``a + b / B``
==================  =========================================  ===============================================================

The bandwidth factors are those NCCL's performance notes use to turn a collective's time into bus
bandwidth (``2(n-1)/n`` for all-reduce, ``(n-1)/n`` of the output for all-gather and of the input
for reduce-scatter), so a link's bandwidth is what ``nccl-tests`` reports as ``busbw``: the
catalogue's figures are such measurements at large messages (``cost.hardware``). NCCL's tree is a
chain through the ranks of a node (``r - 1`` steps, each at the node link's tree latency
``t_node``) and a double binary tree across nodes (``ceil(log2 m)`` steps), up and down, as its
tuning model counts them (``2 * ((nRanks/nNodes-1) * intraLat + log2i(nNodes) * interLat)``), and
moves the same bus bytes a little slower: NCCL's tuning model gives it 0.92 of the
ring's bus bandwidth (``TREE_BUS_RATIO``, NVIDIA/nccl src/graph/tuning.cc). NCCL picks the faster,
and so does ``all_reduce`` here: the tree for small messages over many ranks, the ring for large ones.

Where a group sits follows Megatron's rank order, which nbscaler's runtime ranks have: within a unit
(a model copy) the tensor-parallel ranks are adjacent, then the pipeline stages; units (data
parallelism) come last. So a tensor-parallel group of up to ``gpus_per_node`` stays on NVLink while
the data-parallel groups of a job on several nodes, and pipeline sends between nodes, cross the network.

``NcclModel`` serves the interface ``cost.comm_model.CommModel`` serves (``forward``, ``backward``,
``p2p``, ``p2p_post``), each taking the group's global ``ranks``.

>>> nccl = NcclModel(Hardware.named("H100-SXM-80GB", nodes=2))
>>> nccl.forward("all_reduce", 2 ** 30, 8, ranks=range(8)) < nccl.forward("all_reduce", 2 ** 30, 8, ranks=range(4, 12))
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

from nbscaler.cost.comm_model import backward_time, priced_as
from nbscaler.cost.hardware import Hardware, Link
from nbscaler.layouts import Backend, Collective

#: The tree's bus bandwidth over the ring's: NCCL's tuning model takes ``busBw * .92`` for its tree
#: (NVIDIA/nccl, src/graph/tuning.cc, ``if (a == NCCL_ALGO_TREE) busBw = std::min(busBw*.92, ...)``).
TREE_BUS_RATIO = 0.92


@dataclass(frozen=True)
class NcclModel:
    """Collective seconds on ``hardware``; a group without ``ranks`` is taken as ``range(n)``.
    A sweep asks for the same collectives many times: each is worked out once (``_seconds``)."""

    hardware: Hardware
    _seconds: Dict[Tuple, float] = field(default_factory=dict, compare=False, repr=False)

    def link(self, n: int, ranks: Optional[Sequence[int]]) -> Link:
        return self.hardware.link(range(n) if ranks is None else ranks)

    def ring(self, steps: float, nbytes: float, link: Link) -> float:
        return steps * link.latency_s + nbytes / link.bytes_per_s

    def all_reduce(self, nbytes: float, n: int, link: Link, ranks: Optional[Sequence[int]] = None) -> float:
        """The faster of NCCL's ring and tree for an all-reduce of ``nbytes`` over ``n`` ranks
        (``ranks``): the tree pays a chain through each node's ranks and ``ceil(log2 nodes)`` steps
        between nodes, up and down, at the tree latencies (``Link.tree_latency_s``), and moves the bus
        bytes at ``TREE_BUS_RATIO`` of the ring's rate. Without ``ranks``, a group on an intra-node
        link is one node and a group on the network has a rank on each of ``n`` nodes."""
        bus = 2 * (n - 1) / n * nbytes
        ring = self.ring(2 * (n - 1), bus, link)
        if ranks is not None:
            nodes = len({self.hardware.node_of(r) for r in ranks})
        else:
            nodes = 1 if link.kind == "intra-node" else n
        chain = math.ceil(n / nodes) - 1
        node_step = link.tree_latency_s if nodes == 1 else self.hardware.link([0]).tree_latency_s
        steps = 2 * (chain * node_step + math.ceil(math.log2(nodes)) * link.tree_latency_s)
        tree = steps + bus / (TREE_BUS_RATIO * link.bytes_per_s)
        return min(ring, tree)

    def forward(self, fn: str, nbytes: int, n: int, ranks: Optional[Sequence[int]] = None) -> float:
        """Seconds of collective ``fn`` over ``n`` ranks (``ranks``) on a local input of ``nbytes``."""
        key = (fn, nbytes, n, ranks if ranks is None or isinstance(ranks, (range, tuple)) else tuple(ranks))
        if key not in self._seconds:
            self._seconds[key] = self._forward(fn, nbytes, n, ranks)
        return self._seconds[key]

    def _forward(self, fn: str, nbytes: int, n: int, ranks: Optional[Sequence[int]]) -> float:
        primitive = priced_as(fn, n, Backend.NCCL)
        if primitive is None:
            return 0.0
        link = self.link(n, ranks)
        share = (n - 1) / n
        return {
            Collective.ALL_GATHER: lambda: self.ring(n - 1, (n - 1) * nbytes, link),
            Collective.ALL_REDUCE: lambda: self.all_reduce(nbytes, n, link, ranks),
            Collective.REDUCE_SCATTER: lambda: self.ring(n - 1, share * nbytes, link),
            Collective.ALL_TO_ALL: lambda: self.ring(n - 1, share * nbytes, link),
        }[primitive]()

    def backward(self, fn: str, nbytes: int, n: int, ranks: Optional[Sequence[int]] = None) -> float:
        """Seconds of the backward of ``fn`` (``nbytes``: the forward's local input)."""
        return backward_time(self, fn, nbytes, n, ranks)

    def p2p(self, nbytes: int, ranks: Optional[Sequence[int]] = None) -> float:
        """Seconds of one send/recv of ``nbytes`` between ``ranks`` (two ranks; ``(0, 1)`` if None)."""
        link = self.link(2, ranks)
        return link.latency_s + nbytes / link.bytes_per_s

    def p2p_post(self, ntensors: int) -> float:
        """Starting a send on a GPU queues it on a stream: nothing on the rank's clock."""
        return 0.0
