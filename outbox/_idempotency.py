"""The idempotency guard: claim a key before any work, replay what it answered.

Two modes share one table (DESIGN.md §4):

* atomic (default): an advisory xact lock makes a twin fail fast with 409 (taken with
  the key's read in one call, `outbox.lock_and_read_key`), and the key row is written
  `completed` in the same transaction as the business rows, with the effects the work
  deferred to it (`Claim.enqueue`) in the same statement. One commit per request; a
  crash rolls everything back, so nothing is left to heal.
* phased: for handlers that must call out before they can answer. The claim commits
  first (twins see it), a TTL heals crashes, a takeover is a fenced conditional
  UPDATE, and completion only succeeds while our token still holds the key.

The protocol is written once, as generators that yield statements (`_begin`,
`_complete`, `_claim`, `_release`), and run by the driver seam on a sync handle
(`begin`, `complete`, ...) or an async one (`abegin`, `acomplete`, ...): the same
semantics on psycopg, every SQLAlchemy handle and Django (outbox/_driver.py).

The same business request under another key (issue 15): an application may declare
what makes two requests the same (`same_request=`, e.g. customer + amount + currency).
Its hash is stored with the key, and the statement that writes the key also counts the
other keys of the scope with that hash inside `same_request_window`: a client that
makes up a new key for every retry is reported (metric, span event, log line, and the
HTTP integration's opt-in header) and never refused or slowed by a round trip.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable, Iterator
from contextlib import AbstractContextManager, asynccontextmanager, contextmanager, nullcontext
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, NoReturn, TypeVar

import psycopg
from opentelemetry import trace
from tenacity import (
    AsyncRetrying,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from outbox import _driver
from outbox._config import DEFAULT_MAX_ATTEMPTS
from outbox._driver import AsyncDB, Query, SyncDB, adrive, async_db, drive, sync_db
from outbox._inflight import database_of, in_flight
from outbox._telemetry import idempotency_requests, suspected_duplicates
from outbox.errors import ClaimLost, KeyReused, RequestInProgress
from outbox.sql import keys as sql

Mode = Literal["atomic", "phased"]
Clock = Callable[[], datetime | None]
#: Maps a request's parsed body to its business identity (None: none to compare).
SameRequest = Callable[[Any], str | None]
#: How far back another key with the same business identity counts (10 minutes).
DEFAULT_SAME_REQUEST_WINDOW = 600.0

log = logging.getLogger("outbox.idempotency")
T = TypeVar("T")


def database_clock() -> datetime | None:
    """The default clock: None tells every statement to use the database's now()."""
    return None


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response exactly as first sent; replays return it byte for byte."""

    status: int
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""

    def header_list(self) -> list[list[str]]:
        return [[k, v] for k, v in self.headers]


@dataclass(slots=True)
class Claim:
    """We hold `key` in `scope`: run the work, then `complete()` in its transaction."""

    scope: str
    key: str
    fingerprint: str
    mode: Mode
    token: uuid.UUID
    taken_over: bool = False
    # The key record's generation: new when the record is created, kept by a take-over,
    # gone with a purge. None only for a record written before migration 0002.
    generation: uuid.UUID | None = None
    # The request's business identity (a hash, `business_key()`), stored with the key;
    # and how many other keys of the scope had it within `window` when the key was
    # written (at `complete()` in atomic mode, at the claim in phased mode).
    business_key: str | None = None
    window: float = DEFAULT_SAME_REQUEST_WINDOW
    suspected_duplicates: int = 0
    _effect_counts: dict[str, int] = field(default_factory=dict)
    # Effects deferred to `complete()` (`enqueue`): their rows by effect key, and
    # (key, kind, queue) per call, for the metrics and the doorbell.
    _deferred: dict[str, dict[str, Any]] = field(default_factory=dict)
    _deferred_calls: list[tuple[str, str, str]] = field(default_factory=list)
    # What a retried transaction starts from (`_mark`: after a phased `prepare`), and
    # whether `complete()` has written the key (a later `enqueue` would be lost).
    _marked: tuple[dict[str, int], dict[str, dict[str, Any]],
                   list[tuple[str, str, str]]] | None = None
    _completed: bool = False

    def enqueue(self, kind: str, payload: Any, *, key: str | None = None,
                name: str | None = None, ordering_key: str | None = None,
                queue: str = "default", delay: float = 0.0,
                max_attempts: int = DEFAULT_MAX_ATTEMPTS,
                retry_for: float | None = None) -> str:
        """Defer an effect to this claim's `complete()`; returns its effect key.

        The row is written by the statement that stores the key: the same transaction
        and guarantees as `enqueue(conn, ..., claim=claim)`, one round trip fewer. It is
        checked and keyed now (bad input raises here); a key that exists with another
        effect raises EffectKeyConflict from `complete()`. Its id is not known before
        then: use `enqueue()` when the work needs it. Never written without `complete()`
        (after it, this raises). The ids come at `complete()`, after those of any
        `enqueue()` in the same work: for one ordering key, use one of the two forms.
        """
        from outbox._enqueue import Effect

        return self.enqueue_many([Effect(
            kind, payload, key=key, name=name, ordering_key=ordering_key, queue=queue,
            delay=delay, max_attempts=max_attempts, retry_for=retry_for)])[0]

    def enqueue_many(self, effects: Iterable[Any]) -> list[str]:
        """`enqueue` for several `Effect`s; their effect keys, in order."""
        from outbox._enqueue import defer

        return defer(self, effects)

    def _mark(self) -> None:
        """What every try of the work starts from: the effects deferred so far (by a
        phased `prepare`)."""
        self._marked = (dict(self._effect_counts), dict(self._deferred),
                        list(self._deferred_calls))

    def _reset(self) -> None:
        """A retried transaction starts its effects again (the same keys, derived anew)."""
        counts, deferred, calls = self._marked or ({}, {}, [])
        self._effect_counts = dict(counts)
        self._deferred = dict(deferred)
        self._deferred_calls = list(calls)
        self._completed = False

    def effect_key(self, kind: str, name: str | None = None) -> str:
        """A deterministic key for the n-th effect of `kind` (or the one called `name`).

        The same request retried after a crash enqueues the same keys, so the outbox
        insert is a no-op and the receiver sees the same Idempotency-Key. The record's
        generation is part of it: a key reused after `outbox purge` is a new request,
        whose effects must not collide with the old ones' rows or the receiver's memory.
        """
        if name is None:
            index = self._effect_counts.get(kind, 0)
            self._effect_counts[kind] = index + 1
            name = str(index)
        parts = [self.scope, self.key, kind, name]
        if self.generation is not None:
            parts.append(self.generation.hex)
        digest = hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:32]
        return f"{kind[:200]}:{digest}"


# Any handle the driver seam accepts (psycopg, SQLAlchemy, Django): outbox/_driver.py.
Connectable = Any
Flow = Generator[Query[Any], Any, Any]


def business_key(identity: str) -> str:
    """The stored form of a business identity: 128 bits of its SHA-256, in hex."""
    return hashlib.sha256(identity.encode()).hexdigest()[:32]


def advisory_lock_id(scope: str, key: str) -> int:
    """A signed 64-bit lock id; a (2^-64) collision only gives the other key a 409."""
    digest = hashlib.sha256(f"{scope}\x00{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a psycopg error, or of one SQLAlchemy wrapped."""
    code = getattr(exc, "sqlstate", None)
    if code is None:
        code = getattr(getattr(exc, "orig", None), "sqlstate", None)
    return code if isinstance(code, str) else None


