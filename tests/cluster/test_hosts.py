"""A cluster over several network hosts: controller, two engine hosts and the notebook apart.

``netns_hosts`` makes them on this machine: the controller in one network namespace, two engines
in each of two more (each under its own host name), and this process (the notebook) reaching them
over a bridge. Nothing can go over loopback between them, so the process group only forms if every
engine picks its own address and interface and rank 0's address is the rendezvous.
"""

import os

import psutil
import pytest
import torch
import torch.distributed as dist

from nbscaler.cluster import Cluster, network
from nbscaler.cluster.watchdog import cluster_processes
from tests.cluster import netns_hosts
from tests.cluster.test_listening import WILDCARD_IPS, cluster_tree, listening
from tests.multiprocess import Case, check_on_cluster

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]

TP_2X2 = Case("mlp", "tp", 2, 4)  # two units of two ranks: one unit per host


@pytest.fixture(scope="module")
def cluster_on_hosts(hosts, shell):
    cl = Cluster(n=4, engines=netns_hosts.NetnsEngineSetLauncher, timeout=20, name="hosts", start_timeout=120,
                 launcher_options={"hosts": list(hosts.engine_hosts)},
                 cluster_options={"controller": netns_hosts.controller_in(hosts.namespace("ctl")),
                                  "controller_ip": hosts.controller})
    try:
        yield cl
    finally:
        cluster_id = cl.cluster_id if cl.running else None
        cl.stop()
        assert cluster_id is None or cluster_processes(cluster_id) == []


def where_the_group_talks():
    """This rank's view: its environment for the group, and its open TCP connections."""
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)  # the group carries traffic right now
    connections = [(tuple(c.laddr), tuple(c.raddr)) for c in psutil.Process().net_connections("tcp4")
                   if c.status == psutil.CONN_ESTABLISHED]
    return {"host": os.uname().nodename, "sum": t.item(), "master": os.environ["MASTER_ADDR"],
            "ifnames": (os.environ["GLOO_SOCKET_IFNAME"], os.environ["NCCL_SOCKET_IFNAME"]),
            "connections": connections}


def test_each_host_s_ranks_sit_together_on_their_own_addresses(hosts, cluster_on_hosts):
    a, b = hosts.engine_hosts
    slots = cluster_on_hosts.engines
    assert [s.host for s in slots] == [a, a, b, b]  # unit u = rank // plan_ngpus lives on one host
    assert [s.local_rank for s in slots] == [0, 1, 0, 1]
    assert [s.address for s in slots] == [hosts.engine_hosts[s.host] for s in slots]
    assert {s.interface for s in slots} == {"eth0"}
    assert not cluster_on_hosts.single_host


def test_the_group_forms_over_the_hosts_interfaces_not_loopback(hosts, cluster_on_hosts):
    a, b = hosts.engine_hosts
    views = cluster_on_hosts.run(where_the_group_talks)
    assert [v["sum"] for v in views] == [6.0] * 4
    assert {v["master"] for v in views} == {hosts.engine_hosts[a]}
    assert {v["ifnames"] for v in views} == {("eth0", "eth0")}
    for rank, v in enumerate(views):
        own = hosts.engine_hosts[v["host"]]
        other = next(addr for host, addr in hosts.engine_hosts.items() if host != v["host"])
        # The group's connections to the other host leave from this host's own address...
        assert any(local[0] == own and remote[0] == other for local, remote in v["connections"]), v
        # ...and no two ranks talk over loopback (loopback is left to each engine's own helpers).
        for peer, w in enumerate(views):
            if peer != rank and w["host"] == v["host"]:
                theirs = {local for local, _ in w["connections"] if local[0].startswith("127.")}
                assert not [c for c in v["connections"] if c[1] in theirs], (rank, peer)


def test_network_names_an_interface_or_a_subnet(hosts, cluster_on_hosts):
    by_subnet = cluster_on_hosts.run(network.choose, str(hosts.subnet))
    by_name = cluster_on_hosts.run(network.choose, "eth0")
    expected = [network.Endpoint(s.address, "eth0") for s in cluster_on_hosts.engines]
    assert by_subnet == expected and by_name == expected


def test_tp_2x2_trains_as_one_process(cluster_on_hosts, tmp_path):
    check_on_cluster(cluster_on_hosts, TP_2X2, str(tmp_path))


def test_nothing_listens_on_every_interface_only_on_the_chosen_addresses(hosts, cluster_on_hosts):
    """The controller on its controller_ip, each rank on its own address; besides those, only
    loopback, where ipyparallel's helpers talk within a host (an engine and its nanny, the
    controller and its schedulers)."""
    assert cluster_on_hosts.run(lambda: 1) == [1] * 4
    sockets = listening(cluster_tree(cluster_on_hosts))
    assert {(pid, ip, port) for pid, ip, port in sockets if ip in WILDCARD_IPS} == set()
    addresses = {ip for _, ip, _ in sockets}
    assert {hosts.controller, *hosts.engine_hosts.values()} <= addresses
    assert addresses <= {hosts.controller, *hosts.engine_hosts.values(), "127.0.0.1"}
