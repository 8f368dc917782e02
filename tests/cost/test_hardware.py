"""Hardware: the catalogue's figures, validation that names the field, and where a group's link is."""

import dataclasses

import pytest
import torch

import nbscaler
from nbscaler import Hardware, NumberFormat
from nbscaler.cost.hardware import DATASHEET_LINK_BYTES_PER_S


def test_catalogue_holds_dense_datasheet_peaks_and_per_direction_links():
    names = set(Hardware.catalogue())
    assert {"H100-SXM-80GB", "H200-SXM-141GB", "A100-SXM-80GB", "A100-SXM-40GB", "L4", "T4"} <= names
    h100 = Hardware.named("H100-SXM-80GB", nodes=8)
    assert h100.ngpus == 64 and h100.nodes == 8 and Hardware.named("H100-SXM-80GB").nodes == 1
    assert h100.peak_flops(torch.bfloat16) == 989.4e12 == h100.peak_flops(torch.float16)   # 1,979 sparse / 2
    assert h100.peak_flops(torch.float32) == pytest.approx(66.9e12)
    assert h100.intra_node_bytes_per_s == 370e9 and h100.inter_node_bytes_per_s == 47e9      # NCCL busbw, NVLink 4; NDR NIC
    a100 = Hardware.named("A100-SXM-80GB")
    assert a100.peak_flops(torch.bfloat16) == 312e12 and a100.memory_bytes == 80e9
    assert a100.intra_node_bytes_per_s == 232e9 and a100.inter_node_bytes_per_s == 24e9      # NCCL busbw, NVLink 3; HDR NIC
    assert Hardware.named("H200-SXM-141GB").memory_bytes == 141e9
    assert nbscaler.Hardware is Hardware


# name -> (NCCL busbw inside a node, between nodes), GB/s per GPU and direction, as the catalogue's
# comments source them: nccl-tests #175 (A100 NVLink), nccl #812 (DGX A100: 192 GB/s over 8 HDR NICs),
# nccl-tests #212 (H100 NVLink, ring), nccl-tests #290 (NDR: 46-48 GB/s per NIC); L4 and T4 unmeasured.
MEASURED_BUSBW = {"A100-SXM-80GB": (232, 192 / 8), "A100-SXM-40GB": (232, 192 / 8),
                  "H100-SXM-80GB": (370, 47), "H200-SXM-141GB": (370, 47)}


def test_links_are_nccls_measured_bus_bandwidth_below_the_datasheets_line_rate():
    catalogue = Hardware.catalogue()
    assert set(DATASHEET_LINK_BYTES_PER_S) == set(catalogue)
    for name, hw in catalogue.items():
        rates = DATASHEET_LINK_BYTES_PER_S[name]
        links = (hw.intra_node_bytes_per_s, hw.inter_node_bytes_per_s)
        if name in MEASURED_BUSBW:
            assert links == pytest.approx(tuple(b * 1e9 for b in MEASURED_BUSBW[name])), name
            assert all(link < rate for link, rate in zip(links, rates)), name
            assert "busbw" in hw.source, name
        else:   # no published measurement: the line rate, and the source says so
            assert links == rates and "line rate" in hw.source, name


def test_tree_and_ring_latencies_are_nccls_per_link_kind():
    """NCCL's tuning.cc (hwLat, LL128): ring NVLink 1.9 / PCI 2.5 / NET 4.0 us, tree 1.25 / 1.9 / 8.5 us."""
    for name, hw in Hardware.catalogue().items():
        pcie = name in ("L4", "T4")
        assert (hw.intra_node_latency_s, hw.intra_node_tree_latency_s) == ((2.5e-6, 1.9e-6) if pcie else (1.9e-6, 1.25e-6))
        assert (hw.inter_node_latency_s, hw.inter_node_tree_latency_s) == (4.0e-6, 8.5e-6)


def test_a_precision_the_gpu_lacks_is_refused_with_what_it_has():
    with pytest.raises(ValueError, match=r"T4.*no bfloat16 peak.*float32, float16"):
        Hardware.named("T4").peak_flops(torch.bfloat16)
    with pytest.raises(ValueError, match="no float8"):
        Hardware.named("A100-SXM-40GB").peak_flops(torch.float8_e4m3fn)
    assert NumberFormat.of(torch.float8_e5m2) is NumberFormat.FP8 and NumberFormat.of(torch.int64) is NumberFormat.FP32


@pytest.mark.parametrize("field,value,message", [
    ("inter_node_bytes_per_s", -1.0, "inter_node_bytes_per_s=-1.0 must be a positive number"),
    ("nodes", 0, "nodes=0 must be a whole number >= 1"),
    ("gpus_per_node", 2.5, "gpus_per_node=2.5 must be a whole number"),
    ("intra_node_latency_s", float("nan"), "intra_node_latency_s=nan must be a latency"),
    ("inter_node_tree_latency_s", -1e-6, "inter_node_tree_latency_s=-1e-06 must be a latency"),
    ("peak_flops_by_precision", {NumberFormat.BF16: 0}, r"peak_flops_by_precision\[bfloat16\]=0.0"),
    ("peak_flops_by_precision", {}, "is empty"),
])
def test_a_bad_figure_names_its_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(Hardware.named("L4"), **{field: value})


def test_unknown_names_and_too_small_targets_say_what_to_do():
    with pytest.raises(ValueError, match="no hardware named 'H800'.*known: H100-SXM-80GB"):
        Hardware.named("H800")
    with pytest.raises(ValueError, match=r"16 ranks.*8 GPUs.*nodes=2"):
        Hardware.named("A100-SXM-80GB").check_ranks(16)


def test_a_group_on_one_node_uses_nvlink_and_one_across_nodes_the_network():
    hw = Hardware.named("H100-SXM-80GB", nodes=2)
    assert hw.link(range(8)).kind == "intra-node" and hw.link(range(8)).bytes_per_s == 370e9
    assert hw.link([7, 8]).kind == "inter-node" and hw.link([7, 8]).bytes_per_s == 47e9
    assert hw.link([3, 11]).latency_s == hw.inter_node_latency_s


def test_local_is_this_machine_as_measured():
    here = Hardware.local()
    assert here.is_local and not Hardware.named("L4").is_local
    assert here.peak_flops(torch.float32) > 0 and here.memory_bytes > 0 and here.memory_bytes_per_s > 0
    assert here.name.startswith("local (")
