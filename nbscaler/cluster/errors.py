"""The errors a cluster call can end in, each naming the rank at fault and how to go on.

``RankError`` derives from ``nbscaler.runtime.launch.RankFailed``, so one ``except RankFailed``
covers a failed rank whether it ran under ``spawn`` or on a notebook cluster.
"""

from __future__ import annotations

from typing import Dict

from nbscaler.runtime.launch import RankFailed


class ClusterError(RuntimeError):
    """The cluster cannot take the call: it is stopped, broken, or its engines never came up."""


class RankError(RankFailed):
    """A rank raised during ``Cluster.run``.

    ``rank`` is the rank that failed first (the likely cause), ``remote_traceback`` its traceback
    as the engine printed it, and ``failures`` maps every failed rank to a one-line summary (ranks
    that failed later usually only lost their peer in a collective).
    """

    def __init__(self, rank: int, message: str, remote_traceback: str, failures: Dict[int, str]):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.failures = failures


class RankDied(RankError):
    """The engine process of a rank exited during a call (killed, crashed, out of memory).

    The process group has lost a member, so the cluster refuses further calls until
    ``Cluster.restart()`` has started fresh engines.
    """
