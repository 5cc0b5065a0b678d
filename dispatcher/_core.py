"""The delivery loop shared by `outbox worker` and the Celery `drain` task.

claim (one short transaction, at most the free slots) -> deliver on a thread pool,
holding no connection or transaction -> record outcomes in one fenced statement per
batch. Leases of long deliveries are extended in one statement per worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import os
import re
import signal
import socket
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from opentelemetry import propagate, trace
from sqlalchemy import Engine, Row
from sqlalchemy.exc import DBAPIError
from tenacity import retry, retry_if_exception_type, stop_after_delay, wait_exponential

from dispatcher.handlers import EffectContext, Registry
from dispatcher.policy import RetryPolicy
from outbox._idempotency import Clock, database_clock
from outbox._telemetry import deliveries, delivery_duration, delivery_lag, tracer
from outbox.errors import AmbiguousOutcome, DeliveryError, TransientFailure
from outbox.sql import dispatch as sql

log = logging.getLogger("outbox.dispatcher")


def _crashpoint(name: str) -> None:
    """Test hook (H3): `OUTBOX_CRASH_AT=name` SIGKILLs this process at that point."""
    points = os.environ.get("OUTBOX_CRASH_AT")
    if points and name in points.split(","):
        os.kill(os.getpid(), signal.SIGKILL)


# What a handler or receiver hands us is stored by the batch's one record statement:
# a value PostgreSQL refuses (NUL in text, \u0000 or a lone surrogate in jsonb, NaN,
# an int4 overflow) failed the whole batch, dropping every outcome in it, and a lone
# surrogate raised UnicodeEncodeError (no DBAPIError) out of flush(), ending the loop.
_NUL_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")


def _db_text(value: str) -> str:
    """Text PostgreSQL accepts: no NUL, no lone surrogates."""
    return value.replace("\x00", "\ufffd").encode("utf-8", "replace").decode("utf-8")


def _jsonb_text(value: Any) -> str:
    """JSON text that `CAST(... AS jsonb)` accepts, whatever `value` holds."""
    try:
        out = json.dumps(value, default=str, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError):  # NaN, non-string keys, cycles: keep a summary
        out = json.dumps(repr(value)[:2000], ensure_ascii=False)
    return _NUL_ESCAPE.sub(r"\1\\ufffd", _db_text(out))


def _http_status(value: object) -> int | None:
    return value if isinstance(value, int) and 100 <= value <= 999 else None


def default_worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


# Reconnect-and-retry for the loop's own short transactions (F25): a terminated
# backend or a restarting server must not kill the worker. If a write keeps failing
# the lease expires and the effect is redelivered with the same key.
_db_retry = retry(
    retry=retry_if_exception_type(DBAPIError),
    stop=stop_after_delay(10),
    wait=wait_exponential(multiplier=0.05, max=2),
    reraise=True,
)


def _backend_pid(conn: Any) -> int | None:
    """The server process behind a SQLAlchemy connection, known to psycopg without a
    round trip (None for a driver that does not say)."""
    try:
        pid = conn.connection.dbapi_connection.info.backend_pid
    except AttributeError:
        return None
    return pid if isinstance(pid, int) and pid > 0 else None


async def _until_deadline(awaitable: Awaitable[Any], deadline: float) -> Any:
    """Await a handler's result, cancelled at `deadline` (time.monotonic(), which is
    the loop's clock). Cut there, the request may have gone out: ambiguous."""
    limit = asyncio.timeout_at(deadline)
    try:
        async with limit:
            return await awaitable
    except TimeoutError:
        if limit.expired():
            raise AmbiguousOutcome("async handler still running at its deadline; "
                                   "cancelled") from None
        raise


@dataclass(slots=True)
class _InFlight:
    row: Row[Any]
    started: float
    future: Future[sql.Outcome] | None = None
    extended_at: float = 0.0


