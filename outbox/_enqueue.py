"""enqueue(): write outbox rows in the caller's transaction; never send anything.

`enqueue`/`enqueue_many` on sync handles, `aenqueue`/`aenqueue_many` on async ones: one
set of statements run through the driver seam (outbox/_driver.py).
"""

from __future__ import annotations

import contextlib
import json
import threading
import uuid
import weakref
from collections.abc import Callable, Container, Generator, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from sqlalchemy import event

from outbox._canonical import MAX_KEY_LENGTH, _check_strings, parse_idempotency_key
from outbox._config import DEFAULT_MAX_ATTEMPTS, NOTIFY_CHANNEL
from outbox._driver import Query, adrive, drive
from outbox._idempotency import Claim, Clock, Connectable, database_clock
from outbox._telemetry import (
    ENQUEUE,
    effects_enqueued,
    messaging_attributes,
    span_name,
    tracer,
    tracing_enabled,
)
from outbox.errors import EffectKeyConflict, InvalidIdempotencyKey, InvalidInput
from outbox.sql import effects as sql
from outbox.sql import keys as sql_keys

#: Where an enqueue ran: (host, port, database) of its connection, as a doorbell that
#: serves several databases needs it (None where the handle does not say).
Where = tuple[str, int, str]

_doorbells: list[Callable[..., None]] = []
_located: set[Callable[..., None]] = set()  # the bells called as bell(queue, where)
_doorbell_lock = threading.Lock()


def add_doorbell(ring: Callable[..., None], *, located: bool = False) -> None:
    """Call `ring(queue)` after a transaction that enqueued effects commits.

    The Celery runner registers one that sends a payload-less `drain` task. A lost or
    early ring loses nothing: the sweep finds every due row. Every enqueue also sends
    a transactional NOTIFY, which PostgreSQL delivers only on commit. `located`: call
    `ring(queue, where)` instead, `where` being the enqueue's (host, port, database), or
    None when its handle does not say (a runner serving several databases rings the
    one that has the rows).
    """
    with _doorbell_lock:
        if ring not in _doorbells:
            _doorbells.append(ring)
        if located:
            _located.add(ring)


def remove_doorbell(ring: Callable[..., None]) -> None:
    with _doorbell_lock:
        if ring in _doorbells:
            _doorbells.remove(ring)
        _located.discard(ring)


def _where(target: Any) -> Where | None:
    """(host, port, database) of the connection `target` enqueued on, if it says."""
    try:
        module = type(target).__module__
        if module.startswith("sqlalchemy"):
            from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession
            from sqlalchemy.orm import Session, scoped_session

            if isinstance(target, scoped_session):
                target = target()
            if isinstance(target, AsyncSession | AsyncConnection):
                target = target.sync_session if isinstance(target, AsyncSession) \
                    else target.sync_connection
            bind = target.get_bind() if isinstance(target, Session) else target
            url = bind.engine.url
            return ((url.host or "").lower(), url.port or 5432,
                    url.database or url.username or "")
        settings = getattr(target, "settings_dict", None)  # a Django connection
        if isinstance(settings, dict):
            return (str(settings.get("HOST") or "").lower(),
                    int(settings.get("PORT") or 5432), str(settings.get("NAME") or ""))
    except Exception:  # a handle we cannot read: the runner rings every database
        return None
    return None


@dataclass(frozen=True, slots=True)
class Effect:
    """One external effect to deliver after commit."""

    kind: str
    payload: Any
    key: str | None = None          # the receiver's Idempotency-Key; derived if None
    name: str | None = None         # stable name for deriving the key from a claim
    ordering_key: str | None = None  # FIFO, one in flight, per ordering key
    queue: str = "default"
    delay: float = 0.0               # seconds before the first attempt
    max_attempts: int = DEFAULT_MAX_ATTEMPTS
    retry_for: float | None = None   # stop retrying this many seconds after enqueue


@dataclass(frozen=True, slots=True)
class Enqueued:
    """The row for an effect: `inserted` False means it existed already (a no-op)."""

    id: int
    effect_key: str
    inserted: bool

    @property
    def result(self) -> str:
        return "inserted" if self.inserted else "duplicate"


def _is_header_token(value: object, limit: int) -> bool:
    """What a receiver's `parse_idempotency_key` reads back unchanged: printable ASCII
    (0x21-0x7E), no comma (a list), not quoted, 1-`limit` characters."""
    if not isinstance(value, str) or not 1 <= len(value) <= limit:
        return False
    try:
        return parse_idempotency_key(value) == value
    except InvalidIdempotencyKey:
        return False


