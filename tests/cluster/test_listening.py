"""Where a cluster listens: a local cluster on loopback only, and never on every interface."""

import os
import socket
from typing import List, Set, Tuple

import psutil
import pytest

from nbscaler.cluster import engine, network
from nbscaler.cluster.watchdog import cluster_processes

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(120)]

WILDCARD_IPS = {"0.0.0.0", "::"}
TCP_LISTEN = "0A"


def cluster_tree(cl) -> List[psutil.Process]:
    """The controller and its helpers, every engine, and everything they started."""
    roots = cluster_processes(cl.cluster_id) + [psutil.Process(s.pid) for s in cl.engines]
    found = {}
    for root in roots:
        for p in [root, *root.children(recursive=True)]:
            found[p.pid] = p
    return list(found.values())


def listening(processes: List[psutil.Process]) -> Set[Tuple[int, str, int]]:
    """``(pid, ip, port)`` of every TCP socket the processes listen on.

    Read from ``/proc/<pid>/net/tcp{,6}``, the tables of each process's own network namespace
    (psutil reads this process's), matched to the socket inodes among its open files."""
    out = set()
    for p in processes:
        inodes = socket_inodes(p.pid)
        for table in ("tcp", "tcp6"):
            for line in open(f"/proc/{p.pid}/net/{table}").read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == TCP_LISTEN and fields[9] in inodes:
                    ip, port = fields[1].split(":")
                    out.add((p.pid, _address(ip), int(port, 16)))
    return out


def socket_inodes(pid: int) -> Set[str]:
    """The inodes of the sockets among ``pid``'s open files (``socket:[123]``)."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:               # closed meanwhile
            continue
        if target.startswith("socket:["):
            found.add(target[len("socket:["):-1])
    return found


def _address(hex_ip: str) -> str:
    """An address of ``/proc/net/tcp{,6}``: 32-bit words in host (little-endian) order."""
    raw = b"".join(bytes.fromhex(hex_ip[i:i + 8])[::-1] for i in range(0, len(hex_ip), 8))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def test_a_local_cluster_listens_on_loopback_only(cluster):
    assert cluster.run(lambda: 1) == [1, 1]                   # the group is up: its store and gloo listen
    processes = cluster_tree(cluster)
    sockets = listening(processes)
    pids = {pid for pid, _, _ in sockets}
    assert {s.pid for s in cluster.engines} <= pids           # rank 0's store, each rank's gloo
    assert pids - {s.pid for s in cluster.engines}            # the controller
    assert {(pid, ip, port) for pid, ip, port in sockets if ip in WILDCARD_IPS} == set()
    assert {ip for _, ip, _ in sockets} == {"127.0.0.1"}


def test_the_rendezvous_store_listens_on_its_address_alone():
    try:
        port = engine.open_rendezvous(1, 5.0, "127.0.0.1")
        mine = listening([psutil.Process()])
        assert ("127.0.0.1", port) in {(ip, p) for _, ip, p in mine}
        assert all(ip not in WILDCARD_IPS for _, ip, p in mine if p == port)
    finally:
        engine._store = None
    with pytest.raises(OSError, match=r"cannot listen on 192\.0\.2\.1 .*Cluster\(master_addr=\)"):
        engine.open_rendezvous(1, 5.0, "192.0.2.1")            # TEST-NET-1: no host has it


def test_the_controller_listens_on_one_address():
    assert network.controller_ip("local") == "127.0.0.1"
    assert network.controller_ip("slurm", "lo") == "127.0.0.1"           # this host's address on network=
    assert network.controller_ip("slurm", "127.0.0.0/8") == "127.0.0.1"
    assert network.controller_ip("slurm") == network.choose().address
    assert network.controller_ip("mpi", None, "10.1.0.5") == "10.1.0.5"
    for wildcard in ("*", "0.0.0.0", "::", ""):
        with pytest.raises(ValueError, match="every interface.*name the one address"):
            network.controller_ip("slurm", None, wildcard)
    with pytest.raises(ValueError, match="controller_ip"):
        network.controller_ip("slurm", "no-such-interface0")
