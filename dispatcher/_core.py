"""The delivery loop shared by `outbox worker` and the Celery `drain` task.

River's shape, in three parts and one loop:

* the producer (`dispatcher/producer.py`) claims only as many rows as there are free
  slots, one autocommitted statement, rows as typed `Claimed` values;
* the executor (`dispatcher/executor.py`) runs one effect on a pool thread, holding no
  connection or transaction, and returns a typed `Outcome` (statuses are the schema's
  `EffectStatus`/`AttemptOutcome`);
* the completer (`dispatcher/completer.py`) owns the batched, fenced writes: while a
  loop runs it records on its own thread and connection, so a slot frees when its
  handler returns, and the next claim overlaps the last record.

`Dispatcher._loop` is the only loop: `drain`, `run` and `shutdown` are its modes. Two
collections under one lock: the deliveries in flight and (in the completer) the
outcomes not yet written; a delivery leaves the first and enters the second in one step.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from sqlalchemy import Engine
from sqlalchemy.exc import DBAPIError

from dispatcher import _clock
from dispatcher.completer import Completer, Stats
from dispatcher.executor import Executor, SlotPool, _db_text, _jsonb_text
from dispatcher.handlers import Registry
from dispatcher.policy import RetryPolicy
from dispatcher.producer import FULL_SCAN_EVERY, Producer, backend_pid, db_retry
from dispatcher.watch import Watch
from outbox._crash import crashpoint
from outbox._idempotency import Clock, database_clock
from outbox.sql import dispatch as sql
from outbox.sql.dispatch import Claimed, Outcome

log = logging.getLogger("outbox.dispatcher")

__all__ = ["Claimed", "Dispatcher", "Outcome", "SlotShare", "Stats", "default_worker_id"]

# Kept importable under their old names.
_db_retry = db_retry
_backend_pid = backend_pid
_ = (_db_text, _jsonb_text)

# A lease is extended no further than its attempt's deadline plus this (seconds).
DEADLINE_MARGIN = 1.0
# Short claims while busy: below half the batch free, wait this long for more slots.
CLAIM_COOLDOWN = 0.02


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class SlotShare(Protocol):
    """Delivery slots shared with other dispatchers (`outbox worker --database` x N:
    dispatcher/fleet.py). `acquire` grants at most `want` slots for one claim;
    `settle` returns the grant once the claimed rows are in flight (`got` of them);
    `release` says a delivery left flight (a slot is free: ring whoever waits)."""

    def acquire(self, want: int) -> int: ...

    def settle(self, granted: int, got: int) -> None: ...

    def release(self) -> None: ...


@dataclass(slots=True)
class _InFlight:
    row: Claimed
    started: float           # _clock.now() at the claim (counts a suspend)
    # The attempt's deadline on time.monotonic(), the clock the handler is held to
    # (EffectContext.deadline): a suspend during the attempt moves it later in real
    # time, and the lease must still cover it.
    deadline: float
    extended_at: float = 0.0


class Dispatcher:
    """Claims due effects and delivers them with at most `concurrency` in flight."""

    def __init__(
        self,
        engine: Engine,
        registry: Registry,
        *,
        queue: str = "default",
        concurrency: int = 8,
        lease: float = 30.0,
        worker_id: str | None = None,
        policy: RetryPolicy | None = None,
        clock: Clock = database_clock,
        max_batch: int = 100,
        full_scan_every: float = FULL_SCAN_EVERY,
        metric_labels: Mapping[str, str] | None = None,
        slots: SlotShare | None = None,
    ) -> None:
        """`full_scan_every`: under a saturated backlog, claim without the producer's
        watermark at least this often (seconds; default FULL_SCAN_EVERY, 2 s): the
        bound on how long a row that commits behind the watermark waits (0: no
        watermark, every claim scans from the head). See dispatcher/producer.py.

        `metric_labels` are added to the delivery metrics (`outbox worker` adds `db`);
        `slots`: a share of a process-wide slot budget (dispatcher/fleet.py): each
        claim then takes at most what the share grants, on top of `concurrency`."""
        if concurrency < 1 or lease <= 0:
            raise ValueError("concurrency must be >= 1 and lease > 0")
        self.engine = engine
        self.registry = registry
        self.queue = queue
        self.concurrency = concurrency
        self.lease = lease
        self.worker_id = worker_id or default_worker_id()
        self.policy = policy or RetryPolicy()
        self.clock = clock
        self.max_batch = max_batch
        self.stats = Stats()
        self.wake = threading.Event()  # a doorbell: NOTIFY, a freed slot, a written outcome
        self.producer = Producer(engine, queue=queue, worker_id=self.worker_id,
                                 lease=lease, clock=clock, full_scan_every=full_scan_every)
        self.slots = slots
        self.executor = Executor(registry, self.policy, clock, lease, queue,
                                 labels=metric_labels)
        self.completer = Completer(engine, worker_id=self.worker_id, clock=clock,
                                   stats=self.stats, target=min(concurrency, max_batch),
                                   labels=metric_labels, keep_for=lease)
        self.completer.on_written = self.wake.set
        self.completer.on_unblocked = self.producer.rescan
        self._denied = False  # the fleet's budget granted no slot at the last fill
        # Set by `run_worker` (a worker a NOTIFY wakes): while busy it keeps watch over
        # the queue and enqueuers skip the NOTIFY (dispatcher/watch.py).
        self.watch: Watch | None = None
        self._pool: SlotPool[tuple[Claimed, float]] = SlotPool(
            concurrency, "outbox-deliver", self._run_one)
        self._lock = threading.Lock()
        self._inflight: dict[int, _InFlight] = {}
        self._last_extend = _clock.now()
        self._last_claim = 0.0
        # The last claim raised (its database down or unreachable): under a shared slot
        # budget, ask for one slot until a claim succeeds again, so a claim stuck in its
        # reconnect retries does not hold this database's whole share from the others.
        self._claim_failed = False
        # Claim when at least this many slots are free (or after CLAIM_COOLDOWN): one
        # claim per freed slot would cost a round trip per effect.
        self._claim_min = max(1, math.ceil(min(concurrency, max_batch) / 2))
        # Outcomes written behind the handlers: at most this many waiting.
        self._backlog_max = 4 * min(concurrency, max_batch) + concurrency

    # -- the three parts -----------------------------------------------------------------

    def _claim(self, limit: int) -> list[Claimed]:
        return self.producer.claim(limit)

    def _deliver(self, row: Claimed, started: float) -> Outcome:
        """Run the handler for one claimed row (on a pool thread; no DB connection)."""
        return self.executor.execute(row, started)

    def _ours(self, row: Claimed) -> bool:
        """`row` is still in flight under this claim's lease (not released meanwhile)."""
        item = self._inflight.get(row.id)
        return item is not None and item.row.lease_token == row.lease_token

    def _run_one(self, task: tuple[Claimed, float]) -> None:
        """A pool thread's whole job for one row: deliver it, hand the outcome over."""
        row, started = task
        if not self._ours(row):
            return  # released at shutdown before it started: not delivered at all
        result: Outcome | BaseException
        try:
            result = self._deliver(row, started)
        except BaseException as exc:
            result = exc
        self._finished(row, result)

    def _finished(self, row: Claimed, result: Outcome | BaseException) -> None:
        """A delivery's outcome leaves `_inflight` for the completer in one step.

        One that is no longer in flight under its lease (released at shutdown) is
        dropped: recording it too would double the attempt.
        """
        if isinstance(result, BaseException):
            log.error("delivery of effect %s crashed", row.id, exc_info=result)
            outcome = self.executor.crashed(row, result)
        else:
            outcome = result
        with self._lock:
            if not self._ours(row):
                return
            del self._inflight[row.id]
            self.completer.add(outcome)
            # Ring the loop when a claim is worth it (enough slots free) or the last
            # delivery ended, not per delivery: each ring is a wake-up of the loop.
            left = len(self._inflight)
            ring = left == 0 or self.concurrency - left == self._claim_min
        if ring:
            self.wake.set()
        if self.slots is not None:
            self.slots.release()

    @property
    def _done(self) -> list[Outcome]:
        """Outcomes finished and not yet written (the completer's queue)."""
        return self.completer.pending

    def flush(self) -> dict[int, str]:
        """Record every finished attempt in one statement (fenced by lease token)."""
        return self.completer.flush()

    def extend_leases(self, force: bool = False) -> None:
        """Extend, in one statement, leases of deliveries running for lease/3 or more.

        Only while the attempt's deadline has not passed, and never beyond it (plus
        DEADLINE_MARGIN): a handler past its deadline is not kept leased.
        """
        now, awake = _clock.now(), time.monotonic()
        if not force and now - self._last_extend < self.lease / 3:
            return
        self._last_extend = now
        with self._lock:
            due = [f for f in self._inflight.values()
                   if now - max(f.started, f.extended_at) >= self.lease / 3
                   and awake < f.deadline]
        if not due:
            return
        leases = [(f.row.id, f.row.lease_token) for f in due]
        caps = [min(self.lease, f.deadline - awake + DEADLINE_MARGIN) for f in due]
        try:
            with self.producer.conn() as conn:
                kept = sql.extend_leases(conn, leases, self.lease, now=self.clock(),
                                         caps=caps)
        except DBAPIError:
            log.exception("could not extend %d leases", len(leases))
            return
        for f in due:
            if f.row.id in kept:
                f.extended_at = now
            else:
                log.warning("effect %s: lease lost while delivering", f.row.id)

    # -- the steps of the loop ---------------------------------------------------------

    def _fill_or_back_off(self) -> int | None:
        """`fill()`, but a database error (after db_retry gave up) returns None.

        An outage longer than the retry budget used to propagate out of run() and end
        the worker process (F25/F26): log it and let the caller try again later; the
        in-flight deliveries keep going and are recorded when the database is back.
        """
        try:
            return self.fill()
        except DBAPIError:
            log.exception("could not claim effects; retrying after the poll interval")
            return None

    def _free(self) -> int:
        room = self._backlog_max - self.completer.backlog
        return min(self.concurrency - len(self._inflight), self.max_batch, room)

    def fill(self) -> int:
        """Claim up to the free slots and start delivering; returns rows claimed."""
        free = self._free()
        if free <= 0:
            return 0
        if self.slots is None:
            return self._start(free)
        granted = self.slots.acquire(1 if self._claim_failed else free)
        self._denied = granted <= 0  # the budget rings this member when it frees some
        if granted <= 0:
            return 0
        got = 0
        self._claim_failed = True  # until this claim returns
        try:
            got = self._start(granted)
            self._claim_failed = False
        finally:
            self.slots.settle(granted, got)
        return got

    def _start(self, free: int) -> int:
        """Claim up to `free` rows and hand them to the slot pool."""
        self._last_claim = time.monotonic()
        rows = self._claim(free)
        if rows:
            crashpoint("after_claim")
        self.stats.claimed += len(rows)
        now = _clock.now()
        deadline = self.executor.handler_deadline(now)
        items = [_InFlight(row, now, deadline) for row in rows]
        with self._lock:  # one acquisition per claim, before any delivery can end
            for item in items:
                self._inflight[item.row.id] = item
        # An async handler's delivery is a task of the event loop (no pool thread waits
        # for it), all of a claim's started in one hand-off; a sync one runs on a pool
        # thread, all of a claim's handed over in one step too.
        runs_on_loop = self.executor.runs_on_loop
        on_loop: list[Claimed] = []
        on_threads: list[tuple[Claimed, float]] = []
        for row in rows:  # one pass: each row goes one way, whatever re-registers meanwhile
            if runs_on_loop(row.kind):
                on_loop.append(row)
            else:
                on_threads.append((row, now))
        if on_loop:
            self.executor.submit_async_many(on_loop, now, self._finished)
        if on_threads:
            self._pool.put_many(on_threads)
        return len(rows)

    def reap(self) -> int:
        """Record finished deliveries' outcomes now; returns how many were queued."""
        n = len(self.completer.pending)
        self.flush()
        return n

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def _want_claim(self, now: float) -> bool:
        free = self._free()
        return free >= self._claim_min or (free > 0 and now - self._last_claim >= CLAIM_COOLDOWN)

    # -- the loop ------------------------------------------------------------------------

    def _loop(self, *, claim_until: float, stop: threading.Event | None = None,
              poll_interval: float | None = None, finish_until: float = math.inf,
              on_tick: Callable[[], None] | None = None) -> bool:
        """The one loop: claim, wait, hand outcomes to the completer, extend leases.

        Modes: `poll_interval=None` (drain, shutdown): claim back to back while
        `now < claim_until`, and return once nothing is in flight and the last claim
        found nothing (or claiming is over); a failed claim ends claiming. With a
        `poll_interval` (run): claim when rung (`wake`: NOTIFY or a freed slot) or
        every `poll_interval` after an empty claim, until `stop` is set. Either way it
        returns at `finish_until` with whatever is still in flight.

        Returns True when claiming stopped at `claim_until` (more may be due).
        """
        draining = poll_interval is None
        # Only a loop a NOTIFY would wake keeps watch (not a drain, not a shutdown).
        watch = None if draining else self.watch
        last_empty: float | None = None
        rung = claim_failed = out_of_time = False
        # With one slot, one thing at a time: the outcome is written before the next
        # claim, and no connection is checked out while the handler runs (F12). With
        # more, the completer writes on its own thread, behind the handlers.
        background = self.concurrency > 1
        # With more than one slot, the claims and the writes each keep a pooled
        # connection while the loop runs (idle between statements: never in a
        # transaction while a handler runs); with one, nothing is held across a call.
        if background:
            self.producer.conn.holding(True)
            self.completer.conn.holding(True)
            self.completer.start()
        try:
            while True:
                if stop is not None and stop.is_set():
                    return out_of_time
                if self.completer.pending:
                    if background:
                        self.completer.kick()
                    else:
                        self.flush()
                now = time.monotonic()
                out_of_time = now >= claim_until
                # Take the doorbell off `wake` at once and remember it: left set while
                # every slot was busy, the wait below returned at once, a busy loop.
                if self.wake.is_set():
                    self.wake.clear()
                    rung = True
                claimed = 0
                tried = False
                # Outcomes not yet written hold their ordering keys' successors back: an
                # empty claim then does not mean nothing is due.
                unwritten = self.completer.backlog
                watched = False
                if watch is not None:
                    watched = watch.due(now)
                    if watched and not watch.watching:
                        # A claim owed at the watch's end: the rows of the transactions
                        # it listed may sit behind the watermark (ids taken before they
                        # committed).
                        self.producer.rescan()
                if not out_of_time and not claim_failed and self._want_claim(now) and (
                        draining or rung or watched or last_empty is None
                        or now - last_empty >= (poll_interval or 0.0)):
                    rung = False
                    tried = True
                    claims = self.producer.claims
                    got = self._fill_or_back_off()
                    # Draining, a database that is unreachable ends claiming: finish
                    # what is in flight (the sweep rings again later).
                    claim_failed = draining and got is None
                    claimed = got or 0
                    if claimed == 0:
                        last_empty = time.monotonic()
                    if watch is not None and self.producer.claims != claims:
                        watch.after_claim(claimed, self.producer.short, time.monotonic())
                    elif watch is not None and got is None:
                        watch.claim_failed()
                if draining:
                    # Under the lock `_finished` hands an outcome over with: a delivery
                    # that ended after `unwritten` was read is not written yet either.
                    with self._lock:
                        idle = not self._inflight
                        unwritten = unwritten or self.completer.backlog
                    if idle and (out_of_time or claim_failed
                                 or (tried and claimed == 0 and not unwritten)):
                        return out_of_time
                if time.monotonic() >= finish_until:
                    return out_of_time
                if claimed == 0 or len(self._inflight) >= self.concurrency:
                    if draining:
                        timeout = 0.05
                    elif self._inflight:
                        timeout = min(poll_interval or 0.25, 0.25)
                    else:
                        timeout = poll_interval or 0.25
                    # A freed slot rings anyway, and so does the fleet's budget when
                    # it had none to grant.
                    cap = None if watch is None or self._free() <= 0 or self._denied \
                        else watch.timeout(time.monotonic())
                    if cap is not None:
                        timeout = min(timeout, cap)
                    self.wake.wait(min(timeout, max(0.0, finish_until - time.monotonic())))
                if background and self.completer.pending:
                    self.completer.kick()
                self.extend_leases()
                if on_tick is not None:
                    on_tick()
        finally:
            if watch is not None:
                watch.close()  # claiming is over: enqueuers ring again
            try:
                # Not final: a Dispatcher outlives its loop (a Celery drain, then the
                # next); `shutdown` is the final write.
                self.completer.stop(final=False)
            finally:
                self.completer.conn.holding(False)
                self.producer.conn.holding(False)

    def drain(self, budget: float = 10.0) -> bool:
        """Deliver until nothing is due or `budget` seconds pass.

        Returns True when the budget ran out (more may be due: chain another drain).
        """
        return self._loop(claim_until=time.monotonic() + budget)

    def run(self, stop: threading.Event, *, poll_interval: float = 1.0,
            grace: float = 10.0, on_tick: Callable[[], None] | None = None) -> None:
        """Loop until `stop` is set; then stop claiming and shut down gracefully."""
        self._loop(claim_until=math.inf, stop=stop, poll_interval=poll_interval,
                   on_tick=on_tick)
        self.shutdown(grace)

    def shutdown(self, grace: float = 10.0) -> None:
        """Finish in-flight deliveries within `grace` seconds, release the rest."""
        if self._inflight:
            self._loop(claim_until=-math.inf, finish_until=time.monotonic() + grace)
        # Rows not started yet never will be: dropped from the pool before the release
        # (and a thread that took one just before looks again: `_run_one`).
        self._pool.shutdown()
        with self._lock:
            # A delivery that finished meanwhile already left `_inflight` with its real
            # outcome; the rest are released, and their late outcomes dropped.
            release = list(self._inflight.values())
            self._inflight.clear()
            for item in release:
                self.completer.add(self.executor.released(item.row, item.started))
        if release:
            log.warning("released %d in-flight effects at shutdown", len(release))
            if self.slots is not None:
                self.slots.release()
        self.completer.flush(final=True)  # the last write: nothing is kept past it
        self.executor.stop()