def check_effect_key(key: object) -> None:
    """Refuse a key that cannot travel as the receiver's `Idempotency-Key` header.

    Checked at enqueue (a bad key is the caller's error, now) rather than found by the
    HTTP library at delivery: CR/LF was refused there as an ambiguous failure and
    retried 25 times, and non-ASCII raised.
    """
    if not _is_header_token(key, MAX_KEY_LENGTH):
        raise InvalidInput(
            f"an effect key is 1-{MAX_KEY_LENGTH} printable ASCII characters without "
            "spaces or commas (it is sent as the receiver's Idempotency-Key)")


def _validate(effect: Effect) -> None:
    # The kind starts every derived key (`kind:digest`), names a handler and labels
    # metrics: the same characters as a key.
    if not _is_header_token(effect.kind, 200):
        raise InvalidInput("an effect kind is 1-200 printable ASCII characters without "
                           "spaces or commas")
    if effect.max_attempts < 1:
        raise InvalidInput("max_attempts must be at least 1")
    if effect.delay < 0 or (effect.retry_for is not None and effect.retry_for <= 0):
        raise InvalidInput("delay must be >= 0 and retry_for > 0")
    if effect.key is not None:
        check_effect_key(effect.key)
    _check_strings(effect.payload)


def _identity(row: dict[str, Any]) -> tuple[Any, ...]:
    """What makes two enqueued rows the same effect (cf. effects.match_existing_effects)."""
    return (row["kind"], _canonical_json(row["payload"]), row["queue"], row["ordering_key"],
            row["max_attempts"])


def _canonical_json(text: str) -> str:
    """One spelling per JSON value (key order, spacing), to compare two payloads."""
    return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))


def _after_commit_hook(target: Any) -> tuple[Any, Callable[[Callable[..., None]], None]] | None:
    """(owner, register) for `target`'s after-commit hook; None where there is none.

    SQLAlchemy Session (and scoped/async forms): `after_commit`. A Core Connection has
    no after-commit event: it rings at `commit`, which may beat the COMMIT (the Celery
    drain looks again shortly, then the sweep). Django: `transaction.on_commit`. A bare
    psycopg connection has no hook: a documented no-op; the transactional NOTIFY still
    wakes LISTEN workers, and the Celery sweep finds the rows.
    """
    module = type(target).__module__
    if module.startswith("sqlalchemy"):
        from sqlalchemy import Connection
        from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_scoped_session
        from sqlalchemy.orm import Session, scoped_session

        if isinstance(target, scoped_session | async_scoped_session):
            target = target()
        if isinstance(target, AsyncSession):
            target = target.sync_session
        if isinstance(target, AsyncConnection):
            target = target.sync_connection
        if isinstance(target, Session):
            session = target
            return session, lambda ring: event.listen(session, "after_commit",
                                                      _at_the_commit(ring))
        if isinstance(target, Connection):
            conn = target
            return conn, lambda ring: event.listen(conn, "commit", ring)
        return None
    if module.startswith("django.") and hasattr(target, "on_commit"):
        # Django drops on_commit callbacks at rollback: no per-owner folding here (a
        # folded ring could be dropped with a rolled-back block), one ring per call.
        django_conn = target
        return None, lambda ring: django_conn.on_commit(ring)
    return None


# One pending ring per transaction owner: several enqueue calls in one transaction ring
# each queue once. Weak keys: a forgotten Session or Connection takes its entry along.
# Each owner gets ONE listener of ours for its life (`_listening`), not one per
# transaction: a `once=True` listener stays registered after it ran, so a long-lived
# Session grew one per committed transaction, and each commit called them all. A
# transaction rolled back leaves its entry; the owner's next commit rings it (a ring is
# a hint: a worker that finds nothing due goes back to sleep).
_pending: weakref.WeakKeyDictionary[Any, _Pending] = weakref.WeakKeyDictionary()
_listening: weakref.WeakSet[Any] = weakref.WeakSet()
_pending_lock = threading.Lock()


class _Pending:
    """The queues one transaction enqueued into, and where its rows went."""

    __slots__ = ("queues", "where")

    def __init__(self, queues: set[str]) -> None:
        self.queues = queues
        self.where: Where | None = None


