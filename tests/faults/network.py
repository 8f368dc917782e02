"""A fault of the network: the link between two hosts of a multi-host cluster cut while their
ranks all-reduce (``tests.cluster.netns_hosts``: each host a network namespace)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from nbscaler.cluster import Cluster
from tests.cluster import netns_hosts
from tests.faults.staging import Row, Trigger, all_reduce_forever, error_of, first_line, names_rank
from tests.multiprocess import Case, check_on_cluster

CUT_HOST = "b"                         # the host whose link goes down; its one engine's rank is named
TP_ACROSS = Case("mlp", "tp", 2, 2)


def hosts_cluster(hosts: netns_hosts.Hosts, timeout: float = 20) -> Cluster:
    """One engine on each of the two hosts, the controller on a third."""
    return Cluster(n=2, engines=netns_hosts.NetnsEngineSetLauncher, timeout=timeout, name="cut",
                   start_timeout=120, launcher_options={"hosts": list(hosts.engine_hosts)},
                   cluster_options={"controller": netns_hosts.controller_in(hosts.namespace("ctl")),
                                    "controller_ip": hosts.controller})


def link(hosts: netns_hosts.Hosts, host: str, state: str) -> None:
    subprocess.run(["ip", "-n", hosts.namespace(host), "link", "set", "eth0", state], check=True)


def cut_between_hosts(hosts: netns_hosts.Hosts, folder: Path) -> Row:
    """Take host b's link down while both ranks all-reduce; bring it back, restart, train."""
    cluster = hosts_cluster(hosts)
    try:
        # engines take their ids, and so their ranks, in the order they register: look the rank up
        cut = next(slot.rank for slot in cluster.engines if slot.host == hosts.namespace(CUT_HOST))
        trigger = Trigger(lambda: link(hosts, CUT_HOST, "down"))
        try:
            err, ended = error_of(lambda: cluster.run(all_reduce_forever, trigger.signal, cut))
        finally:
            trigger.close()
            link(hosts, CUT_HOST, "up")
        works, why = True, ""
        try:
            cluster.restart()
            check_on_cluster(cluster, TP_ACROSS, str(folder / "after"))
        except Exception as failure:     # reported in the row
            works, why = False, first_line(failure)
    finally:
        cluster.stop()
    cause = "heartbeat" in str(err) or "network" in str(err)
    return Row("network cut between two hosts", ended - trigger.at if trigger.at else float("nan"), first_line(err),
               names_rank(err, cut), cause, True, works,
               why or "the link is back before restart(); nothing on disk is involved")
