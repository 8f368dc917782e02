"""NCCL's costs on a target: the ring and tree formulas exactly, on the link the group spans, and the
choice between them as NCCL's own latencies make it."""

import dataclasses
import math

import pytest

from nbscaler import Hardware
from nbscaler.cost.comm_model import CommModel
from nbscaler.cost.hardware import Link
from nbscaler.cost.nccl import TREE_BUS_RATIO, NcclModel

# Round figures, so each formula reads off: 100 GB/s and 1 us a ring step (0.5 us a tree step) inside a
# node, 10 GB/s and 10 us a ring step (20 us a tree step) across.
HW = dataclasses.replace(Hardware.named("H100-SXM-80GB", nodes=4), intra_node_bytes_per_s=100e9,
                         intra_node_latency_s=1e-6, inter_node_bytes_per_s=10e9, inter_node_latency_s=10e-6,
                         intra_node_tree_latency_s=0.5e-6, inter_node_tree_latency_s=20e-6)
MB = 10 ** 6


def test_ring_formulas_inside_a_node():
    nccl = NcclModel(HW)
    n = 4
    assert nccl.forward("all_gather", MB, n, ranks=range(4)) == pytest.approx(3 * 1e-6 + 3 * MB / 100e9)
    assert nccl.forward("reduce_scatter", MB, n, ranks=range(4)) == pytest.approx(3 * 1e-6 + 0.75 * MB / 100e9)
    assert nccl.forward("all_to_all", MB, n, ranks=range(4)) == pytest.approx(3 * 1e-6 + 0.75 * MB / 100e9)
    # all-reduce: inside a node NCCL's tree is a chain, 2 (4-1) = 6 steps of 0.5 us, against the ring's 6
    # of 1 us, a saving larger than its bus bytes lose at 0.92 of the ring's rate (ring 21 us, tree 19.3)
    assert nccl.forward("all_reduce", MB, n, ranks=range(4)) == pytest.approx(6 * 0.5e-6 + 1.5 * MB / 92e9)
    assert nccl.p2p(MB, ranks=(0, 1)) == pytest.approx(1e-6 + MB / 100e9)
    assert nccl.forward("all_reduce", MB, 1) == 0.0 and nccl.forward("first_only", MB, 4) == 0.0
    assert nccl.p2p_post(10) == 0.0


def test_for_a_large_group_the_tree_saves_latency_steps():
    nccl = NcclModel(HW)
    link = HW.link(range(32))
    assert link.bytes_per_s == 80e9                     # 8 rings side by side, each through its GPU's 10 GB/s
    n = 32
    ring = 2 * (n - 1) * 10e-6 + 2 * (n - 1) / n * MB / 80e9
    tree = 2 * math.ceil(math.log2(n)) * 20e-6 + 2 * (n - 1) / n * MB / (TREE_BUS_RATIO * 80e9)
    assert nccl.all_reduce(MB, n, link) == pytest.approx(min(ring, tree)) == pytest.approx(tree)   # a rank a node
    # 32 ranks on 4 nodes of 8: a chain of 7 steps inside each node, 2 between nodes, up and down
    on_4_nodes = 2 * (7 * 0.5e-6 + 2 * 20e-6) + 2 * (n - 1) / n * MB / (TREE_BUS_RATIO * 80e9)
    assert nccl.forward("all_reduce", MB, n, ranks=range(32)) == pytest.approx(on_4_nodes)
    # 2 ranks: the same 2 steps, the tree's cheaper (0.5 us) but at 0.92 of the bandwidth
    assert nccl.all_reduce(MB, 2, HW.link([0, 1])) == pytest.approx(min(2 * 1e-6 + MB / 100e9,
                                                                        2 * 0.5e-6 + MB / 92e9))
    assert nccl.all_reduce(100 * MB, 2, HW.link([0, 1])) == pytest.approx(2 * 1e-6 + 100 * MB / 100e9)


def test_across_nodes_a_group_has_a_share_of_the_network_per_rank_on_each_node_up_to_nvlink():
    """NCCL runs one ring per GPU of a node through that GPU's NIC: one rank a node gets one NIC's
    bus bandwidth, eight get eight (DGX A100: 24 and 192 GB/s), never more than NVLink's."""
    a100 = Hardware.named("A100-SXM-80GB", nodes=4)
    assert a100.link([0, 8, 16, 24]).bytes_per_s == a100.inter_node_bytes_per_s == 24e9
    assert a100.link([0, 1, 8, 9]).bytes_per_s == 2 * 24e9
    assert a100.link(range(32)).bytes_per_s == 8 * 24e9 < a100.intra_node_bytes_per_s
    assert a100.link([0, 1, 2, 8]).bytes_per_s == 24e9                         # the node with one rank binds
    assert HW.link(range(32)).bytes_per_s == 80e9 and dataclasses.replace(
        HW, inter_node_bytes_per_s=50e9).link(range(32)).bytes_per_s == 100e9  # NVLink's 100 GB/s bounds it