def _ring_after_commit(target: Any, queues: set[str]) -> None:
    """Ring each queue once per transaction, however many enqueue calls it made."""
    if not _doorbells:
        return
    hook = _after_commit_hook(target)
    if hook is None:
        return
    owner, register = hook
    if owner is None:
        once, at = set(queues), _where(target) if _located else None
        register(lambda: _ring(once, at))
        return
    with _pending_lock:
        folded = _pending.get(owner)
        if folded is not None:
            folded.queues.update(queues)  # a ring is already set up for this transaction
            return
        pending = _pending[owner] = _Pending(set(queues))
        first = owner not in _listening
    # Where the rows go, once per transaction (not per enqueue call folded into it).
    if _located:
        pending.where = _where(target)
    if first:
        try:
            register(_rang)
        except BaseException:
            with _pending_lock:  # nothing will ring it: the next enqueue tries again
                if _pending.get(owner) is pending:
                    del _pending[owner]
            raise
        with _pending_lock:
            _listening.add(owner)


def _at_the_commit(ring: Callable[..., None]) -> Callable[..., None]:
    """A Session's `after_commit` listener calling `ring` at the COMMIT only: a Session
    fires it for a released savepoint too, which is not the COMMIT (rung then, a worker
    would find nothing yet). A Connection's `commit` event is always the COMMIT, even
    with a savepoint still open, so it needs no such filter."""
    def listener(session: Any, *_: Any) -> None:
        if not session.in_nested_transaction():
            ring(session)
    return listener


def _rang(owner: Any, *_: Any) -> None:
    """An owner's listener (its `after_commit` or `commit` event, which passes the
    owner first): ring what its transaction enqueued, if anything."""
    with _pending_lock:
        pending = _pending.pop(owner, None)
    if pending is not None:
        _ring(pending.queues, pending.where)


def rings_registered(owner: Any) -> int:
    """How many `commit` listeners of ours `owner` holds (0 or 1): the doorbell's, which
    runs no SQL (IdempotencyGuard may then still send its COMMIT early)."""
    with _pending_lock:
        return 1 if owner in _listening else 0


def _ring(queues: set[str], where: Where | None = None) -> None:
    for queue in sorted(queues):
        for bell in list(_doorbells):
            with contextlib.suppress(Exception):
                if bell in _located:
                    bell(queue, where)
                else:
                    bell(queue)