@dataclass(slots=True)
class Stats:
    claimed: int = 0
    recorded: dict[str, int] = field(default_factory=dict)
    lease_lost: int = 0

    def add(self, recorded: dict[int, str]) -> None:
        for outcome in recorded.values():
            self.recorded[outcome] = self.recorded.get(outcome, 0) + 1
            if outcome == "lease_lost":
                self.lease_lost += 1


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
    ) -> None:
        if concurrency < 1 or lease <= 0:
            raise ValueError("concurrency must be >= 1 and lease > 0")
        self.engine = engine
        # Claim, record and extend are one statement each: autocommit makes each its own
        # transaction without the BEGIN and COMMIT round trips (same atomicity, fewer waits).
        self._autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
        self.registry = registry
        self.queue = queue
        self.concurrency = concurrency
        self.lease = lease
        self.worker_id = worker_id or default_worker_id()
        self.policy = policy or RetryPolicy()
        self.clock = clock
        self.max_batch = max_batch
        self.stats = Stats()
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="outbox-deliver")
        self._inflight: dict[int, _InFlight] = {}
        self._done: list[sql.Outcome] = []
        self._done_lock = threading.Lock()
        self._released: set[int] = set()  # released at shutdown: drop late outcomes
        # Leases (id, token) whose outcome `_finished` has queued (not ids alone: a
        # rescue of our own expired lease puts the same id in flight again; not tokens
        # alone: the rows of one claim share its token). `Future.done()` turns true
        # before the done-callbacks run, so reaping on done() could forget a delivery
        # whose outcome was not queued yet: shutdown (or the end of a drain) then
        # returned without recording it, and the delivered effect was redelivered
        # after its lease.
        self._reported: set[tuple[int, uuid.UUID]] = set()
        self.wake = threading.Event()
        self._last_extend = time.monotonic()
        # The event loop of async handlers: started on the first awaitable a handler
        # returns (see _await), stopped by shutdown().
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._loop_lock = threading.Lock()
        self._loop_closed = False
        self._awaiting: set[Future[Any]] = set()  # results pool threads wait for

    # -- database steps ----------------------------------------------------------------

    def _claim(self, limit: int) -> list[Row[Any]]:
        """Claim with one lease token for this call and every retry of it.

        The claim commits on its own (autocommit): when the reply is lost after the
        UPDATE committed, a blind retry claimed other rows while the first batch sat
        in flight, undelivered, for a whole lease, its attempt counted (and on the
        last allowed attempt the sweep dead-lettered an effect never delivered). So a
        retry first takes back the rows holding this call's token.
        """
        token = uuid.uuid4()
        pids: list[int] = []  # backends of earlier tries
        tries = [0]

        @_db_retry
        def attempt() -> list[Row[Any]]:
            tries[0] += 1
            return self._claim_try(limit, token, pids, retry=tries[0] > 1)

        return attempt()

    def _claim_try(self, limit: int, token: uuid.UUID, pids: list[int], *,
                   retry: bool) -> list[Row[Any]]:
        """One try of `_claim`: on the normal path the claim alone (one round trip)."""
        with self._autocommit.connect() as conn:
            if retry:
                self._await_backends(conn, pids)
                mine = sql.claimed_with(conn, queue=self.queue, token=token)
                if mine:
                    log.warning("claim retried after a lost reply: took back %d rows "
                                "already claimed by the first try", len(mine))
                    return mine
            pid = _backend_pid(conn)
            if pid is not None:
                pids.append(pid)
            return sql.claim_due(conn, queue=self.queue, limit=limit, owner=self.worker_id,
                                 lease_seconds=self.lease, now=self.clock(), token=token)

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

    def flush(self) -> dict[int, str]:
        """Record every finished attempt in one statement (fenced by lease token)."""
        with self._done_lock:
            batch, self._done = self._done, []
        if not batch:
            return {}
        try:
            recorded = self._record(batch)
        except DBAPIError:
            log.exception("could not record %d outcomes; their leases will expire and "
                          "the effects will be redelivered with the same keys", len(batch))
            return {}
        self.stats.add(recorded)
        for o in batch:
            got = recorded.get(o.effect_id)
            if got is None:  # recorded by a try whose COMMIT reply was lost
                continue
            if got == "lease_lost":
                log.warning("effect %s: lease lost before its outcome was recorded "
                            "(fenced)", o.effect_id)
            deliveries.add(1, {"outcome": got})
        return recorded

    @_db_retry
    def _record(self, batch: list[sql.Outcome]) -> dict[int, str]:
        with self._autocommit.connect() as conn:
            return sql.record_outcomes(conn, batch, self.worker_id, now=self.clock())

    def extend_leases(self, force: bool = False) -> None:
        """Extend, in one statement, leases of deliveries running for lease/3 or more."""
        now = time.monotonic()
        if not force and now - self._last_extend < self.lease / 3:
            return
        self._last_extend = now
        due = [f for f in self._inflight.values()
               if now - max(f.started, f.extended_at) >= self.lease / 3]
        if not due:
            return
        leases = [(f.row.id, f.row.lease_token) for f in due]
        try:
            with self._autocommit.connect() as conn:
                kept = sql.extend_leases(conn, leases, self.lease, now=self.clock())
        except DBAPIError:
            log.exception("could not extend %d leases", len(leases))
            return
        for f in due:
            if f.row.id in kept:
                f.extended_at = now
            else:
                log.warning("effect %s: lease lost while delivering", f.row.id)

    # -- delivery ----------------------------------------------------------------------

    def _deliver(self, row: Row[Any], started_monotonic: float) -> sql.Outcome:
        """Run the handler for one claimed row (on a pool thread; no DB connection)."""
        started_at = datetime.now(UTC)
        headers = row.headers if isinstance(row.headers, dict) else {}
        parent = propagate.extract(headers)
        registration = self.registry.get(row.kind)
        with tracer.start_as_current_span(
            f"outbox.deliver {row.kind}", context=parent, kind=trace.SpanKind.CONSUMER,
            attributes={"outbox.effect_id": row.id, "outbox.effect_key": row.effect_key,
                        "outbox.attempt": row.attempts, "outbox.kind": row.kind},
        ) as span:
            trace_id = format(span.get_span_context().trace_id, "032x")
            effect = EffectContext(
                id=row.id, key=row.effect_key, kind=row.kind, payload=row.payload,
                attempt=row.attempts, max_attempts=row.max_attempts,
                deadline=started_monotonic + self.lease * 0.8, created_at=row.created_at,
                ordering_key=row.ordering_key)
            t0 = time.perf_counter()
            try:
                if registration is None:
                    raise TransientFailure(f"no handler registered for kind {row.kind!r}")
                result = registration.handler(effect)
                if inspect.isawaitable(result):  # never record a coroutine as delivered
                    result = self._await(result, effect.deadline)
                _crashpoint("after_deliver_before_record")
            # Every failure is classified by the policy, BaseExceptions too: a handler
            # raising SystemExit or KeyboardInterrupt used to skip it (and the cap).
            except BaseException as exc:
                duration = time.perf_counter() - t0
                # `retry_until` was set from the database clock (or the injected one):
                # compare it with the same clock, not with this host's wall time.
                decision = self.policy.decide(
                    attempt=row.attempts, max_attempts=row.max_attempts, error=exc,
                    retry_safe=registration.retry_safe if registration else True,
                    retry_until=row.retry_until, now=self.clock() or datetime.now(UTC))
                detail = exc.detail if isinstance(exc, DeliveryError) else None
                http_status = _http_status(
                    exc.http_status if isinstance(exc, DeliveryError) else None)
                span.set_attribute("outbox.outcome", decision.outcome)
                if http_status is not None:
                    span.set_attribute("http.response.status_code", http_status)
                span.record_exception(exc)
                delivery_duration.record(duration, {"kind": row.kind,
                                                    "outcome": decision.outcome})
                return sql.Outcome(
                    effect_id=row.id, lease_token=row.lease_token, attempt=row.attempts,
                    outcome=decision.outcome, next_status=decision.next_status,
                    started_at=started_at, delay=decision.delay,
                    error=_db_text(f"{type(exc).__name__}: {exc}"[:2000]),
                    result=_jsonb_text(detail) if detail is not None else None,
                    http_status=http_status, trace_id=trace_id)
            duration = time.perf_counter() - t0
            span.set_attribute("outbox.outcome", "delivered")
            delivery_duration.record(duration, {"kind": row.kind, "outcome": "delivered"})
            delivery_lag.record(
                max(0.0, (datetime.now(UTC) - row.created_at).total_seconds()),
                {"kind": row.kind})
            status = result.get("status") if isinstance(result, dict) else None
            return sql.Outcome(
                effect_id=row.id, lease_token=row.lease_token, attempt=row.attempts,
                outcome="delivered", next_status="delivered", started_at=started_at,
                result=_jsonb_text(result) if result is not None else None,
                http_status=_http_status(status), trace_id=trace_id)

    def _await(self, awaitable: Awaitable[Any], deadline: float) -> Any:
        """Run an async handler's awaitable to completion (on a pool thread).

        One event loop per Dispatcher, on its own thread, rather than `asyncio.run` per
        delivery: a loop per call costs a loop's setup each time and, worse, breaks
        handlers that keep an async client (httpx.AsyncClient, a connection pool)
        across deliveries, since those are bound to the loop they were made on. The
        pool thread waits for the result, so `concurrency` still caps deliveries in
        flight, and the outcome is classified like a sync handler's. The deliver span
        stays current: the task copies this thread's context.
        """
        coro = _until_deadline(awaitable, deadline)
        try:
            with self._loop_lock:  # scheduled before shutdown() looks, or refused
                if self._loop_closed:
                    raise RuntimeError("the dispatcher was shut down: not delivered")
                future = asyncio.run_coroutine_threadsafe(coro, self._event_loop())
                self._awaiting.add(future)
            try:
                return future.result()
            finally:
                with self._loop_lock:
                    self._awaiting.discard(future)
        finally:
            # Refused, or cancelled by shutdown() before it ran: close what never
            # started (an unawaited coroutine warns when collected).
            for c in (coro, awaitable):
                if inspect.iscoroutine(c) \
                        and inspect.getcoroutinestate(c) == inspect.CORO_CREATED:
                    c.close()

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The loop, started on first use (call with `_loop_lock` held)."""
        if self._loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, daemon=True,
                                      name=f"outbox-async-{self.queue}")
            thread.start()
            self._loop, self._loop_thread = loop, thread
        return self._loop

    def _stop_event_loop(self) -> None:
        """Cancel async deliveries still running (released: their outcomes are
        dropped), let them unwind, and stop the loop's thread.

        The loop stops only after the cancelled tasks finished and handed their
        outcome to the waiting pool threads; stopped sooner, a pool thread waited
        forever (and the process could not exit: executor threads are joined).
        """
        with self._loop_lock:
            loop, thread = self._loop, self._loop_thread
            self._loop = self._loop_thread = None
            self._loop_closed = True
        if loop is None or thread is None:
            return

        async def cancel_all() -> None:
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=5)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        if thread.is_alive():  # a handler blocks the loop: leave the daemon thread
            return
        loop.close()
        with self._loop_lock:  # a task that ignored its cancellation: not delivered
            stranded, self._awaiting = self._awaiting, set()
        for future in stranded:
            if not future.done():
                future.set_exception(RuntimeError("the dispatcher was shut down"))

    def _crashed(self, row: Row[Any], exc: BaseException) -> sql.Outcome:
        """The outcome when `_deliver` itself failed (a bug in a policy, say): retried
        with backoff, never stranded, but dead-lettered at the cap like any attempt."""
        now = self.clock() or datetime.now(UTC)
        error = _db_text(f"{type(exc).__name__}: {exc}"[:2000])
        if RetryPolicy.exhausted(attempt=row.attempts, max_attempts=row.max_attempts,
                                 retry_until=row.retry_until, now=now):
            return sql.Outcome(
                effect_id=row.id, lease_token=row.lease_token, attempt=row.attempts,
                outcome="failed", next_status="failed", started_at=datetime.now(UTC),
                error=error)
        return sql.Outcome(
            effect_id=row.id, lease_token=row.lease_token, attempt=row.attempts,
            outcome="retry", next_status="pending", started_at=datetime.now(UTC),
            delay=min(60.0, 2.0 ** row.attempts), error=error)

    def _finished(self, row: Row[Any], future: Future[sql.Outcome]) -> None:
        try:
            outcome = future.result()
        except BaseException as exc:
            log.exception("delivery of effect %s crashed", row.id)
            outcome = self._crashed(row, exc)
        with self._done_lock:
            if row.id in self._released:
                return  # released at shutdown; recording this too would double the attempt
            self._done.append(outcome)
            self._reported.add((row.id, row.lease_token))
        self.wake.set()

    def _fill_or_back_off(self) -> int | None:
        """`fill()`, but a database error (after _db_retry gave up) returns None.

        An outage longer than the retry budget used to propagate out of run() and end
        the worker process (F25/F26): log it and let the caller try again later; the
        in-flight deliveries keep going and are recorded when the database is back.
        """
        try:
            return self.fill()
        except DBAPIError:
            log.exception("could not claim effects; retrying after the poll interval")
            return None

    def fill(self) -> int:
        """Claim up to the free slots and start delivering; returns rows claimed."""
        free = min(self.concurrency - len(self._inflight), self.max_batch)
        if free <= 0:
            return 0
        rows = self._claim(free)
        if rows:
            _crashpoint("after_claim")
        self.stats.claimed += len(rows)
        now = time.monotonic()
        for row in rows:
            item = _InFlight(row, now)
            self._inflight[row.id] = item
            item.future = self._pool.submit(self._deliver, row, now)
            item.future.add_done_callback(functools.partial(self._finished, row))
        return len(rows)

    def reap(self) -> int:
        """Forget finished deliveries and record their outcomes; returns how many."""
        with self._done_lock:  # only those whose outcome is queued (see _reported)
            finished = [i for i, f in self._inflight.items()
                        if (i, f.row.lease_token) in self._reported]
            self._reported.difference_update((i, self._inflight[i].row.lease_token)
                                             for i in finished)
        for i in finished:
            del self._inflight[i]
        self.flush()
        return len(finished)

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    # -- loops -------------------------------------------------------------------------

    def drain(self, budget: float = 10.0) -> bool:
        """Deliver until nothing is due or `budget` seconds pass.

        Returns True when the budget ran out (more may be due: chain another drain).
        """
        deadline = time.monotonic() + budget
        out_of_time = False
        claim_failed = False
        while True:
            out_of_time = time.monotonic() >= deadline
            claimed = 0
            if not out_of_time and not claim_failed:
                got = self._fill_or_back_off()
                # Database unreachable: stop claiming, finish what is in flight; the
                # sweep rings again later.
                claim_failed = got is None
                claimed = got or 0
            if not self._inflight and claimed == 0:
                break
            self.wake.wait(0.05)
            self.wake.clear()
            self.reap()
            self.extend_leases()
        self.flush()
        return out_of_time

    def run(self, stop: threading.Event, *, poll_interval: float = 1.0,
            grace: float = 10.0, on_tick: Callable[[], None] | None = None) -> None:
        """Loop until `stop` is set; then stop claiming and shut down gracefully."""
        last_claim_empty = 0.0
        rung = False
        while not stop.is_set():
            claimed = 0
            now = time.monotonic()
            # Take the doorbell (NOTIFY, or a finished delivery) off `wake` at once and
            # remember it: left set while every slot was busy, it made the wait below
            # return immediately, a busy loop burning a core until a slot freed up.
            if self.wake.is_set():
                self.wake.clear()
                rung = True
            if len(self._inflight) < self.concurrency and (
                    rung or now - last_claim_empty >= poll_interval
                    or last_claim_empty == 0.0):
                rung = False
                claimed = self._fill_or_back_off() or 0
                if claimed == 0:
                    last_claim_empty = time.monotonic()
            if claimed == 0 or len(self._inflight) >= self.concurrency:
                self.wake.wait(min(poll_interval, 0.25) if self._inflight else poll_interval)
            self.reap()
            self.extend_leases()
            if on_tick is not None:
                on_tick()
        self.shutdown(grace)

    def _release(self, item: _InFlight) -> sql.Outcome:
        """The outcome of a delivery abandoned at shutdown: due again at once.

        The request may already have reached the receiver, so the attempt is ambiguous;
        a handler that declared it cannot be retried safely gets the effect parked for
        review (DESIGN.md section 5), as for any other ambiguous outcome, instead of a
        blind redelivery. The attempt counts: on the last allowed one (or past
        `retry_until`) the effect is dead-lettered, else every shutdown mid-delivery
        handed out one more attempt than the cap.
        """
        row = item.row
        registration = self.registry.get(row.kind)
        safe = registration.retry_safe if registration else True
        started = datetime.now(UTC) - timedelta(seconds=time.monotonic() - item.started)
        error = "released: worker shut down mid-delivery"
        if not safe:
            outcome, next_status = "ambiguous", "needs_review"
        elif RetryPolicy.exhausted(attempt=row.attempts, max_attempts=row.max_attempts,
                                   retry_until=row.retry_until,
                                   now=self.clock() or datetime.now(UTC)):
            outcome, next_status = "failed", "failed"
            error += " on the last allowed attempt"
        else:
            outcome, next_status = "ambiguous", "pending"
        return sql.Outcome(
            effect_id=row.id, lease_token=row.lease_token, attempt=row.attempts,
            outcome=outcome, next_status=next_status, started_at=started, delay=0.0,
            error=error)

    def shutdown(self, grace: float = 10.0) -> None:
        """Finish in-flight deliveries within `grace` seconds, release the rest."""
        deadline = time.monotonic() + grace
        while self._inflight and time.monotonic() < deadline:
            self.wake.wait(0.05)
            self.wake.clear()
            self.reap()
            self.extend_leases()
        if self._inflight:
            with self._done_lock:
                # A delivery may have finished since the last reap: keep its real outcome
                # rather than also releasing it (two outcomes for one attempt). Those not
                # finished are released, and their late outcomes dropped in _finished.
                finished = {o.effect_id for o in self._done}
                release = [self._release(f) for f in self._inflight.values()
                           if f.row.id not in finished]
                self._released.update(o.effect_id for o in release)
                self._done.extend(release)
            log.warning("released %d in-flight effects at shutdown", len(release))
            self._inflight.clear()
        self.flush()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._stop_event_loop()