def _not_written(claim: Claim) -> NoReturn:
    """The completing write wrote no key: the request's work must roll back."""
    if claim.mode == "atomic":
        # The key's row is there though our read found none and we hold its lock: a
        # twin's, written without the lock or committed after our snapshot. Retry the
        # transaction (our work rolls back); its read replays the twin's answer.
        raise _KeyAppeared("the key was completed by a twin; retrying")
    idempotency_requests.add(1, {"outcome": "claim_lost"})
    raise ClaimLost("the idempotency key was taken over; this request's work must roll "
                    "back")


class _KeyAppeared(ClaimLost):
    """The atomic key's row was there at our INSERT. A ClaimLost to a caller of
    `complete()` (its transaction must roll back); run() retries it like a
    serialization failure, and the retry's read replays the twin's answer."""

    sqlstate = "40001"


class _NotPlain(Exception):
    """run()'s completing write refused to commit (an effect key existed, or our
    prepared statement was gone): the transaction is rolled back and tried again, its
    write and COMMIT apart, so that the usual checks answer (a duplicate effect or
    EffectKeyConflict). Retried like a serialization failure."""

    sqlstate = "40001"


def _may_commit_early(conn: Any) -> bool:
    """Whether run() may send its COMMIT with the key's write: on a SQLAlchemy
    Connection of its own (a psycopg `transaction()` block sends a COMMIT of its own),
    statements under the cursor (not OUTBOX_PSYCOPG_CURSOR=1), and no `commit` event
    listener but our doorbell's (its SQL would run after our COMMIT, outside the
    request's transaction; the doorbell runs none, and is better after it)."""
    if not _driver.DIRECT or not _is_sqlalchemy(conn):
        return False
    from outbox._enqueue import rings_registered

    sync = getattr(conn, "sync_connection", conn)  # an AsyncConnection's
    dispatch = getattr(sync, "dispatch", None)
    return dispatch is not None and len(dispatch.commit) == rings_registered(sync)