def _rows_for(batch: Sequence[Effect], claim: Claim | None, headers: str
              ) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Validate, derive keys, and fold same-key effects (refusing different ones)."""
    rows: list[dict[str, Any]] = []
    keys: list[str] = []
    for effect in batch:
        _validate(effect)
        if effect.key is not None:
            key = effect.key
        elif claim is not None:
            key = claim.effect_key(effect.kind, effect.name)
        else:
            key = f"{effect.kind[:200]}:{uuid.uuid4().hex}"
        keys.append(key)
        rows.append({
            "key": key,
            "kind": effect.kind,
            "payload": json.dumps(effect.payload, allow_nan=False, separators=(",", ":")),
            "headers": headers,
            "ordering_key": effect.ordering_key,
            "queue": effect.queue,
            "max_attempts": effect.max_attempts,
            "delay": float(effect.delay),
            "retry_for": effect.retry_for,
        })
    # Two effects with one key in a batch: the first wins, the rest are duplicates,
    # but only if they are the same effect.
    unique: dict[str, dict[str, Any]] = {}
    clashes: list[str] = []
    for row in rows:
        first = unique.setdefault(row["key"], row)
        if first is not row and _identity(first) != _identity(row):
            clashes.append(row["key"])
    if clashes:
        raise EffectKeyConflict(clashes)
    return keys, unique


def _insert(batch: Sequence[Effect], keys: list[str], unique: dict[str, dict[str, Any]],
            clock: Clock) -> Generator[Query[Any], Any, list[Enqueued]]:
    """The statements of one enqueue, once for sync and async (outbox/_driver.py)."""
    yield from _lock_ordering_keys(unique.values())
    now = clock()
    inserted: dict[str, int] = yield sql.insert_effects(
        list(unique.values()), NOTIFY_CHANNEL, now=now)
    existing, again = yield from _settle(unique, inserted, now)
    inserted.update(again)
    calls = [(key, effect.kind, effect.queue) for key, effect in zip(keys, batch, strict=True)]
    return [Enqueued(inserted.get(key) or existing[key][0], key, fresh)
            for (key, _, _), fresh in zip(calls, _counted(calls, inserted), strict=True)]


def _lock_ordering_keys(rows: Iterable[dict[str, Any]]) -> Generator[Query[Any], Any, None]:
    """Per-key FIFO needs ids in commit order: the producer lock of each ordering key the
    rows name, before their ids are drawn (see the statement)."""
    ordering_keys = [r["ordering_key"] for r in rows if r["ordering_key"]]
    if ordering_keys:
        yield sql.lock_ordering_keys(ordering_keys)


def _counted(calls: Sequence[tuple[str, str, str]], inserted: Container[str]) -> list[bool]:
    """Per call (key, kind, queue): whether it wrote its row (the first call of a key that
    was inserted) or was a duplicate; each counted in `outbox.effects.enqueued`."""
    fresh: list[bool] = []
    seen: set[str] = set()
    for key, kind, queue in calls:
        fresh.append(key in inserted and key not in seen)
        seen.add(key)
        effects_enqueued.add(1, {"kind": kind, "queue": queue,
                                 "result": "inserted" if fresh[-1] else "duplicate"})
    return fresh


def _settle(rows: dict[str, dict[str, Any]], inserted: Container[str], now: Any
            ) -> Generator[Query[Any], Any, tuple[dict[str, tuple[int, bool]], dict[str, int]]]:
    """The rows an insert did not write: their key exists. The same effect is a duplicate
    ({key: (id, True)}); another raises EffectKeyConflict; a key purged since our insert
    is inserted again ({key: id}, the second value)."""
    missing = [r for k, r in rows.items() if k not in inserted]
    if not missing:
        return {}, {}
    existing: dict[str, tuple[int, bool]] = yield sql.match_existing_effects(missing)
    conflicts = [k for k, (_, same) in existing.items() if not same]
    if conflicts:
        raise EffectKeyConflict(conflicts)
    gone = [r for r in missing if r["key"] not in existing]
    again: dict[str, int] = (
        (yield sql.insert_effects(gone, NOTIFY_CHANNEL, now=now)) if gone else {})
    return existing, again


def defer(claim: Claim, effects: Iterable[Effect]) -> list[str]:
    """`Claim.enqueue_many`: check and key the effects now, keep them for `complete()`.

    The enqueue span is made now, so the trace context in each row is the caller's, as
    with `enqueue`. An effect key the claim deferred already folds into the first, if
    it is the same effect (else EffectKeyConflict, now).
    """
    if claim._completed:
        raise RuntimeError("this claim is completed: an effect deferred now would never be "
                           "written (defer before complete(), or use enqueue())")
    batch: Sequence[Effect] = list(effects)
    if not batch:
        return []
    with _create_span(batch):
        keys, unique = _rows_for(batch, claim, _carrier())
    clashes = [k for k, row in unique.items()
               if k in claim._deferred and _identity(claim._deferred[k]) != _identity(row)]
    if clashes:
        raise EffectKeyConflict(clashes)
    for key, row in unique.items():
        claim._deferred.setdefault(key, row)
    claim._deferred_calls.extend(
        (key, effect.kind, effect.queue) for key, effect in zip(keys, batch, strict=True))
    return keys


def write_deferred(claim: Claim, write: Query[Any], *, commit: bool = False
                   ) -> Generator[Query[Any], Any, sql_keys.Completed]:
    """The key's completing `write` carrying the claim's deferred effects (`commit`:
    and the transaction's COMMIT, for the plain case only: `sql_keys.then_commit`).

    Effects are written only with the key. A key that
    existed already is a duplicate if it is the same effect, else EffectKeyConflict
    (the transaction must roll back: complete() raises).
    """
    rows = list(claim._deferred.values())
    yield from _lock_ordering_keys(rows)
    carrying = sql_keys.with_effects(write, rows, NOTIFY_CHANNEL)
    done: sql_keys.Completed = yield sql_keys.then_commit(carrying) if commit else carrying
    if not done.key_write.written:
        return done
    inserted = set(done.inserted)
    _, again = yield from _settle(claim._deferred, inserted, None)  # the database's clock
    inserted.update(again)
    _counted(claim._deferred_calls, inserted)
    return done


# Only the W3C trace context rides in an effect row. The global propagator also
# injects `baggage`, which a client may set to anything (`user.email=...`): stored, it
# would sit in every effect row and travel to every receiver.
_TRACE_CONTEXT = TraceContextTextMapPropagator()


def _carrier() -> str:
    carrier: dict[str, str] = {}
    _TRACE_CONTEXT.inject(carrier)
    return json.dumps({k: v for k, v in carrier.items() if k in ("traceparent", "tracestate")})


def _create_span(batch: Sequence[Effect]) -> AbstractContextManager[trace.Span]:
    """The PRODUCER span of one enqueue call (messaging `create`: the rows are sent
    later, by a dispatcher): `enqueue <queue>`, or `enqueue` across several queues.

    With no SDK installed the API's span would carry the current context unchanged, so
    the current span stands in for it (the rows carry the same trace context) and its
    attributes are not built (~9 µs an enqueue)."""
    if not tracing_enabled():
        return contextlib.nullcontext(trace.get_current_span())
    queues = {e.queue for e in batch}
    queue = next(iter(queues)) if len(queues) == 1 else None
    attributes: dict[str, str | int] = {**messaging_attributes("create", ENQUEUE, queue),
                                        "outbox.effects": len(batch)}
    if len(batch) > 1:
        attributes["messaging.batch.message_count"] = len(batch)
    return tracer.start_as_current_span(span_name(ENQUEUE, queue),
                                        kind=trace.SpanKind.PRODUCER, attributes=attributes)


def _created(span: trace.Span, results: Sequence[Enqueued]) -> None:
    if len(results) == 1:
        span.set_attribute("messaging.message.id", str(results[0].id))


def enqueue_many(target: Connectable, effects: Iterable[Effect], *,
                 claim: Claim | None = None, clock: Clock = database_clock
                 ) -> list[Enqueued]:
    """Insert effects in the caller's transaction, in one statement; never commits.

    `target`: any handle of the driver seam (psycopg Connection, SQLAlchemy
    Connection/Session/scoped_session, Django's connection); `aenqueue_many` takes the
    async ones. Keys: the effect's own `key`, else derived from `claim` (stable across
    retries of the request), else random. A key already present with the same kind and
    payload is a no-op, reported as such; with another kind or payload it raises
    EffectKeyConflict (never a silent drop of the new effect). The current trace
    context rides in each row so delivery continues the trace.
    """
    batch: Sequence[Effect] = list(effects)
    if not batch:
        return []
    with _create_span(batch) as span:
        keys, unique = _rows_for(batch, claim, _carrier())
        results: list[Enqueued] = drive(target, _insert(batch, keys, unique, clock))
        _ring_after_commit(target, {e.queue for e in batch})
        _created(span, results)
        return results


async def aenqueue_many(target: Connectable, effects: Iterable[Effect], *,
                        claim: Claim | None = None, clock: Clock = database_clock
                        ) -> list[Enqueued]:
    """`enqueue_many` on an async handle: psycopg AsyncConnection, SQLAlchemy
    AsyncConnection / AsyncSession / async_scoped_session."""
    batch: Sequence[Effect] = list(effects)
    if not batch:
        return []
    with _create_span(batch) as span:
        keys, unique = _rows_for(batch, claim, _carrier())
        results: list[Enqueued] = await adrive(target, _insert(batch, keys, unique, clock))
        _ring_after_commit(target, {e.queue for e in batch})
        _created(span, results)
        return results


def enqueue(target: Connectable, kind: str, payload: Any, *, claim: Claim | None = None,
            key: str | None = None, name: str | None = None, ordering_key: str | None = None,
            queue: str = "default", delay: float = 0.0,
            max_attempts: int = DEFAULT_MAX_ATTEMPTS, retry_for: float | None = None,
            clock: Clock = database_clock) -> Enqueued:
    """Enqueue one effect in the caller's transaction; see `enqueue_many`."""
    effect = Effect(kind, payload, key=key, name=name, ordering_key=ordering_key,
                    queue=queue, delay=delay, max_attempts=max_attempts, retry_for=retry_for)
    return enqueue_many(target, [effect], claim=claim, clock=clock)[0]


async def aenqueue(target: Connectable, kind: str, payload: Any, *,
                   claim: Claim | None = None, key: str | None = None,
                   name: str | None = None, ordering_key: str | None = None,
                   queue: str = "default", delay: float = 0.0,
                   max_attempts: int = DEFAULT_MAX_ATTEMPTS, retry_for: float | None = None,
                   clock: Clock = database_clock) -> Enqueued:
    """Enqueue one effect on an async handle; see `enqueue_many`."""
    effect = Effect(kind, payload, key=key, name=name, ordering_key=ordering_key,
                    queue=queue, delay=delay, max_attempts=max_attempts, retry_for=retry_for)
    return (await aenqueue_many(target, [effect], claim=claim, clock=clock))[0]
