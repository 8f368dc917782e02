"""One call on every rank: send the function, wait for all, and turn failures into one clear error.

A call sends one cloudpickled ``(fn, args, kwargs)`` to every rank (``engine.call``) and waits for
all of them. The rules for failures, which keep every error bounded in time:

- a rank that raises tears down its group before answering, so peers blocked on it fail at once;
  ranks still busy a few seconds after the first failure are interrupted (SIGINT). A collective
  that waits for a rank that never comes fails after the group's timeout, so an error reaches the
  notebook within that timeout plus a few seconds, whatever the ranks were doing;
- the call raises ``RankError`` naming the rank that failed first, with its remote traceback, and
  marks the group to be rebuilt (new rendezvous, same engines) before the next call;
- an interrupt of the notebook (``KeyboardInterrupt`` while waiting) interrupts every rank still
  running, waits for them to answer, and marks the group to be rebuilt as well; one that comes
  while the call is being sent waits until every rank has it, so none is left running unseen;
- the group is rebuilt only once every rank is idle, as the controller counts and each engine
  confirms (``rebuild_group``);
- an engine process that exits is seen within a fraction of a second (its pid, on this host) or
  by the controller's heartbeat (other hosts); the call raises ``RankDied`` and the session is
  marked broken: only fresh engines (``Cluster.restart()``) can go on.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import cloudpickle
import ipyparallel
from ipyparallel.error import EngineError, RemoteError

from nbscaler.cluster import engine, jobs
from nbscaler.cluster.engine import Outcome
from nbscaler.cluster.errors import ClusterError, RankDied, RankError
from nbscaler.cluster.session import POLL_S, EngineSlot, Session

# How long a finished call waits for its last reports, which travel apart from the results.
OUTPUT_WAIT_S = 1.0
# After the first failure, how long the other ranks may finish on their own before being
# interrupted. Peers of a failed rank are released at once (its group is gone), so this is short.
FAILURE_GRACE_S = 3.0
# How long interrupted ranks get to return, beyond the group timeout that may still hold them in a
# collective, before the cluster is declared stuck.
INTERRUPT_GRACE_S = 5.0
# How often ranks that have not stopped yet are interrupted again.
INTERRUPT_AGAIN_S = 1.0

# What RankDied says of an engine, by ``Session.how_gone``.
GONE = {
    "exited": "died during the call: its process exited (killed, crashed or out of memory).",
    "stopped": ("is stopped (SIGSTOP, or Ctrl-Z in the terminal that started it): its process neither computes "
                "nor answers the controller, which dropped it."),
    "unregistered": ("stopped answering during the call: the controller lost its heartbeat (its host or the "
                     "network to it is down, or its process hangs outside Python)."),
}

ReportHandler = Callable[[List[Dict[str, Any]]], None]


def call_every_rank(session: Session, fn: Callable[..., Any], args: Sequence[Any], kwargs: Dict[str, Any],
                    on_report: Optional[ReportHandler] = None) -> List[Any]:
    """Run ``fn(*args, **kwargs)`` on every rank; element ``r`` of the result is rank ``r``'s value."""
    payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs)))
    pending: List[ipyparallel.AsyncResult] = []
    # An interrupt between a send and its bookkeeping would leave a rank running a call nobody
    # waits for, and every later call queued behind it: hold it until every rank has the call.
    # While it waits, too, a stop is recorded and acted on between polls: raised wherever the
    # signal lands, a KeyboardInterrupt that lands in a finalizer is lost (Python ignores it there).
    with _interrupts_held() as interrupted:
        for s in session.slots:
            pending.append(session.client[s.engine_id].apply_async(engine.call, payload))
        if interrupted():               # every rank has the call already: stop them all
            _interrupt(session, list(session.slots), pending)
            raise KeyboardInterrupt
        outcomes, dead = _gather(session, pending, on_report, interrupted)
    return _values_or_raise(session, outcomes, dead)


