"""The network between two hosts of a cluster cut mid-collective: the rank behind the cut is
named within 60 s, and once the link is back, restart() trains as one process does."""

import pytest

from tests.faults import network
from tests.faults.staging import check

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(300)]


def test_a_cut_between_hosts_names_the_rank_behind_it(hosts, shell, tmp_path):
    check(network.cut_between_hosts(hosts, tmp_path))
