"""The producer: claims only as many effects as the dispatcher has free slots.

A claim is one autocommitted statement (no BEGIN or COMMIT round trip). The rescue
of expired leases rides along only when it can matter (the last claim came up short,
or a second passed): issue 17, off the hot path. Its scan walks effects_in_flight_idx,
which keeps an entry for every row claimed while the xmin horizon is held, so when a
claim with the rescue grows slow the rescue is spaced out too: it takes at most
FULL_SCAN_SHARE of the time (a dead worker's leases are then rescued a little later).

The fresh scan resumes from a watermark (issue 17): the `(available_at, id)` of the
last pending row this producer claimed, so that a claim does not step, from the head
of the pending index, over the entries of every row claimed since the xmin horizon
(dead, and not removable while some transaction holds the horizon back). Rows can
appear behind the watermark (an enqueue commits after later rows were claimed, a row
another claim held locked is released, an ordering key's successor is unblocked), so
the producer claims without a watermark (a full scan, from the head):

* whenever its last claim came up short: it has caught up, and the next claim looks
  at the whole queue (cheap when the queue is short); at once, in the same call, when
  a claim past the watermark found nothing (an empty claim ends a drain);
* at the next claim after this worker recorded the delivery of an effect with an
  ordering key (`rescan`): its successor is claimable now, behind the watermark;
* at least every `full_scan_every` seconds (FULL_SCAN_EVERY, 2 s, by default) under a
  saturated backlog, where every claim is full. When full scans themselves get slow
  (a long-held horizon) the period stretches so that they take at most
  FULL_SCAN_SHARE of the time, up to MAX_SPACING (60 s): a row behind the watermark
  waits at most the longer of `full_scan_every` and 1/FULL_SCAN_SHARE times one full
  scan, never more than MAX_SPACING.

`full_scan_every=0` turns the watermark off (every claim a full scan: the claim before
issue 17); `math.inf` leaves only the catch-up full scans (a negative control in the
tests, not a setting for production).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import psycopg
from psycopg.pq import TransactionStatus
from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError
from tenacity import retry, retry_if_exception_type, stop_after_delay, wait_exponential

from outbox._driver import SyncDB, dbapi_error
from outbox._idempotency import Clock
from outbox.sql import dispatch as sql
from outbox.sql.dispatch import ClaimBatch, Claimed, Watermark

log = logging.getLogger("outbox.dispatcher")
R = TypeVar("R")

# Reconnect-and-retry for the loop's own short transactions (F25): a terminated
# backend or a restarting server must not kill the worker. If a write keeps failing
# the lease expires and the effect is redelivered with the same key.
db_retry = retry(
    retry=retry_if_exception_type(DBAPIError),
    stop=stop_after_delay(10),
    wait=wait_exponential(multiplier=0.05, max=2),
    reraise=True,
)


def retried(fn: Callable[[], R]) -> R:
    """`fn()`, and after a DBAPIError again under `db_retry`. The first try runs bare:
    tenacity's per-call setup (a copy of the Retrying and its state) cost the loop a
    few percent of its time on the path where nothing fails. The retry budget counts
    from the first retry: a silent connection adds its call timeout to it."""
    try:
        return fn()
    except DBAPIError:
        log.debug("retrying after a database error", exc_info=True)
    return db_retry(fn)()


# Under a saturated backlog (every claim full), expired leases are looked for at least
# this often (seconds); otherwise on every claim that came up short.
RESCUE_EVERY = 1.0
# Under a saturated backlog, a claim without the watermark (a full scan) at least this
# often (seconds), and full scans (and rescues) at most this share of the time (see the
# docstring).
FULL_SCAN_EVERY = 2.0
FULL_SCAN_SHARE = 0.05
# ... but never spaced out further than this (seconds): one outlier (an I/O stall) must
# not postpone the rescue of a dead worker's leases, or the look behind the watermark,
# by minutes.
MAX_SPACING = 60.0


def spaced(took: float, floor: float) -> float:
    """The wait before the next slow scan: at most FULL_SCAN_SHARE of the time, at
    least `floor`, at most MAX_SPACING."""
    return min(max(floor, took / FULL_SCAN_SHARE), max(floor, MAX_SPACING))


def backend_pid(conn: Any) -> int | None:
    """The server process behind a connection (SQLAlchemy's, or a held one's SyncDB),
    known to psycopg without a round trip (None for a driver that does not say)."""
    try:
        if isinstance(conn, SyncDB):
            pid = conn.conn.info.backend_pid
        else:
            pid = conn.connection.dbapi_connection.info.backend_pid
    except AttributeError:
        return None
    return pid if isinstance(pid, int) and pid > 0 else None


# A held connection idle longer than this (seconds) goes back to the pool first.
HOLD_IDLE = 1.0


class HeldConnection:
    """AUTOCOMMIT pooled connections for the loop's own statements.

    Each statement is its own transaction (autocommit: no BEGIN/COMMIT round trips), so
    no transaction is ever open while a handler runs (I7; F12 in tests/test_faults.py
    audits it). While `holding(True)`, one pooled connection is kept between statements
    (idle, in no transaction): a checkout and return through SQLAlchemy's pool
    per statement cost ~0.2 ms of CPU, 15 % of a 10-row claim. Without it (one slot:
    nothing may even hold a pooled connection while the handler runs) each statement
    checks one out and gives it back; so does a held one idle for HOLD_IDLE. The
    `outbox worker` engine has no pre-ping, so a checkout costs no round trip. An error
    that broke the connection invalidates it, so `db_retry`'s next try gets a fresh one.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine.execution_options(isolation_level="AUTOCOMMIT")
        self._pool_engine = engine
        self.hold = False             # set by `holding` while a loop runs
        self._lock = threading.Lock()
        self._held: Any = None        # the pool's proxy of the held connection
        self._db: SyncDB | None = None
        self._used = 0.0              # time.monotonic() at the end of its last statement

    @contextlib.contextmanager
    def __call__(self) -> Iterator[Any]:
        if not self.hold and self._db is None:
            with self._checkout() as conn:
                yield conn
            return
        with self._lock:
            now = time.monotonic()
            if self._db is not None and now - self._used > HOLD_IDLE:
                # Idle a while: back through the pool, whose check at checkout finds a
                # connection that went silent meanwhile (docs/network.md).
                self._drop(invalidate=False)
            db = self._db or self._take()
            try:
                yield db
            except BaseException:
                # Broken, or left mid-statement or in a transaction (an exception raised
                # into a running statement: a Celery soft time limit): not reusable.
                if (db.conn.closed or db.conn.broken
                        or db.conn.info.transaction_status != TransactionStatus.IDLE):
                    self._drop(invalidate=True)
                raise
            finally:
                self._used = time.monotonic()

    @contextlib.contextmanager
    def _checkout(self) -> Iterator[Connection]:
        conn = self._engine.connect()
        try:
            yield conn
        except BaseException as exc:
            with contextlib.suppress(Exception):
                if isinstance(exc, DBAPIError) and exc.connection_invalidated:
                    conn.invalidate()
            raise
        finally:
            conn.close()

    def _take(self) -> SyncDB:
        try:
            held = self._pool_engine.raw_connection()
        except psycopg.Error as exc:  # unlike connect(), raw_connection() does not wrap
            raise dbapi_error(exc, invalidated=True) from exc
        raw = held.driver_connection
        if not isinstance(raw, psycopg.Connection):
            held.close()
            raise TypeError("outbox needs the psycopg 3 driver (postgresql+psycopg://)")
        try:
            raw.autocommit = True
        except psycopg.Error as exc:
            held.invalidate()
            raise dbapi_error(exc, invalidated=True) from exc
        self._held, self._db = held, SyncDB(raw, functools.partial(_wrap_error, raw))
        return self._db

    def _drop(self, *, invalidate: bool) -> None:
        held, self._held, self._db = self._held, None, None
        if held is None:
            return
        try:
            if invalidate:
                held.invalidate()
                return
            record = getattr(held, "_connection_record", None)
            held.driver_connection.autocommit = False  # as the pool's other users expect
            held.close()
            # Idle since its last statement, not since now: the pool's check at the next
            # checkout (`ping_when_idle`) must count the time it was held unused.
            if record is not None and "outbox_idle_since" in record.info:
                record.info["outbox_idle_since"] = self._used
        except Exception:
            with contextlib.suppress(Exception):
                held.invalidate()

    def holding(self, on: bool) -> None:
        """Hold a connection between statements from now on (a loop starts), or stop
        and give it back (it ended): `fill()`/`reap()` driven by hand hold none."""
        with self._lock:
            self.hold = on
            if not on:
                self._drop(invalidate=False)


