"""The executor: runs one claimed effect and returns a typed `Outcome`.

It holds no connection and no transaction while a handler runs, and never writes: the
completer records what it returns. Every failure, BaseExceptions too, is classified
by the retry policy; an awaitable result is awaited on the dispatcher's one event
loop (see `Executor.await_result`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import inspect
import json
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from concurrent.futures import Future
from datetime import datetime, timedelta
from typing import Any, Generic, TypeVar

from opentelemetry import propagate, trace
from opentelemetry.trace import Status, StatusCode

from dispatcher import _clock
from dispatcher.handlers import KEY_RETENTION_SHARE, EffectContext, Registration, Registry
from dispatcher.policy import Decision, RetryPolicy
from outbox._crash import crashpoint
from outbox._idempotency import Clock
from outbox._redact import exception_attributes, redact_secrets
from outbox._schema import AttemptOutcome, EffectStatus
from outbox._telemetry import (
    DELIVER,
    delivery_duration,
    delivery_lag,
    error_type,
    messaging_attributes,
    process_duration,
    span_name,
    tracer,
    tracing_enabled,
)
from outbox.errors import (
    AmbiguousOutcome,
    DeliveryError,
    FirstAttemptTooLate,
    KeyRetentionPassed,
    TransientFailure,
)
from outbox.sql.dispatch import Claimed, Outcome

_log = logging.getLogger("outbox.dispatcher")
T = TypeVar("T")

_DELIVERED = AttemptOutcome.DELIVERED
# A first attempt not made (FirstAttemptTooLate, _past_key_retention): due again at
# once, the attempt not counted, its first contact cleared.
_NOT_SENT = Decision(AttemptOutcome.RETRY, EffectStatus.PENDING)
_ST_DELIVERED = EffectStatus.DELIVERED



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


Attempt = Generator[tuple[Awaitable[Any], float], Any, Outcome]


def _first_step(flow: Attempt) -> Outcome | tuple[Awaitable[Any], float]:
    """Run an attempt up to the handler's awaitable (and its deadline), or to its end."""
    try:
        return next(flow)
    except StopIteration as done:
        outcome: Outcome = done.value
        return outcome


def _last_step(flow: Attempt, *, value: Any = None,
               exc: BaseException | None = None) -> Outcome:
    """Hand the awaited result (or its error) back to the attempt; it ends there (a
    handler returns one awaitable)."""
    try:
        if exc is not None:
            flow.throw(exc)
        else:
            flow.send(value)
    except StopIteration as done:
        outcome: Outcome = done.value
        return outcome
    raise RuntimeError("an attempt awaits one handler result")


def _settle(done: Callable[[Claimed, Outcome | BaseException], None], row: Claimed,
            task: asyncio.Task[Outcome]) -> None:
    """Hand an `aexecute` task's end to the dispatcher (on the loop thread)."""
    if task.cancelled():
        done(row, asyncio.CancelledError())
    elif (exc := task.exception()) is not None:
        done(row, exc)
    else:
        done(row, task.result())


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