@contextlib.contextmanager
def _interrupts_held() -> Iterator[Callable[[], bool]]:
    """Within the block SIGINT is recorded, not raised; yields whether one came. Outside the main
    thread (where Python delivers no signal) it holds nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: False
        return
    came: List[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        yield lambda: bool(came)
    finally:
        signal.signal(signal.SIGINT, previous)


def _gather(session: Session, pending: List[ipyparallel.AsyncResult], on_report: Optional[ReportHandler],
            interrupted: Callable[[], bool] = lambda: False) -> tuple:
    """Wait for every rank; after the first failure, interrupt those still running. ``interrupted``:
    whether the notebook asked to stop (a held SIGINT), looked at between polls."""
    outcomes: Dict[int, Outcome] = {}
    dead: List[EngineSlot] = []
    give_up_at: Optional[float] = None
    waiting = list(session.slots)
    try:
        while waiting:
            session.client.wait([pending[s.rank] for s in waiting], timeout=POLL_S)
            if interrupted():
                raise KeyboardInterrupt
            for s in waiting:
                if pending[s.rank].ready():
                    outcome = _outcome_of(s, pending[s.rank])
                    if outcome is None:
                        dead.append(s)
                    else:
                        outcomes[s.rank] = outcome
            dead += [s for s in session.dead(waiting) if s.rank not in outcomes and s not in dead]
            waiting = [s for s in waiting if s.rank not in outcomes and s not in dead]
            failed = dead or any(not o.ok for o in outcomes.values())
            if on_report is not None:
                if not waiting and not failed:  # reports travel apart from results: let them land
                    for result in pending:
                        result.wait_for_output(OUTPUT_WAIT_S)
                on_report([result.data for result in pending])
            if failed and give_up_at is None:
                give_up_at = time.monotonic() + min(session.spec.timeout, FAILURE_GRACE_S)
            if waiting and give_up_at is not None and time.monotonic() > give_up_at:
                outcomes.update(_interrupt(session, waiting, pending))
                break
    except KeyboardInterrupt:
        _interrupt(session, waiting, pending)
        raise
    return outcomes, dead


def _interrupt(session: Session, ranks: List[EngineSlot],
               pending: List[ipyparallel.AsyncResult]) -> Dict[int, Outcome]:
    """SIGINT ``ranks`` and collect what they return; the session is broken if one will not stop."""
    session.group_dirty = True
    if not ranks:
        return {}
    # Again and again: a rank that was still receiving the call when the first signal came (an
    # idle engine ignores it) gets the next one once it runs.
    deadline = time.monotonic() + session.spec.timeout + INTERRUPT_GRACE_S
    running = list(ranks)
    while running and time.monotonic() < deadline:
        _send_sigint(session, running)
        session.client.wait([pending[s.rank] for s in running], timeout=INTERRUPT_AGAIN_S)
        running = [s for s in running if not pending[s.rank].ready()]
    outcomes = {s.rank: _outcome_of(s, pending[s.rank]) for s in ranks if pending[s.rank].ready()}
    stuck = [str(s) for s in ranks if outcomes.get(s.rank) is None]
    if stuck:
        session.broken = f"{', '.join(stuck)} did not stop when interrupted"
    return {r: o for r, o in outcomes.items() if o is not None}


def rebuild_group(session: Session) -> None:
    """Rebuild the process group after a failed or interrupted call, once every rank is idle.

    A rank still running (or queued behind) an earlier call would join the new group only when
    that ends, and rank 0 would give up on it: it is interrupted first, and if it will not stop
    the session is broken, naming it.
    """
    deadline = time.monotonic() + session.spec.timeout + INTERRUPT_GRACE_S
    while True:
        busy = _busy(session) or _not_ready(session)
        if not busy:
            break
        if time.monotonic() >= deadline:
            session.broken = f"{', '.join(map(str, busy))} kept running an earlier call when interrupted"
            raise ClusterError(f"{session.broken}; call restart() for fresh engines and a new process group.")
        _send_sigint(session, busy)
        time.sleep(INTERRUPT_AGAIN_S)
    session.join_group()


def _busy(session: Session) -> List[EngineSlot]:
    """The ranks whose engine runs or queues a task (the controller's count)."""
    queues = session.client.queue_status()
    return [s for s in session.slots if queues.get(s.engine_id, {}).get("queue", 0) > 0]


def _not_ready(session: Session) -> List[EngineSlot]:
    """The ranks whose engine did not run a no-op at once (``engine.ready``), asked of every rank.

    The controller's count can lag an engine, so an idle engine is confirmed by the engine itself
    before the group is rebuilt: it runs its tasks in order, so the no-op returns only once every
    earlier task has ended. An interrupt sent on a stale count lands on the no-op, not on the join."""
    probes = [(slot, session.client[slot.engine_id].apply_async(engine.ready)) for slot in session.slots]
    stuck = []
    for slot, probe in probes:
        try:
            probe.get(timeout=INTERRUPT_AGAIN_S)
        except RemoteError as err:          # an earlier interrupt, absorbed: the engine is idle now
            if err.ename != "KeyboardInterrupt":
                raise
        except ipyparallel.error.TimeoutError:
            stuck.append(slot)
    return stuck


def _send_sigint(session: Session, ranks: List[EngineSlot]) -> None:
    """SIGINT the engines of ``ranks``: by pid on this host, through their nannies elsewhere."""
    here = socket.gethostname()
    remote = []
    for slot in ranks:
        if slot.host != here:
            remote.append(slot.engine_id)
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(slot.pid, signal.SIGINT)
    if remote:
        session.client.send_signal(signal.SIGINT, targets=remote, block=False)


def _outcome_of(slot: EngineSlot, result: ipyparallel.AsyncResult) -> Optional[Outcome]:
    """The Outcome of a finished rank, or None when its engine died under it."""
    try:
        return result.get()
    except EngineError:
        return None
    except RemoteError as err:
        if err.ename == EngineError.__name__:  # the controller saw the engine go, and says so remotely
            return None
        # Failed before engine.call could catch it, e.g. nbscaler is not importable there.
        return Outcome(slot.rank, False, error=f"{err.ename}: {err.evalue}", traceback=err.traceback or "",
                       failed_at=time.time())


def _values_or_raise(session: Session, outcomes: Dict[int, Outcome], dead: List[EngineSlot]) -> List[Any]:
    failures = {r: o.error for r, o in sorted(outcomes.items()) if not o.ok}
    if dead:
        first = min(dead, key=lambda s: s.rank)
        job = jobs.describe_end(str(session.spec.engines), session.job_id)
        how = session.how_gone(first)
        session.broken = f"{', '.join(map(str, dead))} {GONE[how].split(':')[0]}"
        raise RankDied(first.rank, f"{first} {GONE[how]} {job}{_consequences(failures)}"
                       "The other ranks cannot go on without it: call restart() for fresh engines and a new "
                       "process group.", "", {**failures, **{s.rank: "engine process died" for s in dead}})
    if failures:
        session.group_dirty = True
        failed = [o for o in outcomes.values() if not o.ok]
        # A rank told of a peer's failure may raise before the peer has: the peer is the cause.
        first = min([o for o in failed if o.peer is None] or failed, key=lambda o: o.failed_at)
        others = {r: e for r, e in failures.items() if r != first.rank}
        raise RankError(first.rank,
                        f"rank {first.rank} raised {first.error}\n{_consequences(others)}"
                        f"--- traceback on rank {first.rank} ---\n{first.traceback}"
                        "The engines stay up and the next call rebuilds the process group; modules "
                        "parallelized before this error must be parallelized again.",
                        first.traceback, failures)
    return [outcomes[r].value for r in range(len(session.slots))]


def _consequences(failures: Dict[int, str]) -> str:
    if not failures:
        return ""
    lines = "".join(f"  rank {r}: {e.splitlines()[0] if e else ''}\n" for r, e in failures.items())
    return f"Other ranks failed after it (most only lost their peer in a collective):\n{lines}"
