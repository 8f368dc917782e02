"""Separate network "hosts" on this machine: Linux network namespaces on one bridge.

::

    root namespace (the notebook)  <prefix>nb  10.77.S.254 --+
    <prefix>ctl   (the controller) eth0        10.77.S.1   --+-- bridge br0 in <prefix>sw
    <prefix>a     (engines, host a) eth0       10.77.S.11  --+
    <prefix>b     (engines, host b) eth0       10.77.S.12  --+

Each namespace has its own loopback and one veth whose peer is on a bridge in a namespace of its
own, so the host's firewall never sees the traffic. Engines run with ``ip netns exec`` and, in a
UTS namespace of their own (``unshare --uts``), under the host name of their namespace, so that
nbscaler sees several hosts as on a real cluster. ``S`` is the first 10.77.S.0/24 no interface
of this machine uses yet.

``NetnsEngineSetLauncher`` and ``controller_in`` are ipyparallel launchers that prefix their
commands that way; ``Cluster(engines=...)`` and ``cluster_options={'controller': ...}`` take them
unchanged. Needs root and ``ip`` (iproute2).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ipyparallel.cluster.launcher import LocalControllerLauncher, LocalEngineLauncher, LocalEngineSetLauncher
from traitlets import List as ListTrait

from nbscaler.cluster import network

HOST_OCTETS = {"a": 11, "b": 12}
CONTROLLER_OCTET = 1
NOTEBOOK_OCTET = 254


@dataclass
class Hosts:
    """The namespaces of one run and their addresses."""

    prefix: str
    subnet: ipaddress.IPv4Network
    made: List[str] = field(default_factory=list)

    def address(self, octet: int) -> str:
        return str(self.subnet.network_address + octet)

    @property
    def controller(self) -> str:
        return self.address(CONTROLLER_OCTET)

    @property
    def notebook(self) -> str:
        return self.address(NOTEBOOK_OCTET)

    def namespace(self, name: str) -> str:
        return f"{self.prefix}{name}"

    @property
    def engine_hosts(self) -> Dict[str, str]:
        """Engine host name -> its address."""
        return {self.namespace(h): self.address(o) for h, o in HOST_OCTETS.items()}


def missing_reason() -> Optional[str]:
    """Why namespaces cannot be made here, or None."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "ip (iproute2) and unshare (util-linux) are needed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


def make() -> Hosts:
    """Make the namespaces, veths and bridge; on any failure, remove what was made and raise."""
    hosts = Hosts(f"nbs{os.getpid() % 100000}", _free_subnet())
    try:
        sw = hosts.namespace("sw")
        _netns_add(hosts, sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for name, octet in [("ctl", CONTROLLER_OCTET), *HOST_OCTETS.items()]:
            ns = hosts.namespace(name)
            _netns_add(hosts, ns)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"v{name}", "netns", sw)
            _ip("-n", ns, "addr", "add", f"{hosts.address(octet)}/{hosts.subnet.prefixlen}", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", sw, "link", "set", f"v{name}", "master", "br0", "up")
        notebook_link = hosts.namespace("nb")
        _ip("link", "add", notebook_link, "type", "veth", "peer", "name", "vnb", "netns", sw)
        _ip("addr", "add", f"{hosts.notebook}/{hosts.subnet.prefixlen}", "dev", notebook_link)
        _ip("link", "set", notebook_link, "up")
        _ip("-n", sw, "link", "set", "vnb", "master", "br0", "up")
    except BaseException:
        remove(hosts)
        raise
    return hosts


def remove(hosts: Hosts) -> None:
    """Delete the namespaces (their veths go with them, and so does the notebook's peer)."""
    for ns in reversed(hosts.made):
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    hosts.made.clear()
    subprocess.run(["ip", "link", "del", hosts.namespace("nb")], capture_output=True)


def controller_in(namespace: str) -> type:
    """An ipyparallel controller launcher that starts ``ipcontroller`` inside ``namespace``."""

    class NetnsControllerLauncher(LocalControllerLauncher):
        def find_args(self) -> List[str]:
            return ["ip", "netns", "exec", namespace, *super().find_args()]

    return NetnsControllerLauncher


class NetnsEngineLauncher(LocalEngineLauncher):
    """One engine in the namespace (and under the host name) of its share of ``hosts``."""

    def find_args(self) -> List[str]:
        hosts = self.parent.hosts
        host = hosts[int(self.identifier) * len(hosts) // self.parent.n]
        become = 'hostname "$0" && exec "$@"'
        return ["ip", "netns", "exec", host, "unshare", "--uts", "sh", "-c", become, host, *super().find_args()]


class NetnsEngineSetLauncher(LocalEngineSetLauncher):
    """``n`` engines shared out in order over the namespaces in ``hosts`` (equal shares)."""

    launcher_class = NetnsEngineLauncher
    hosts = ListTrait(config=True, help="network namespaces, one per host; each is also its host name")


def _free_subnet() -> ipaddress.IPv4Network:
    used = {a for addrs in network.ipv4_addresses().values() for a in addrs}
    for third in range(256):
        subnet = ipaddress.ip_network(f"10.77.{third}.0/24")
        if not any(ipaddress.ip_address(a) in subnet for a in used):
            return subnet
    raise RuntimeError("every 10.77.x.0/24 is in use on this machine")


def _netns_add(hosts: Hosts, ns: str) -> None:
    _ip("netns", "add", ns)
    hosts.made.append(ns)
    _ip("-n", ns, "link", "set", "lo", "up")


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