class SlotPool(Generic[T]):
    """`size` delivery threads, started as needed, that call `run(item)` per item.

    No Future per task and no wake-up per task. A claim's rows go in with one
    `put_many`, which wakes one parked thread; a thread that takes an item while more
    wait wakes one more, unless a wake-up is already under way. With slow handlers
    (HTTP) the threads join one after another until each row has one (a wake-up is
    some tens of microseconds); with fast ones a few threads take the whole claim. One
    thread woken per row, as a queue wakes its getters, made every row of a claim a
    thread switch and a fight for the GIL, a fifth of the loop's time at 100 slots.
    `run` must not raise (the dispatcher classifies every failure); what escapes is
    logged and the thread carries on.
    """

    def __init__(self, size: int, name: str, run: Callable[[T], None]) -> None:
        self._size = size
        self._name = name
        self._run = run
        self._tasks: collections.deque[T] = collections.deque()
        self._parked: list[threading.Lock] = []  # idle threads, each held on its lock
        self._lock = threading.Lock()
        self._threads = 0
        self._waking = False  # a thread was woken (or started) and has not looked yet
        self._closed = False

    def put_many(self, items: Sequence[T]) -> None:
        with self._lock:
            if self._closed:
                return
            self._tasks.extend(items)
            self._wake_locked()

    def _wake_locked(self) -> None:
        if self._waking or not self._tasks:
            return
        if self._parked:
            self._waking = True
            self._parked.pop().release()
        elif self._threads < self._size:
            self._waking = True
            self._threads += 1
            try:
                threading.Thread(target=self._work, daemon=True,
                                 name=f"{self._name}_{self._threads}").start()
            except RuntimeError:  # can't start new thread: the running ones carry on
                self._waking = False
                self._threads -= 1
                _log.exception("could not start a delivery thread")

    def _work(self) -> None:
        park = threading.Lock()
        park.acquire()
        woken = True
        lock, tasks, run = self._lock, self._tasks, self._run
        while True:
            with lock:
                if woken:
                    self._waking = False
                    woken = False
                if self._closed:
                    self._threads -= 1
                    return
                if tasks:
                    item = tasks.popleft()
                    self._wake_locked()  # more waiting: one more thread
                else:
                    self._parked.append(park)
                    item = None
            if item is None:
                park.acquire()
                woken = True
                continue
            try:
                run(item)
            except BaseException:  # the dispatcher's `run` classifies; never die here
                _log.exception("delivery thread: unexpected error")

    def shutdown(self) -> list[T]:
        """Drop the items not started (returned); threads end after their current one."""
        with self._lock:
            self._closed = True
            dropped = list(self._tasks)
            self._tasks.clear()
            parked, self._parked = self._parked, []
        for park in parked:
            park.release()
        return dropped