def _refused(exc: Exception, claim: Claim, merge: list[bool]) -> None:
    """What a completing write sent with its COMMIT refused (keys.then_commit) means:
    what the write and the COMMIT apart would have answered, or another try apart."""
    code = sqlstate(exc)
    if code == sql.NOT_WRITTEN:
        _not_written(claim)
    if code in (sql.EFFECT_EXISTED, "26000"):  # 26000: our prepared statement was gone
        merge[0] = False
        raise _NotPlain("tried again, the write and the COMMIT apart") from exc


def _is_transient(exc: BaseException) -> bool:
    """Serialization failures and deadlocks: the whole transaction may be retried."""
    return sqlstate(exc) in ("40001", "40P01")


def _is_lock_timeout(exc: BaseException) -> bool:
    return sqlstate(exc) == "55P03"


def _status_class(status: int) -> str:
    """`2xx`, `4xx`...: a bounded label for the answered status."""
    return f"{status // 100}xx" if 100 <= status <= 599 else "other"


SUSPECT_EVENT = "outbox.idempotency.suspected_duplicate"


def _suspects_found(claim: Claim, wrote: sql.KeyWrite) -> None:
    """Report other keys of the claim's business identity; never raises, never blocks.

    The other key is named only in the span event and the log line (server side), and
    it is of the same scope by construction (the statement reads one scope).
    """
    claim.suspected_duplicates = wrote.suspects
    if wrote.suspects <= 0:
        return
    try:
        suspected_duplicates.add(1, {"mode": claim.mode})
        trace.get_current_span().add_event(SUSPECT_EVENT, {
            "outbox.idempotency.mode": claim.mode,
            "outbox.idempotency.other_keys": wrote.suspects,
            "outbox.idempotency.other_key": wrote.latest_key or "",
            "outbox.idempotency.window_seconds": claim.window,
        })
        log.warning("suspected duplicate request: key %r in scope %r has the business "
                    "identity of %d other key(s) from the last %g s (newest: %r)",
                    claim.key, claim.scope, wrote.suspects, claim.window, wrote.latest_key)
    except Exception:  # pragma: no cover - a broken exporter or handler
        log.debug("could not report a suspected duplicate", exc_info=True)


@dataclass(frozen=True, slots=True)
class Result:
    """What `IdempotencyGuard.run` produced: the response, and whether it is a replay."""

    response: StoredResponse
    replayed: bool
    # Other keys of the scope with the same business identity within the window (0 for
    # a replay, or without `same_request`).
    suspected_duplicates: int = 0


def ring_deferred(target: Any, claim: Claim) -> None:
    """The doorbell for the queues of the claim's deferred effects, after the commit
    of `target`'s transaction (a handle with no after-commit hook: nothing)."""
    if claim._deferred_calls:
        from outbox._enqueue import _ring_after_commit

        _ring_after_commit(target, {queue for _, _, queue in claim._deferred_calls})


# -- transactions on whatever the caller gave `run` --------------------------------------


def _is_sqlalchemy(obj: object) -> bool:
    return type(obj).__module__.startswith("sqlalchemy")


