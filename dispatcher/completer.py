"""The completer: owns the batched, fenced writes of attempt outcomes.

Outcomes queue here as deliveries finish (`add`); `flush` records everything queued in
one statement (`record_outcomes`, fenced by lease token). While a dispatcher loop runs,
a background thread flushes (`start`/`kick`/`stop`) on its own connection, so the
record of one batch overlaps the claim of the next and the handlers of a third: a slot
is free when its handler returns, not when its outcome is written. Outside a loop
(`fill()`/`reap()` driven by hand) `flush` is synchronous, as it always was.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError

from dispatcher.producer import HeldConnection, retried
from outbox._idempotency import Clock
from outbox._schema import AttemptOutcome, EffectStatus
from outbox._telemetry import deliveries
from outbox.sql import dispatch as sql
from outbox.sql.dispatch import Outcome

log = logging.getLogger("outbox.dispatcher")


# SQLSTATEs of a connection or a server that went away (class 08; admin, crash and
# startup shutdowns), and of a failover that left us on a read-only standby: the same
# statement succeeds once the database answers again. Not a statement timeout, a lock
# timeout, a full disk: those are OperationalErrors too, but may fail every time.
_GONE = ("57P01", "57P02", "57P03", "25006")


def _connection_lost(exc: DBAPIError) -> bool:
    """A failure of the connection, not of the statement: worth writing again later."""
    if exc.connection_invalidated:
        return True
    code = getattr(exc.orig, "sqlstate", None)
    if code is None:  # no server answer at all (closed, reset, silent: SilentConnection)
        return isinstance(exc, OperationalError | InterfaceError)
    return code.startswith("08") or code in _GONE

# How long the background writer waits for a fuller batch (seconds): the price in
# `delivered_at` latency of writing one statement per batch instead of per effect.
LINGER = 0.002


@dataclass(slots=True)
class Stats:
    claimed: int = 0
    recorded: dict[str, int] = field(default_factory=dict)
    lease_lost: int = 0

    def add(self, recorded: dict[int, str]) -> None:
        for outcome in recorded.values():
            self.recorded[outcome] = self.recorded.get(outcome, 0) + 1
            if outcome == AttemptOutcome.LEASE_LOST:
                self.lease_lost += 1


class Completer:
    """Records finished attempts in batches, fenced by lease token."""

    def __init__(self, engine: Engine, *, worker_id: str, clock: Clock, stats: Stats,
                 target: int = 1, labels: Mapping[str, str] | None = None,
                 keep_for: float = 30.0) -> None:
        """`keep_for`: how long outcomes a lost connection kept from the database are
        kept for another try (the lease: after it the effects are redelivered anyway).
        `conn.holding(True)` keeps one pooled connection between writes (a loop runs)."""
        self.conn = HeldConnection(engine)
        self.labels = dict(labels or {})  # added to `outbox.deliveries` (`db`)
        # The background writer waits up to LINGER for `target` outcomes: a statement
        # per finished delivery would cost a round trip and a commit each.
        self.target = max(1, target)
        self._full = threading.Event()
        self.worker_id = worker_id
        self.clock = clock
        self.stats = stats
        self.pending: list[Outcome] = []  # finished, not yet written
        # Called after a flush delivered or cancelled an effect with an ordering key:
        # its successor is claimable now, behind the producer's watermark.
        self.on_unblocked: Callable[[], None] | None = None
        self._lock = threading.Lock()     # guards `pending` and `stats`
        self._kick = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._writing = 0                 # flushes under way
        self.on_written: Callable[[], None] | None = None  # after each background flush
        self.keep_for = keep_for
        self._kept_since: float | None = None  # the first failed write of kept outcomes
        self._final = True                     # the writer's last flush drops on failure

    def add(self, outcome: Outcome) -> None:
        with self._lock:
            self.pending.append(outcome)
            full = len(self.pending) >= self.target
        if full:
            self._full.set()

    @property
    def backlog(self) -> int:
        """Outcomes queued or being written."""
        return len(self.pending) + self._writing

    def flush(self, *, final: bool = False) -> dict[int, str]:
        """Record every queued outcome in one statement; returns what was recorded.

        `final` (the process is stopping): a batch the database does not take is
        dropped, not kept (its effects are redelivered after their leases)."""
        with self._lock:
            batch, self.pending = self.pending, []
            if not batch:
                return {}
            self._writing += len(batch)
        try:
            try:
                recorded = self._record(batch)
            except DBAPIError as exc:
                now = time.monotonic()
                since = now if self._kept_since is None else self._kept_since
                if not final and _connection_lost(exc) and now - since < self.keep_for:
                    self._kept_since = since
                    # The database did not answer for db_retry's whole budget (a
                    # failover, a partition). The outcomes are kept, first in line, and
                    # written when it answers: each is still fenced by its lease token,
                    # so one whose lease expired and was taken meanwhile is recorded as
                    # lease_lost. Dropped, each effect was delivered again after its
                    # lease, and one on its last attempt was dead-lettered although it
                    # had been delivered. The kept backlog stops the claims (`_free`);
                    # past `keep_for` (the lease) they are dropped as before.
                    with self._lock:
                        self.pending[:0] = batch
                    log.warning("could not record %d outcomes (%s); kept, to be written "
                                "when the database answers", len(batch),
                                str(exc.orig or exc).splitlines()[0][:200])
                    return {}
                self._kept_since = None
                log.exception("could not record %d outcomes; their leases will expire and "
                              "the effects will be redelivered with the same keys",
                              len(batch))
                return {}
            with self._lock:
                self.stats.add(recorded)
            self._kept_since = None
        finally:
            with self._lock:
                self._writing -= len(batch)
        unblocked = False
        counted: dict[tuple[str, str, str], int] = {}
        for o in batch:
            got = recorded.get(o.effect_id)
            if got is None:  # recorded by a try whose COMMIT reply was lost
                continue
            if got == AttemptOutcome.LEASE_LOST:
                log.warning("effect %s: lease lost before its outcome was recorded "
                            "(fenced)", o.effect_id)
            if (o.ordered and self.on_unblocked is not None
                    and got != AttemptOutcome.LEASE_LOST
                    and o.next_status == EffectStatus.DELIVERED):
                unblocked = True
            counted[(o.kind, o.queue, got)] = counted.get((o.kind, o.queue, got), 0) + 1
        # One add per (kind, queue, outcome), not per outcome.
        for (kind, queue, got), n in counted.items():
            deliveries.add(n, {"kind": kind, "queue": queue, "outcome": got, **self.labels})
        if unblocked and self.on_unblocked is not None:
            self.on_unblocked()
        return recorded

    def _record(self, batch: list[Outcome]) -> dict[int, str]:
        def write() -> dict[int, str]:
            with self.conn() as conn:
                return sql.record_outcomes(conn, batch, self.worker_id, now=self.clock())

        return retried(write)

    # -- background writing while a loop runs ------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="outbox-complete")
        self._thread.start()

    def kick(self) -> None:
        """Ask the background writer to flush (no-op without one)."""
        if self._thread is not None:
            self._kick.set()

    def _run(self) -> None:
        while True:
            self._kick.wait()
            self._kick.clear()
            deadline = time.monotonic() + LINGER
            while len(self.pending) < self.target and not self._stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._full.wait(left)
                self._full.clear()
            if self.pending:
                try:
                    self.flush(final=self._stopping and self._final)
                except Exception:  # never let the writer die: the loop flushes at its end
                    log.exception("outcome writer failed")
                if self.on_written is not None:  # a written head frees its key's next
                    self.on_written()
            if self._stopping:
                return

    def stop(self, *, final: bool = True) -> None:
        """Stop the background writer after it wrote what it had, then flush the rest.

        `final=False` (a loop that ends while its Dispatcher lives on: a Celery drain):
        what a lost connection kept is kept for the next loop."""
        thread = self._thread
        self._final = final
        if thread is not None:
            self._stopping = True
            self._kick.set()
            thread.join()
            self._thread = None
        # The database just failed to take what is kept: another try here would only
        # add db_retry's budget (10 s after a first failed try) to a shutdown (reviewed:
        # 30-50 s with the database down).
        if final or self._kept_since is None:
            self.flush(final=final)