def _wrap_error(raw: psycopg.Connection[Any], exc: Exception) -> Exception:
    """A held connection's psycopg error as the DBAPIError the callers catch."""
    return dbapi_error(exc, invalidated=bool(raw.closed or raw.broken))


class Producer:
    """Claims due effects of one queue for one worker, resuming from a watermark.

    `full_scan_every`: seconds between claims without the watermark under a saturated
    backlog (FULL_SCAN_EVERY); 0 disables the watermark. See the module docstring.
    """

    def __init__(self, engine: Engine, *, queue: str, worker_id: str, lease: float,
                 clock: Clock, full_scan_every: float = FULL_SCAN_EVERY) -> None:
        if not full_scan_every >= 0:  # NaN too
            raise ValueError("full_scan_every must be >= 0")
        self.conn = HeldConnection(engine)  # held while a loop runs (`holding`)
        self.queue = queue
        self.worker_id = worker_id
        self.lease = lease
        self.clock = clock
        self.full_scan_every = full_scan_every
        self._short = True  # the last claim took fewer rows than it asked for
        self.claims = 0  # claim calls that returned (the watch counts on it)
        self._last_rescue = 0.0
        self._rescue_took = 0.0  # seconds the last claim with the rescue took
        self._rescan = False  # look behind the watermark at the next claim (`rescan`)
        # Where the next fresh scan resumes (None: from the head: a full scan), and
        # when (time.monotonic()) a full scan is due even under a saturated backlog.
        self.watermark: Watermark | None = None
        self._next_full_scan = 0.0

    @property
    def short(self) -> bool:
        """The last claim took fewer rows than it asked for: all that was due."""
        return self._short

    def rescan(self) -> None:
        """Look behind the watermark at the next claim: an effect with an ordering key
        was delivered, so its successor (older than the watermark) is claimable now.
        Without it, under a saturated backlog a key advanced one effect per full scan.
        A flag, not `watermark = None`: a claim running now would set its own."""
        self._rescan = True

    def claim(self, limit: int) -> list[Claimed]:
        """Claim with one lease token for this call and every retry of it.

        The claim commits on its own (autocommit): when the reply is lost after the
        UPDATE committed, a blind retry claimed other rows while the first batch sat
        in flight, undelivered, for a whole lease, its attempt counted (and on the
        last allowed attempt the sweep dead-lettered an effect never delivered). So a
        retry first takes back the rows holding this call's token.
        """
        now = time.monotonic()
        slow = spaced(self._rescue_took, 0.0)
        if slow > RESCUE_EVERY:  # rescues got slow (a held horizon): spaced out
            rescue = now - self._last_rescue >= slow
        else:
            rescue = self._short or now - self._last_rescue >= RESCUE_EVERY
        if rescue:
            self._last_rescue = now
        rescan, self._rescan = self._rescan, False
        full = (rescan or self.watermark is None or self.full_scan_every <= 0
                or now >= self._next_full_scan)
        batch, took = self._claim_once(limit, rescue=rescue,
                                       after=None if full else self.watermark)
        if rescue:
            self._rescue_took = took
        if not full and not batch.rows:
            # Nothing past the watermark: look behind it at once, not at the next claim
            # (an empty claim ends a drain). Once per catching up: the next claims are
            # full scans until a batch is full again.
            full, now = True, time.monotonic()
            batch, took = self._claim_once(limit, rescue=False, after=None)
        if full:
            self._next_full_scan = now + spaced(took, self.full_scan_every)
        rows = batch.rows
        self._short = len(rows) < limit
        self.claims += 1
        if self._short or self.full_scan_every <= 0:
            self.watermark = None  # caught up: the next claim scans the whole queue
        elif batch.watermark is not None:
            self.watermark = batch.watermark
        # else a full batch of rescued rows (or rows taken back after a lost reply):
        # the watermark stays (any watermark is safe: the full scans cover behind it).
        return rows

    def _claim_once(self, limit: int, *, rescue: bool, after: Watermark | None
                    ) -> tuple[ClaimBatch, float]:
        """One claim statement, retried (`db_retry`) under one lease token; returns
        the batch and the seconds it took (0.0 when it was retried: not a measure)."""
        token = uuid.uuid4()
        pids: list[int] = []  # backends of earlier tries
        tries = [0]
        t0 = time.monotonic()

        def attempt() -> ClaimBatch:
            tries[0] += 1
            return self._claim_try(limit, token, pids, retry=tries[0] > 1, rescue=rescue,
                                   after=after)

        batch = retried(attempt)
        return batch, (time.monotonic() - t0 if tries[0] == 1 else 0.0)

    def _claim_try(self, limit: int, token: uuid.UUID, pids: list[int], *,
                   retry: bool, rescue: bool, after: Watermark | None) -> ClaimBatch:
        """One try of `claim`: on the normal path the claim alone (one round trip)."""
        with self.conn() as conn:
            if retry:
                self._await_backends(conn, pids)
                mine = sql.claimed_with(conn, queue=self.queue, token=token)
                if mine:
                    log.warning("claim retried after a lost reply: took back %d rows "
                                "already claimed by the first try", len(mine))
                    return ClaimBatch(mine, None)
            pid = backend_pid(conn)
            if pid is not None:
                pids.append(pid)
            return sql.claim_batch(conn, queue=self.queue, limit=limit,
                                   owner=self.worker_id, lease_seconds=self.lease,
                                   now=self.clock(), token=token, rescue=rescue,
                                   after=after)

    def _await_backends(self, conn: Any, pids: list[int]) -> None:
        """Wait until the earlier tries' backends run nothing: a claim whose client
        connection broke may still be executing, and `claimed_with` could only see its
        rows once it committed. Bounded (lease/3, at most 10 s) so that the loop keeps
        extending the leases of its deliveries; past it, its rows wait for a rescue, as
        do those of a claim that had not reached its backend yet when we looked.
        """
        deadline = time.monotonic() + min(10.0, self.lease / 3)
        while sql.backends_busy(conn, pids):
            if time.monotonic() >= deadline:
                log.warning("an earlier try of this claim is still running on backend(s) "
                            "%s; its rows will be rescued after their lease", pids)
                return
            time.sleep(0.02)