def _require_idle(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """run()/claim()/release() commit transactions of their own: on a connection with
    one already open psycopg would make a savepoint instead, and we would answer the
    client with nothing committed (and run a phased `prepare` inside the transaction)."""
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        raise TypeError("run()/claim()/release() need a psycopg connection with no open "
                        "transaction: they commit their own; inside your transaction use "
                        "begin() and complete()")


def _require_transaction(handle: Any) -> SyncDB:
    """begin()/complete() write in the caller's transaction: an autocommit handle has
    none (the key's lock would end after one statement, the key commit before the work).
    Returns the handle's driver, to run the statements on."""
    db = sync_db(handle)
    if db.conn.autocommit:
        raise TypeError("begin()/complete() need a transaction: this connection is in "
                        "autocommit mode")
    return db


async def _arequire_transaction(handle: Any) -> AsyncDB:
    db = await async_db(handle)
    if db.conn.autocommit:
        raise TypeError("abegin()/acomplete() need a transaction: this connection is in "
                        "autocommit mode")
    return db


@contextmanager
def _transaction(source: Any, *, read_committed: bool = False) -> Iterator[Any]:
    """A transaction of its own on a SQLAlchemy Engine or a psycopg Connection.

    `read_committed`: the phased claim and release run there whatever the default
    level: at REPEATABLE READ or SERIALIZABLE an ON CONFLICT against a twin's claim
    committed after our snapshot raises 40001 (a 500) instead of answering 409.
    """
    if isinstance(source, psycopg.Connection):
        _require_idle(source)
        with source.transaction():
            if read_committed:
                source.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            yield source
        return
    if _is_sqlalchemy(source) and hasattr(source, "begin") and hasattr(source, "connect"):
        if read_committed:  # a connection-level option: overrides the engine's level
            with source.connect() as conn:
                conn.execution_options(isolation_level="READ COMMITTED")
                with conn.begin():
                    yield conn
            return
        with source.begin() as conn:
            yield conn
        return
    raise TypeError(f"run() needs a SQLAlchemy Engine or a psycopg Connection, not "
                    f"{type(source).__name__}; inside your own transaction use begin()")


@asynccontextmanager
async def _atransaction(source: Any, *, read_committed: bool = False) -> AsyncIterator[Any]:
    """The async twin: a SQLAlchemy AsyncEngine or a psycopg AsyncConnection."""
    if isinstance(source, psycopg.AsyncConnection):
        _require_idle(source)
        async with source.transaction():
            if read_committed:
                await source.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
            yield source
        return
    if _is_sqlalchemy(source) and hasattr(source, "begin") and hasattr(source, "connect"):
        if read_committed:
            async with source.connect() as conn:
                await conn.execution_options(isolation_level="READ COMMITTED")
                async with conn.begin():
                    yield conn
            return
        async with source.begin() as conn:
            yield conn
        return
    raise TypeError(f"arun() needs a SQLAlchemy AsyncEngine or a psycopg AsyncConnection, "
                    f"not {type(source).__name__}; inside your own transaction use abegin()")


_TRIES = 5


def _retrying(*, after_first: bool = False) -> dict[str, Any]:
    """Up to 5 tries of a transaction that failed with a serialization failure or a
    deadlock, each wait drawn from 0 to 10, 20, 40, 80 ms. `after_first`: the 4 tries
    after a first one made outside tenacity (`_with_retries`, which waits the first
    10 ms itself), with the same waits: a first try that succeeds never builds a
    Retrying (~70 µs of a guarded request's CPU)."""
    if after_first:
        return {"retry": retry_if_exception(_is_transient),
                "stop": stop_after_attempt(_TRIES - 1),
                "wait": wait_random_exponential(multiplier=0.02, max=0.2), "reraise": True}
    return {"retry": retry_if_exception(_is_transient), "stop": stop_after_attempt(_TRIES),
            "wait": wait_random_exponential(multiplier=0.01, max=0.2), "reraise": True}


def _first_wait() -> float:
    """The wait before the second try: 0 to 10 ms, as tenacity's first wait."""
    return random.uniform(0, 0.01)


def _with_retries(attempt: Callable[[], T]) -> T:
    """`attempt()`, tried again (a new transaction each time) after a serialization
    failure or deadlock, at most `_TRIES` tries in all."""
    try:
        return attempt()
    except Exception as exc:
        if not _is_transient(exc):
            raise
    time.sleep(_first_wait())
    return Retrying(**_retrying(after_first=True))(attempt)


async def _awith_retries(attempt: Callable[[], Awaitable[T]]) -> T:
    try:
        return await attempt()
    except Exception as exc:
        if not _is_transient(exc):
            raise
    await asyncio.sleep(_first_wait())
    result: T = await AsyncRetrying(**_retrying(after_first=True))(attempt)
    return result


class IdempotencyGuard:
    """Claims idempotency keys; see the module docstring for the two modes.

    `ttl` is how long a phased claim may stay `processing` before a retry can take it
    over (longer than your slowest handler); `retention` how long a completed key is
    replayed before `outbox purge` may delete it (after which the key can run again).

    `same_request` maps a request's parsed body to its business identity (a string, or
    None for "nothing to compare"); `business_key(body)` hashes it, and a request run
    with `business_key=` that finds other keys of its scope with the same hash created
    within `same_request_window` seconds is a suspected duplicate: counted
    (`outbox.idempotency.suspected_duplicates`), a span event, a WARNING on the
    `outbox.idempotency` logger, never refused. The window is bounded by `retention`.
    """

    def __init__(self, *, ttl: float = 60.0, retention: float = 86_400.0,
                 retry_after: int = 1, lock_timeout_ms: int = 2_000,
                 clock: Clock = database_clock, same_request: SameRequest | None = None,
                 same_request_window: float = DEFAULT_SAME_REQUEST_WINDOW,
                 local_twins: bool = True) -> None:
        self.ttl = ttl
        self.local_twins = local_twins
        self.retention = retention
        self.retry_after = retry_after
        self.lock_timeout_ms = lock_timeout_ms
        self.clock = clock
        self.same_request = same_request
        self.same_request_window = same_request_window

    def business_key(self, body: Any, same_request: SameRequest | None = None) -> str | None:
        """The hash of `body`'s business identity, by `same_request` or the guard's own.

        None when neither is set or it returns None. A callable that raises is logged
        and treated as None: the signal must never fail the request it watches.
        """
        declare = same_request or self.same_request
        if declare is None:
            return None
        try:
            identity = declare(body)
        except Exception:
            log.warning("same_request raised; this request is not checked for duplicates",
                        exc_info=True)
            return None
        return None if identity is None else business_key(str(identity))

    def _window(self, same_request_window: float | None) -> float:
        return self.same_request_window if same_request_window is None else same_request_window

    # -- the protocol, once ------------------------------------------------------------

    def _check_existing(self, row: sql.KeyRow, fingerprint: str) -> StoredResponse | None:
        """Replay, refuse (422/409) or return None when the row is an expired claim."""
        if row.fingerprint != fingerprint:
            idempotency_requests.add(1, {"outcome": "mismatch"})
            raise KeyReused("this Idempotency-Key was used with a different request")
        if row.status == "completed":
            assert row.response_status is not None
            idempotency_requests.add(1, {"outcome": "replayed",
                                         "status_class": _status_class(row.response_status)})
            return StoredResponse(
                status=row.response_status,
                headers=tuple((k, v) for k, v in (row.response_headers or [])),
                body=row.response_body or b"",
            )
        if row.lock_expired:  # past the TTL its holder claimed it with
            return None
        idempotency_requests.add(1, {"outcome": "in_progress"})
        raise RequestInProgress(retry_after=self.retry_after)

    def _begin(self, scope: str, key: str, fingerprint: str, business: str | None = None,
               window: float = DEFAULT_SAME_REQUEST_WINDOW) -> Flow:
        found: sql.Locked = yield sql.lock_and_read_key(
            advisory_lock_id(scope, key), scope, key, now=self.clock())
        if not found.locked:
            idempotency_requests.add(1, {"outcome": "in_progress"})
            raise RequestInProgress(retry_after=self.retry_after)
        row = found.row
        if row is None:
            return Claim(scope, key, fingerprint, "atomic", uuid.uuid4(),
                         generation=uuid.uuid4(), business_key=business, window=window)
        cached = self._check_existing(row, fingerprint)
        if cached is not None:
            return cached
        # An expired phased claim (its holder crashed): fence it out, take over,
        # keeping its generation so the retried request enqueues the same keys.
        assert row.lock_token is not None
        if not (yield sql.release_key(scope=scope, key=key, token=row.lock_token)):
            raise RequestInProgress(retry_after=self.retry_after)
        idempotency_requests.add(1, {"outcome": "taken_over"})
        return Claim(scope, key, fingerprint, "atomic", uuid.uuid4(), taken_over=True,
                     generation=row.generation, business_key=business, window=window)

    def _complete(self, claim: Claim, response: StoredResponse, commit: bool = False
                  ) -> Flow:
        """`commit`: the write carries the transaction's COMMIT (run() owns it), and
        refuses all but the plain case (`sql.then_commit`; run() then tries again)."""
        now = self.clock()
        write: Query[Any]
        business = claim.business_key if claim.mode == "atomic" else None  # detecting
        if business is not None:
            write = sql.insert_completed_key_with_suspects(
                scope=claim.scope, key=claim.key, fingerprint=claim.fingerprint,
                status=response.status, headers=response.header_list(), body=response.body,
                retention_seconds=self.retention, generation=claim.generation,
                business_hash=business, window_seconds=claim.window, now=now)
        elif claim.mode == "atomic":
            write = sql.insert_completed_key(
                scope=claim.scope, key=claim.key, fingerprint=claim.fingerprint,
                status=response.status, headers=response.header_list(), body=response.body,
                retention_seconds=self.retention, generation=claim.generation, now=now)
        else:
            write = sql.complete_claimed_key(
                scope=claim.scope, key=claim.key, token=claim.token,
                status=response.status, headers=response.header_list(), body=response.body,
                now=now)
        wrote: sql.KeyWrite
        if claim._deferred:  # the deferred effects ride in the key's write
            from outbox._enqueue import write_deferred

            wrote = (yield from write_deferred(claim, write, commit=commit)).key_write
        else:
            alone = yield sql.then_commit(write) if commit else write
            wrote = alone if isinstance(alone, sql.KeyWrite) else sql.KeyWrite(
                bool(alone), 0, None)
        stored = wrote.written
        if stored and business is not None:
            _suspects_found(claim, wrote)
        if not stored:
            _not_written(claim)
        claim._completed = True
        idempotency_requests.add(1, {"outcome": "executed",
                                     "status_class": _status_class(response.status)})

    def _claim(self, scope: str, key: str, fingerprint: str, business: str | None = None,
               window: float = DEFAULT_SAME_REQUEST_WINDOW) -> Flow:
        token, generation = uuid.uuid4(), uuid.uuid4()
        try:
            yield sql.set_local_lock_timeout(self.lock_timeout_ms)
            if not (yield sql.try_lock_key(advisory_lock_id(scope, key))):
                idempotency_requests.add(1, {"outcome": "in_progress"})
                raise RequestInProgress(retry_after=self.retry_after)
            now = self.clock()
            if business is not None:
                wrote: sql.KeyWrite = yield sql.claim_key_with_suspects(
                    scope=scope, key=key, fingerprint=fingerprint, token=token,
                    ttl_seconds=self.ttl, retention_seconds=self.retention,
                    generation=generation, business_hash=business, window_seconds=window,
                    now=now)
                if wrote.written:
                    claim = Claim(scope, key, fingerprint, "phased", token,
                                  generation=generation, business_key=business, window=window)
                    _suspects_found(claim, wrote)
                    return claim
            elif (yield sql.claim_key(scope=scope, key=key, fingerprint=fingerprint,
                                      token=token, ttl_seconds=self.ttl,
                                      retention_seconds=self.retention,
                                      generation=generation, now=now)):
                return Claim(scope, key, fingerprint, "phased", token, generation=generation)
            row = yield sql.get_key(scope, key, now=now)
            if row is None:  # purged between the insert and the read
                raise RequestInProgress(retry_after=self.retry_after)
            cached = self._check_existing(row, fingerprint)
            if cached is not None:
                return cached
            taken, kept = yield sql.take_over_key(scope=scope, key=key, token=token,
                                                  ttl_seconds=self.ttl, now=now)
            if taken:
                idempotency_requests.add(1, {"outcome": "taken_over"})
                return Claim(scope, key, fingerprint, "phased", token, taken_over=True,
                             generation=kept, business_key=business, window=window)
            idempotency_requests.add(1, {"outcome": "in_progress"})
            raise RequestInProgress(retry_after=self.retry_after)
        except Exception as exc:
            if _is_lock_timeout(exc):
                raise RequestInProgress(retry_after=self.retry_after) from None
            raise

    @staticmethod
    def _release(claim: Claim) -> Flow:
        released = yield sql.release_key(scope=claim.scope, key=claim.key, token=claim.token)
        if released:
            idempotency_requests.add(1, {"outcome": "released"})
        return bool(released)

    # -- atomic mode, inside the caller's transaction ------------------------------------

    def begin(self, target: Connectable, scope: str, key: str, fingerprint: str, *,
              business_key: str | None = None, same_request_window: float | None = None
              ) -> Claim | StoredResponse:
        """Atomic mode, inside the caller's transaction: a Claim, or the cached answer.

        `target` is any handle of the driver seam (psycopg Connection, SQLAlchemy
        Connection/Session/scoped_session, Django's connection). Raises
        RequestInProgress (a twin holds the key) or KeyReused (another request).
        `business_key` (from `business_key(body)`) is stored with the key by
        `complete()`, which sets `claim.suspected_duplicates`.
        """
        db = _require_transaction(target)
        result: Claim | StoredResponse = drive(db, self._begin(
            scope, key, fingerprint, business_key, self._window(same_request_window)))
        return result

    async def abegin(self, target: Connectable, scope: str, key: str, fingerprint: str, *,
                     business_key: str | None = None, same_request_window: float | None = None
                     ) -> Claim | StoredResponse:
        """`begin` on an async handle (psycopg AsyncConnection, SQLAlchemy async)."""
        db = await _arequire_transaction(target)
        result: Claim | StoredResponse = await adrive(db, self._begin(
            scope, key, fingerprint, business_key, self._window(same_request_window)))
        return result

    def complete(self, target: Connectable, claim: Claim, response: StoredResponse) -> None:
        """Store the response in the caller's transaction; it commits with the work.

        In phased mode the write is fenced by our token: ClaimLost means a retry took
        the key over, and letting it propagate rolls back this request's work.
        """
        drive(_require_transaction(target), self._complete(claim, response))
        ring_deferred(target, claim)

    async def acomplete(self, target: Connectable, claim: Claim,
                        response: StoredResponse) -> None:
        await adrive(await _arequire_transaction(target), self._complete(claim, response))
        ring_deferred(target, claim)

    # -- run()'s own transactions: the COMMIT rides with the last write ----------------

    def _complete_and_commit(self, conn: Any, claim: Claim, response: StoredResponse,
                             merge: list[bool]) -> None:
        """`complete`, then commit, in one round trip where that changes nothing else
        (`_may_commit_early`); `merge[0]` False after a refusal: apart, for this
        request's next try."""
        commit = merge[0] and _may_commit_early(conn)
        try:
            drive(_require_transaction(conn), self._complete(claim, response, commit))
        except Exception as exc:
            if commit:
                _refused(exc, claim, merge)
            raise
        ring_deferred(conn, claim)

    async def _acomplete_and_commit(self, conn: Any, claim: Claim,
                                    response: StoredResponse, merge: list[bool]) -> None:
        commit = merge[0] and _may_commit_early(conn)
        try:
            await adrive(await _arequire_transaction(conn),
                         self._complete(claim, response, commit))
        except Exception as exc:
            if commit:
                _refused(exc, claim, merge)
            raise
        ring_deferred(conn, claim)

    # -- phased mode -----------------------------------------------------------------

    def claim(self, engine: Any, scope: str, key: str, fingerprint: str, *,
              business_key: str | None = None, same_request_window: float | None = None
              ) -> Claim | StoredResponse:
        """Phased mode: commit a `processing` claim in its own short transaction.

        `engine`: a SQLAlchemy Engine or a psycopg Connection (not in a transaction).
        With `business_key` the claim stores it and sets `suspected_duplicates`.
        """
        with _transaction(engine, read_committed=True) as conn:
            result: Claim | StoredResponse = drive(conn, self._claim(
                scope, key, fingerprint, business_key, self._window(same_request_window)))
            return result

    async def aclaim(self, engine: Any, scope: str, key: str, fingerprint: str, *,
                     business_key: str | None = None, same_request_window: float | None = None
                     ) -> Claim | StoredResponse:
        """`claim` on a SQLAlchemy AsyncEngine or a psycopg AsyncConnection."""
        async with _atransaction(engine, read_committed=True) as conn:
            result: Claim | StoredResponse = await adrive(conn, self._claim(
                scope, key, fingerprint, business_key, self._window(same_request_window)))
            return result

    def release(self, engine: Any, claim: Claim) -> bool:
        """Drop our claim after a failure so the client's retry runs at once."""
        if claim.mode != "phased":
            return False
        with _transaction(engine, read_committed=True) as conn:
            return bool(drive(conn, self._release(claim)))

    async def arelease(self, engine: Any, claim: Claim) -> bool:
        if claim.mode != "phased":
            return False
        async with _atransaction(engine, read_committed=True) as conn:
            return bool(await adrive(conn, self._release(claim)))

    # -- the whole protocol ------------------------------------------------------------

    def in_flight(self, handle: Any, scope: str, key: str, fingerprint: str
                  ) -> AbstractContextManager[None]:
        """Hold the key as running in this process for the block; a twin with the same
        fingerprint that arrives meanwhile gets RequestInProgress without a round trip
        (outbox/_inflight.py). `run`, `arun` and the HTTP integrations hold it."""
        if not self.local_twins:
            return nullcontext()
        return in_flight.hold(database_of(handle), scope, key, fingerprint, self.ttl,
                              self._busy)

    def _busy(self) -> RequestInProgress:
        idempotency_requests.add(1, {"outcome": "in_progress"})
        return RequestInProgress(retry_after=self.retry_after)

    def run(
        self,
        engine: Any,
        scope: str,
        key: str,
        fingerprint: str,
        work: Callable[[Any, Claim], StoredResponse],
        *,
        mode: Mode = "atomic",
        prepare: Callable[[Claim], None] | None = None,
        business_key: str | None = None,
        same_request_window: float | None = None,
    ) -> Result:
        """Run `work` at most once per key and return its (possibly replayed) response.

        `engine` is a SQLAlchemy Engine (work gets a Connection) or a psycopg Connection
        (work gets it back, inside a transaction). `work(conn, claim)` writes business
        rows and `enqueue(conn, ..., claim=claim)` effects; it must not commit. In
        phased mode `prepare(claim)` runs first, outside any transaction, for outside
        I/O. A serialization failure or deadlock retries the transaction (at most 5
        tries); any other exception releases the claim. `business_key` (from
        `business_key(body)`): see the class; `Result.suspected_duplicates` tells.
        A twin of a request running in this process answers 409 at once (`in_flight`).
        """
        with self.in_flight(engine, scope, key, fingerprint):
            return self._run(engine, scope, key, fingerprint, work, mode=mode,
                             prepare=prepare, business_key=business_key,
                             same_request_window=same_request_window)

    def _run(self, engine: Any, scope: str, key: str, fingerprint: str,
             work: Callable[[Any, Claim], StoredResponse], *, mode: Mode,
             prepare: Callable[[Claim], None] | None, business_key: str | None,
             same_request_window: float | None) -> Result:
        """`run` once the key is held as in flight here."""
        merge = [True]
        if mode == "atomic":
            def atomic() -> Result:
                with _transaction(engine) as conn:
                    begun = self.begin(conn, scope, key, fingerprint,
                                       business_key=business_key,
                                       same_request_window=same_request_window)
                    if isinstance(begun, StoredResponse):
                        return Result(begun, replayed=True)
                    response = work(conn, begun)
                    self._complete_and_commit(conn, begun, response, merge)
                    return Result(response, replayed=False,
                                  suspected_duplicates=begun.suspected_duplicates)
            return _with_retries(atomic)

        claimed = self.claim(engine, scope, key, fingerprint, business_key=business_key,
                             same_request_window=same_request_window)
        if isinstance(claimed, StoredResponse):
            return Result(claimed, replayed=True)
        try:
            if prepare is not None:
                prepare(claimed)
            claimed._mark()
            def phased() -> Result:
                claimed._reset()
                with _transaction(engine) as conn:
                    response = work(conn, claimed)
                    self._complete_and_commit(conn, claimed, response, merge)
                return Result(response, replayed=False,
                              suspected_duplicates=claimed.suspected_duplicates)
            return _with_retries(phased)
        except ClaimLost:
            raise
        except BaseException:
            self.release(engine, claimed)
            raise

    async def arun(
        self,
        engine: Any,
        scope: str,
        key: str,
        fingerprint: str,
        work: Callable[[Any, Claim], Awaitable[StoredResponse]],
        *,
        mode: Mode = "atomic",
        prepare: Callable[[Claim], Awaitable[None]] | None = None,
        business_key: str | None = None,
        same_request_window: float | None = None,
    ) -> Result:
        """`run` for async code: `engine` is a SQLAlchemy AsyncEngine (work gets an
        AsyncConnection) or a psycopg AsyncConnection; `work` and `prepare` are awaited."""
        with self.in_flight(engine, scope, key, fingerprint):
            return await self._arun(engine, scope, key, fingerprint, work, mode=mode,
                                    prepare=prepare, business_key=business_key,
                                    same_request_window=same_request_window)

    async def _arun(self, engine: Any, scope: str, key: str, fingerprint: str,
                    work: Callable[[Any, Claim], Awaitable[StoredResponse]], *, mode: Mode,
                    prepare: Callable[[Claim], Awaitable[None]] | None,
                    business_key: str | None, same_request_window: float | None) -> Result:
        """`arun` once the key is held as in flight here."""
        merge = [True]
        if mode == "atomic":
            async def atomic() -> Result:
                async with _atransaction(engine) as conn:
                    begun = await self.abegin(
                        conn, scope, key, fingerprint, business_key=business_key,
                        same_request_window=same_request_window)
                    if isinstance(begun, StoredResponse):
                        return Result(begun, replayed=True)
                    response = await work(conn, begun)
                    await self._acomplete_and_commit(conn, begun, response, merge)
                    return Result(response, replayed=False,
                                  suspected_duplicates=begun.suspected_duplicates)
            return await _awith_retries(atomic)

        claimed = await self.aclaim(engine, scope, key, fingerprint,
                                    business_key=business_key,
                                    same_request_window=same_request_window)
        if isinstance(claimed, StoredResponse):
            return Result(claimed, replayed=True)
        try:
            if prepare is not None:
                await prepare(claimed)
            claimed._mark()
            async def phased() -> Result:
                claimed._reset()
                async with _atransaction(engine) as conn:
                    response = await work(conn, claimed)
                    await self._acomplete_and_commit(conn, claimed, response, merge)
                return Result(response, replayed=False,
                              suspected_duplicates=claimed.suspected_duplicates)
            return await _awith_retries(phased)
        except ClaimLost:
            raise
        except BaseException:
            await self.arelease(engine, claimed)
            raise