class Executor:
    """Runs one effect (`execute`), and says what an attempt that did not return a
    result ends in (`crashed`, `released`)."""

    def __init__(self, registry: Registry, policy: RetryPolicy, clock: Clock,
                 lease: float, queue: str, *,
                 labels: Mapping[str, str] | None = None) -> None:
        """`labels`: added to every metric this records (`db` in `outbox worker`)."""
        self.registry = registry
        self.labels = dict(labels or {})
        self.policy = policy
        self.clock = clock
        self.lease = lease
        self._lease = timedelta(seconds=lease)  # what db_now takes off a lease's end
        self.queue = queue
        # The event loop of async handlers: started on the first awaitable a handler
        # returns (see await_result), stopped by stop().
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._loop_lock = threading.Lock()
        self._loop_closed = False
        self._awaiting: set[Future[Any]] = set()  # results pool threads wait for
        self._on_loop: dict[str, tuple[Any, bool]] = {}  # kind -> (registration, async?)
        self._label_cache: dict[tuple[str, str],
                                tuple[dict[str, str], dict[str, str], dict[str, str]]] = {}

    def _labels(self, kind: str, queue: str
                ) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
        """A delivery's metric attributes (all, a delivered one's, the process
        duration's), made once per (kind, queue): per delivery they were three dicts."""
        got = self._label_cache.get((kind, queue))
        if got is None:
            labels = {"kind": kind, "queue": queue, **self.labels}
            got = (labels, {**labels, "outcome": "delivered"},
                   {**messaging_attributes("process", DELIVER, queue), **self.labels})
            if len(self._label_cache) < 1000:  # kinds and queues are few; never unbounded
                self._label_cache[(kind, queue)] = got
        return got

    def deadline(self, started: float) -> float:
        """The attempt's deadline (dispatcher._clock): the handler must have returned by
        then, and its lease is never extended beyond it (plus a margin)."""
        return started + self.lease * 0.8

    def handler_deadline(self, started: float) -> float:
        """`deadline(started)` on time.monotonic(), the clock a handler is held to
        (EffectContext.deadline, asyncio's timeouts) and its lease extended by."""
        return _clock.to_monotonic(self.deadline(started))

    def execute(self, row: Claimed, started: float) -> Outcome:
        """Run the handler for one claimed row (on a pool thread; no DB connection).

        A handler's awaitable is awaited on the dispatcher's event loop while this
        thread waits (`await_result`).
        """
        flow = self._attempt(row, started)
        step = _first_step(flow)
        if isinstance(step, Outcome):
            return step
        try:
            value = self.await_result(*step)
        except BaseException as exc:
            return _last_step(flow, exc=exc)
        return _last_step(flow, value=value)

    async def aexecute(self, row: Claimed, started: float) -> Outcome:
        """`execute` for an async handler, as a task of the dispatcher's event loop:
        no pool thread waits for it (one thread hand-off less per delivery)."""
        flow = self._attempt(row, started)
        step = _first_step(flow)
        if isinstance(step, Outcome):
            return step
        try:
            value = await _until_deadline(*step)
        except BaseException as exc:  # cancelled at stop() too: released then
            return _last_step(flow, exc=exc)
        return _last_step(flow, value=value)

    def runs_on_loop(self, kind: str) -> bool:
        """Whether `kind`'s handler is async (a coroutine function, or an object whose
        `__call__` is one): its deliveries run as tasks of the event loop."""
        registration = self.registry.get(kind)
        if registration is None:
            return False
        # Asked once per claimed row: the answer is kept per registration (a kind
        # registered again gets a new one, and is inspected again).
        known = self._on_loop.get(kind)
        if known is not None and known[0] is registration:
            return known[1]
        handler = registration.handler
        call = type(handler).__call__ if not inspect.isroutine(handler) else None
        on_loop = inspect.iscoroutinefunction(handler) or inspect.iscoroutinefunction(call)
        self._on_loop[kind] = (registration, on_loop)
        return on_loop

    def submit_async_many(self, rows: Sequence[Claimed], started: float,
                          done: Callable[[Claimed, Outcome | BaseException], None]
                          ) -> None:
        """Start `aexecute` for each row on the event loop; `done(row, outcome or
        error)` is called once per row, as a pool thread would. One hand-off to the loop
        thread (one wake-up of the loop) per claim, not per effect: per effect it cost
        a no-op async handler ~30 µs of CPU more than the thread pool."""
        with self._loop_lock:
            if self._loop_closed:
                for row in rows:
                    done(row, RuntimeError("the dispatcher was shut down: not delivered"))
                return
            loop = self._event_loop()

            def start() -> None:
                # Every row ends: a delivery that cannot start (the dispatcher stopping
                # meanwhile, a task that cannot be made) fails, so it is never left in
                # flight. A cancelled task's end is a CancelledError (`_settle`), which
                # the dispatcher handles as any other.
                for row in rows:
                    try:
                        if self._loop_closed:
                            raise RuntimeError("the dispatcher was shut down: not delivered")
                        task = loop.create_task(self.aexecute(row, started))
                    except Exception as exc:
                        done(row, exc)
                        continue
                    task.add_done_callback(functools.partial(_settle, done, row))

            loop.call_soon_threadsafe(start)

    def db_now(self, row: Claimed, started: float | None = None) -> datetime:
        """The database's time now, without asking it: the injected clock's, else the
        claim's (the lease's end, set by the database, less the lease) plus the time
        since the claim (`started`, dispatcher._clock: it counts a suspended host's
        sleep, as the database's clock does). A host whose wall clock is off (F32)
        still ends retries, keeps to a key retention and dates its attempts as the
        database would."""
        injected = self.clock()
        if injected is not None:
            return injected
        claimed = _claimed_at(row, self._lease)
        if started is None:
            return claimed
        return claimed + timedelta(seconds=max(0.0, _clock.now() - started))

    def _attempt(self, row: Claimed, started: float) -> Attempt:
        """One attempt, written once for both drivers: yields (awaitable, deadline)
        when the handler returns an awaitable, and receives its result (or the error,
        thrown in); returns the attempt's Outcome."""
        started_at = self.db_now(row, started)
        headers = row.headers if isinstance(row.headers, dict) else {}
        parent = propagate.extract(headers) if headers else None
        registration = self.registry.get(row.kind)
        labels, delivered_labels, process_labels = self._labels(row.kind, row.queue)
        # Parented to the enqueue span through the row's traceparent (the conventions
        # allow the creation context as parent when one message is processed). The
        # span's status is ours to set: a failed attempt is an ERROR with error.type.
        # With no SDK installed and no trace context on the row, the span would be the
        # invalid one anyway: skip building it (~6 µs of CPU per delivery). A row that
        # carries a context still gets its non-recording span: the handler's calls
        # propagate the request's trace, and the attempt keeps its trace id.
        span_cm: contextlib.AbstractContextManager[trace.Span]
        if parent is None and not tracing_enabled():
            span_cm = contextlib.nullcontext(trace.INVALID_SPAN)
        else:
            span_cm = tracer.start_as_current_span(
                span_name(DELIVER, row.queue), context=parent, kind=trace.SpanKind.CONSUMER,
                attributes={
                    **messaging_attributes("process", DELIVER, row.queue),
                    "messaging.message.id": str(row.id),
                    "outbox.effect_id": row.id, "outbox.effect_key": row.effect_key,
                    "outbox.attempt": row.attempts, "outbox.kind": row.kind})
        with span_cm as span:
            trace_id = format(span.get_span_context().trace_id, "032x")
            effect = EffectContext(
                id=row.id, key=row.effect_key, kind=row.kind, payload=row.payload,
                attempt=row.attempts, max_attempts=row.max_attempts,
                deadline=self.handler_deadline(started),
                created_at=row.created_at,
                ordering_key=row.ordering_key)
            t0 = time.perf_counter()
            refused: KeyRetentionPassed | None = None
            try:
                if registration is None:
                    raise TransientFailure(f"no handler registered for kind {row.kind!r}")
                if registration.key_retention is not None:
                    refused = _past_key_retention(row, registration, started_at,
                                                  self._lease)
                    if refused is not None:
                        raise refused
                result = registration.handler(effect)
                if inspect.isawaitable(result):  # never record a coroutine as delivered
                    result = yield result, effect.deadline
                crashpoint("after_deliver_before_record")
            # Every failure is classified by the policy, BaseExceptions too: a handler
            # raising SystemExit or KeyboardInterrupt used to skip it (and the cap).
            except BaseException as exc:
                duration = time.perf_counter() - t0
                # `retry_until` was set from the database clock (or the injected one):
                # compare it with the same clock, not with this host's wall time.
                # Not made only if it is our own refusal: never on a handler's word.
                unsent = exc is refused and isinstance(exc, FirstAttemptTooLate)
                decision = _NOT_SENT if unsent else self.policy.decide(
                    attempt=row.attempts, max_attempts=row.max_attempts, error=exc,
                    retry_safe=registration.retry_safe if registration else True,
                    retry_until=_retry_until(row, registration),
                    now=self.db_now(row, started))
                detail = exc.detail if isinstance(exc, DeliveryError) else None
                http_status = _http_status(
                    exc.http_status if isinstance(exc, DeliveryError) else None)
                span.set_attribute("outbox.outcome", decision.outcome)
                if http_status is not None:
                    span.set_attribute("http.response.status_code", http_status)
                span.record_exception(exc, attributes=exception_attributes(exc))
                failure = error_type(exc)
                span.set_attribute("error.type", failure)
                span.set_status(Status(StatusCode.ERROR, f"{decision.outcome}: {failure}"))
                delivery_duration.record(duration, {**labels, "outcome": decision.outcome})
                process_duration.record(duration, {**messaging_attributes(
                    "process", DELIVER, row.queue), "error.type": failure, **self.labels})
                return Outcome(
                    effect_id=row.id, lease_token=row.lease_token, attempt=row.attempts,
                    outcome=AttemptOutcome(decision.outcome),
                    next_status=EffectStatus(decision.next_status),
                    started_at=started_at, delay=decision.delay,
                    error=_db_text(redact_secrets(f"{type(exc).__name__}: {exc}")[:2000]),
                    result=_jsonb_text(detail) if detail is not None else None,
                    http_status=http_status, trace_id=trace_id, kind=row.kind,
                    queue=row.queue, ordered=row.ordering_key is not None, unsent=unsent)
            duration = time.perf_counter() - t0
            span.set_attribute("outbox.outcome", "delivered")
            delivery_duration.record(duration, delivered_labels)
            process_duration.record(duration, process_labels)
            delivery_lag.record(
                max(0.0, (self.db_now(row, started) - row.created_at)
                    .total_seconds()), labels)
            status = result.get("status") if isinstance(result, dict) else None
            return Outcome(
                effect_id=row.id, lease_token=row.lease_token, attempt=row.attempts,
                outcome=_DELIVERED, next_status=_ST_DELIVERED, started_at=started_at,
                result=_jsonb_text(result) if result is not None else None,
                http_status=_http_status(status), trace_id=trace_id, kind=row.kind,
                queue=row.queue, ordered=row.ordering_key is not None)

    def crashed(self, row: Claimed, exc: BaseException) -> Outcome:
        """The outcome when `execute` itself failed (a bug in a policy, say): retried
        with backoff, never stranded, but dead-lettered at the cap like any attempt."""
        now = self.db_now(row)  # the claim's time: a crash is recorded at once
        error = _db_text(redact_secrets(f"{type(exc).__name__}: {exc}")[:2000])
        if RetryPolicy.exhausted(attempt=row.attempts, max_attempts=row.max_attempts,
                                 retry_until=_retry_until(row, self.registry.get(row.kind)),
                                 now=now):
            return Outcome(
                effect_id=row.id, lease_token=row.lease_token, attempt=row.attempts,
                outcome=AttemptOutcome.FAILED, next_status=EffectStatus.FAILED,
                started_at=now, error=error, kind=row.kind, queue=row.queue,
            ordered=row.ordering_key is not None)
        return Outcome(
            effect_id=row.id, lease_token=row.lease_token, attempt=row.attempts,
            outcome=AttemptOutcome.RETRY, next_status=EffectStatus.PENDING,
            started_at=now, delay=min(60.0, 2.0 ** row.attempts), error=error,
            kind=row.kind, queue=row.queue,
            ordered=row.ordering_key is not None)

    def released(self, row: Claimed, started: float) -> Outcome:
        """The outcome of a delivery abandoned at shutdown: due again at once.

        The request may already have reached the receiver, so the attempt is ambiguous;
        a handler that declared it cannot be retried safely gets the effect parked for
        review (DESIGN.md section 5), as for any other ambiguous outcome, instead of a
        blind redelivery. The attempt counts: on the last allowed one (or past
        `retry_until`) the effect is dead-lettered, else every shutdown mid-delivery
        handed out one more attempt than the cap.
        """
        registration = self.registry.get(row.kind)
        safe = registration.retry_safe if registration else True
        now = self.db_now(row, started)
        began = now - timedelta(seconds=_clock.now() - started)
        error = "released: worker shut down mid-delivery"
        if not safe:
            outcome, next_status = AttemptOutcome.AMBIGUOUS, EffectStatus.NEEDS_REVIEW
        elif RetryPolicy.exhausted(attempt=row.attempts, max_attempts=row.max_attempts,
                                   retry_until=_retry_until(row, registration), now=now):
            outcome, next_status = AttemptOutcome.FAILED, EffectStatus.FAILED
            error += " on the last allowed attempt"
        else:
            outcome, next_status = AttemptOutcome.AMBIGUOUS, EffectStatus.PENDING
        return Outcome(
            effect_id=row.id, lease_token=row.lease_token, attempt=row.attempts,
            outcome=outcome, next_status=next_status, started_at=began, delay=0.0,
            error=error, kind=row.kind, queue=row.queue,
            ordered=row.ordering_key is not None)

    # -- async handlers ----------------------------------------------------------------

    def await_result(self, awaitable: Awaitable[Any], deadline: float) -> Any:
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
            with self._loop_lock:  # scheduled before stop() looks, or refused
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
            # Refused, or cancelled by stop() before it ran: close what never
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

    def stop(self) -> None:
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
            # Handlers that keep loop-bound resources (AsyncHttpHandler's session)
            # close them on the loop they were made on, before it stops.
            for registration in list(self.registry.handlers.values()):
                aclose = getattr(registration.handler, "aclose", None)
                if aclose is not None and inspect.iscoroutinefunction(aclose):
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(aclose(), 5)

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