def test_on_a_catalogued_target_the_tree_wins_small_messages_and_the_ring_large_ones():
    """NCCL's own latencies (tuning.cc's hwLat, LL128): a tree step costs 1.25 us on NVLink against the
    ring's 1.9, 8.5 us on the network against 4.0; the tree moves its bus bytes at 0.92 of the ring's."""
    h100 = Hardware.named("H100-SXM-80GB", nodes=4)
    nccl = NcclModel(h100)
    inside, across = h100.link(range(8)), h100.link(range(32))
    assert (inside.latency_s, inside.tree_latency_s) == (1.9e-6, 1.25e-6)
    assert (across.latency_s, across.tree_latency_s) == (4.0e-6, 8.5e-6)

    def both(nbytes, n, link):
        """Ring and tree; the tree inside a node a chain of n - 1 steps, across nodes (a rank each) a
        binary tree of ceil(log2 n)."""
        bus = 2 * (n - 1) / n * nbytes
        steps = n - 1 if link.kind == "intra-node" else math.ceil(math.log2(n))
        return (2 * (n - 1) * link.latency_s + bus / link.bytes_per_s,
                2 * steps * link.tree_latency_s + bus / (0.92 * link.bytes_per_s))

    for n, link in ((8, inside), (32, across)):
        ring, tree = both(64 * 1024, n, link)
        assert tree < ring and nccl.all_reduce(64 * 1024, n, link) == pytest.approx(tree)      # 64 KiB: tree
        ring, tree = both(2 ** 30, n, link)
        assert ring < tree and nccl.all_reduce(2 ** 30, n, link) == pytest.approx(ring)        # 1 GiB: ring
    # across 4 nodes, one rank each: 4 tree steps of 8.5 us cost more than 6 ring steps of 4 us, so
    # the ring wins at every size
    for nbytes in (1024, MB, 2 ** 30):
        ring, tree = both(nbytes, 4, h100.link([0, 8, 16, 24]))
        assert ring < tree
        assert nccl.forward("all_reduce", nbytes, 4, ranks=[0, 8, 16, 24]) == pytest.approx(ring)


def test_a_link_without_a_tree_latency_takes_the_rings():
    assert Link("intra-node", 1e9, 3e-6).tree_latency_s == 3e-6
    custom = dataclasses.replace(Hardware.named("A100-SXM-80GB"), intra_node_tree_latency_s=None)
    assert custom.link(range(8)).tree_latency_s == custom.intra_node_latency_s


def test_backwards_are_the_matching_collectives():
    nccl = NcclModel(HW)
    assert nccl.backward("sum_grad", MB, 4, ranks=range(4)) == nccl.forward("all_reduce", MB, 4, ranks=range(4))
    assert nccl.backward("chunk", MB, 4, ranks=range(4)) == nccl.forward("all_gather", MB // 4, 4, ranks=range(4))
    assert nccl.backward("all_reduce", MB, 4, ranks=range(4)) == 0.0


def test_a_group_spanning_two_nodes_costs_the_network():
    nccl = NcclModel(HW)
    inside = nccl.forward("all_reduce", 64 * MB, 2, ranks=(6, 7))
    across = nccl.forward("all_reduce", 64 * MB, 2, ranks=(7, 8))
    assert across == pytest.approx(2 * 10e-6 + 64 * MB / 10e9) and across > 5 * inside
    assert nccl.p2p(MB, ranks=(7, 8)) == pytest.approx(10e-6 + MB / 10e9)
    assert nccl.forward("all_gather", MB, 8) == nccl.forward("all_gather", MB, 8, ranks=range(8))   # default


def test_more_nodes_for_data_parallelism_put_the_all_reduce_on_the_network():
    """Megatron's order: rank = unit * plan_ngpus + device. With 4 devices per unit, the same
    device of 2 units is on one node of 8; of 4 units, on two nodes."""
    nccl = NcclModel(HW)
    two_units = nccl.forward("all_reduce", 256 * MB, 2, ranks=[0, 4])
    four_units = nccl.forward("all_reduce", 256 * MB, 4, ranks=[0, 4, 8, 12])
    assert HW.link([0, 4]).kind == "intra-node" and HW.link([0, 4, 8, 12]).kind == "inter-node"
    assert four_units > 5 * two_units


def test_the_calibrated_model_serves_the_same_interface_and_ignores_where_ranks_are():
    model = CommModel(1e-4, 1e-9)
    assert model.forward("all_reduce", MB, 4, ranks=[0, 9, 17, 30]) == model.forward("all_reduce", MB, 4)
    assert model.backward("sum_grad", MB, 2, ranks=(0, 1)) == model.backward("sum_grad", MB, 2)
    assert model.p2p(MB, ranks=(0, 8)) == model.p2p(MB)


@pytest.mark.parametrize("model", [NcclModel(HW), CommModel(1e-4, 1e-9)])
def test_every_collective_of_the_table_is_priced_the_same_way_by_both_models(model):
    """Both models read ``layouts.COLLECTIVES``: sequence parallelism's sum-gradient all-gather costs
    an all-gather forward and a reduce-scatter of the whole backward, on a target as here."""
    assert model.forward("all_gather_sum_grad", MB, 8) == model.forward("all_gather", MB, 8) > 0
    assert model.backward("all_gather_sum_grad", MB, 8) == model.forward("reduce_scatter", 8 * MB, 8) > 0
    assert model.backward("chunk", MB, 8) == model.forward("all_gather", MB // 8, 8)
    assert model.forward("sum_grad", MB, 8) == model.backward("all_reduce", MB, 8) == 0.0
