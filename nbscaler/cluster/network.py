"""Which address and network interface an engine's process group uses.

On one machine any address works. On a cluster a host has several: loopback, a management
ethernet, a fast interconnect (InfiniBand, RoCE), container bridges. Rank 0's rendezvous address
(``MASTER_ADDR``) must be one the other hosts can reach, and gloo and nccl must open their
connections on an interface that reaches the peers: they are told which by ``GLOO_SOCKET_IFNAME``
and ``NCCL_SOCKET_IFNAME``. Left alone, both guess from the host name, which on many clusters
resolves to loopback or to an interface the other nodes cannot reach.

So every engine chooses its own *endpoint* (an IPv4 address and the interface that holds it):

- by default, the address it uses to reach the ipyparallel controller: whatever route the kernel
  picks toward the controller, the controller is reachable from there, and so, on a cluster, are
  the engines of the other hosts;
- with ``network='ib0'`` (an interface name), that interface's address on every host;
- with ``network='10.77.0.0/24'`` (a subnet), the host's address in that subnet, for clusters
  whose interfaces are named differently from host to host.

The engine then sets the two ``*_SOCKET_IFNAME`` variables to its own interface before it joins a
group, unless they were set in the environment it started with (the user's choice wins).

Nothing listens on every interface. Rank 0's rendezvous store listens on the rendezvous address
only (``listen_on``), and the controller on one address (``controller_ip``): loopback for local
engines, this host's endpoint for engines elsewhere, or the address the user names, never a
wildcard. gloo and nccl listen on the interface above.

Importable on the engines: it needs only the standard library and psutil.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Dict, List, Optional
from urllib.parse import urlparse

import psutil

SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
LOOPBACK = "127.0.0.1"
# Addresses that mean "every interface" to ipyparallel, zmq or the socket layer.
WILDCARDS = frozenset({"", "*", "0.0.0.0", "::", "[::]"})
# Set by whoever started this process; never overwritten.
_SET_BEFORE_START = {name for name in SOCKET_IFNAME_VARIABLES if os.environ.get(name)}


@dataclass(frozen=True)
class Endpoint:
    """Where one engine is reached for the process group."""

    address: str
    interface: str


def controller_host() -> Optional[str]:
    """The host this engine reached the controller at, when running inside an ipyparallel engine."""
    from ipyparallel.engine.app import IPEngine

    if not IPEngine.initialized():
        return None
    return urlparse(IPEngine.instance().registration_url).hostname or None


def ipv4_addresses() -> Dict[str, List[str]]:
    """Interface name -> its IPv4 addresses, on this host."""
    return {name: [a.address for a in addrs if a.family == socket.AF_INET]
            for name, addrs in psutil.net_if_addrs().items()}


def choose(network: Optional[str] = None, toward: Optional[str] = None) -> Endpoint:
    """This host's endpoint: on ``network`` (an interface name or a subnet) if given, else the
    address that routes to ``toward`` (the controller), else the address of the host's name."""
    interfaces = ipv4_addresses()
    if network:
        endpoint = _on_network(network, interfaces)
        if endpoint is None:
            listing = ", ".join(f"{name} {'/'.join(addrs) or '(no IPv4)'}" for name, addrs in sorted(interfaces.items()))
            raise ValueError(f"Cluster(network={network!r}): host {socket.gethostname()} has no IPv4 address on "
                             f"that interface or subnet (it has: {listing}); name an interface or subnet every "
                             "engine's host has.")
        return endpoint
    address = _route_to(toward) if toward else None
    if address is None:
        try:
            address = socket.gethostbyname(socket.getfqdn())
        except OSError:
            address = "127.0.0.1"
    return Endpoint(address, interface_of(address, interfaces) or "lo")


def controller_ip(engines: object, network: Optional[str] = None, given: Optional[str] = None) -> str:
    """The one address the ipyparallel controller listens on.

    ``given`` (the user's ``controller_ip``) when it names one address; loopback for local
    engines; otherwise this host's endpoint on ``network`` (or its host name's address), which
    engines on other hosts reach. A wildcard is refused: it would expose the controller on every
    network the notebook's host is on.
    """
    if given is not None:
        if given.strip() in WILDCARDS:
            raise ValueError(f"Cluster(cluster_options={{'controller_ip': {given!r}}}) would listen on every "
                             "interface; name the one address of this host that the engines reach (e.g. "
                             "'10.1.0.5'), or leave controller_ip out: nbscaler then uses loopback for local "
                             "engines, and this host's address on network= (or of its host name) for engines "
                             "elsewhere.")
        return given
    if engines == "local":
        return LOOPBACK
    try:
        return choose(network).address
    except ValueError as err:
        raise ValueError(f"{err} The controller listens on this host's address on that network too; where this "
                         "host has none, give cluster_options={'controller_ip': ADDRESS} with an address of this "
                         "host the engines reach.") from None


def listen_on(address: str) -> socket.socket:
    """A TCP socket bound to ``address`` alone (never every interface), on a port the system picks,
    listening. Raises ``OSError`` saying so when ``address`` is not one of this host's."""
    family, kind, proto, _, where = socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.bind(where)
        sock.listen(socket.SOMAXCONN)
    except OSError as err:
        sock.close()
        raise OSError(err.errno, f"cannot listen on {address} ({where[0]}) on host {socket.gethostname()}: "
                                 f"{err.strerror}. The rendezvous address must be one of rank 0's host: give "
                                 "Cluster(master_addr=) such an address, or leave it out.") from None
    return sock


def apply_interface(interface: str) -> None:
    """Point gloo and nccl at ``interface`` for the next group, unless the user already chose one."""
    for name in SOCKET_IFNAME_VARIABLES:
        if name not in _SET_BEFORE_START:
            os.environ[name] = interface


def interface_of(address: str, interfaces: Optional[Dict[str, List[str]]] = None) -> Optional[str]:
    """The interface that holds ``address`` on this host, if any."""
    for name, addrs in (ipv4_addresses() if interfaces is None else interfaces).items():
        if address in addrs:
            return name
    return None


def _on_network(network: str, interfaces: Dict[str, List[str]]) -> Optional[Endpoint]:
    try:
        subnet = ipaddress.ip_network(network, strict=False)
    except ValueError:  # not a subnet: an interface name
        addrs = interfaces.get(network) or []
        return Endpoint(addrs[0], network) if addrs else None
    for name, addrs in sorted(interfaces.items()):
        for address in addrs:
            if ipaddress.ip_address(address) in subnet:
                return Endpoint(address, name)
    return None


def _route_to(host: str) -> Optional[str]:
    """The local address the kernel would send from to reach ``host`` (no packet is sent)."""
    try:
        target = socket.gethostbyname(host)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))
            return probe.getsockname()[0]
    except OSError:
        return None