def _claimed_at(row: Claimed, lease: timedelta) -> datetime:
    """When `row` was claimed, by the database's clock: its lease's end (set by the
    claim) less the lease."""
    return row.lease_expires_at - lease


def _first_contact(row: Claimed) -> datetime:
    """The earliest the receiver can have seen the row's key: its first claim (every
    claim returns it, since migration 0011; its creation for a `Claimed` made by hand)."""
    return row.first_claimed_at or row.created_at


def _retry_until(row: Claimed, registration: Registration | None) -> datetime | None:
    """When retries of `row` end: its own `retry_until`, or sooner if the receiver of its
    kind forgets keys (`Registry.register(..., key_retention=)`)."""
    if registration is None:
        return row.retry_until
    return registration.retry_until(_first_contact(row), row.retry_until)


def _past_key_retention(row: Claimed, registration: Registration, now: datetime,
                        lease: timedelta) -> KeyRetentionPassed | None:
    """The refusal of an attempt sent once the receiver may have forgotten the key (a
    retry due late, a lease rescued late, a bulk redrive): it would be a new request to
    the receiver, and if an earlier attempt was applied, the effect would be applied
    twice. None if the attempt is in time.

    The effect's first attempt gets here only if it starts more than a lease after its
    claim: its host was suspended (dispatcher/_clock.py counts that) or the process
    stalled. Nothing was sent then by us, and if our record lands, by nobody: another
    worker's claim would have taken the lease token that fences the record. So it is
    `FirstAttemptTooLate`, recorded as not made: not counted, and the next claim its
    first contact. Only where the horizon lies more than a lease after the claim: a
    retention too short for any attempt to start in time is parked, not handed back
    at once forever. Any other refusal is parked for the operator, who checks with the
    receiver, as the message says."""
    first = _first_contact(row)
    horizon = registration.retry_until(first, None)
    if horizon is None or now < horizon:
        return None
    claimed_at = _claimed_at(row, lease)
    # This claim set the first contact (its own now(); a µs apart at most, where
    # timedelta and make_interval round a half-µs lease differently).
    ours = row.first_claimed_at is not None \
        and abs(row.first_claimed_at - claimed_at) <= _ONE_MICROSECOND
    if row.attempts == 1 and ours:
        if horizon - claimed_at <= lease:
            return KeyRetentionPassed(
                f"not sent: {KEY_RETENTION_SHARE:.0%} of the key retention of kind "
                f"{row.kind!r} ({registration.key_retention:g} s) is shorter than the "
                f"lease ({lease.total_seconds():g} s), so a first attempt may not start "
                "in time; nothing was sent. Give the kind a longer key_retention (or "
                "the dispatcher a shorter lease), then `outbox retry` this effect by id")
        return FirstAttemptTooLate(
            f"not sent: the first attempt would reach the receiver "
            f"{(now - first).total_seconds():.0f} s after its claim (this host was "
            "suspended, or the process stalled, longer than the lease), past "
            f"{KEY_RETENTION_SHARE:.0%} of its key retention "
            f"({registration.key_retention:g} s); nothing was sent by this worker: "
            "due again as a first contact, unless another worker took it meanwhile")
    return KeyRetentionPassed(
        f"not sent: attempt {row.attempts} would reach the receiver "
        f"{(now - first).total_seconds():.0f} s after the effect's first attempt, "
        f"past {KEY_RETENTION_SHARE:.0%} of its key retention "
        f"({registration.key_retention:g} s): it may have forgotten the key and apply "
        "the effect again. An earlier attempt may have been applied: check with the "
        "receiver, then `outbox retry` this effect by id to send it anyway")


_ONE_MICROSECOND = timedelta(microseconds=1)
