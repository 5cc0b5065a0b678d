"""The idempotency guard: claim a key before any work, replay what it answered.

Two modes share one table (DESIGN.md §4):

* atomic (default): an advisory xact lock makes a twin fail fast with 409, and the
  key row is written `completed` in the same transaction as the business rows. One
  commit per request; a crash rolls everything back, so nothing is left to heal.
* phased: for handlers that must call out before they can answer. The claim commits
  first (twins see it), a TTL heals crashes, a takeover is a fenced conditional
  UPDATE, and completion only succeeds while our token still holds the key.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from sqlalchemy import Connection, Engine
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.orm import Session
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_random_exponential

from outbox._telemetry import idempotency_requests
from outbox.errors import ClaimLost, KeyReused, RequestInProgress
from outbox.sql import keys as sql

Mode = Literal["atomic", "phased"]
Clock = Callable[[], datetime | None]


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
    _effect_counts: dict[str, int] = field(default_factory=dict)

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


Connectable = Connection | Session


def _conn(target: Connectable) -> Connection:
    return target.connection() if isinstance(target, Session) else target


def advisory_lock_id(scope: str, key: str) -> int:
    """A signed 64-bit lock id; a (2^-64) collision only gives the other key a 409."""
    digest = hashlib.sha256(f"{scope}\x00{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


@contextmanager
def _read_committed(engine: Engine) -> Iterator[Connection]:
    """A short transaction of its own at READ COMMITTED, whatever the engine's level.

    The phased claim and release run here: at REPEATABLE READ or SERIALIZABLE an
    ON CONFLICT against a twin's claim committed after our snapshot raises 40001 (a
    500) instead of answering 409. (A connection-level option, so it overrides an
    engine-level `isolation_level`; it is reset when the connection goes back.)
    """
    with engine.connect() as conn:
        conn.execution_options(isolation_level="READ COMMITTED")
        with conn.begin():
            yield conn


def _is_transient(exc: BaseException) -> bool:
    """Serialization failures and deadlocks: the whole transaction may be retried."""
    if not isinstance(exc, DBAPIError) or exc.orig is None:
        return False
    return getattr(exc.orig, "sqlstate", None) in ("40001", "40P01")


def _is_lock_timeout(exc: BaseException) -> bool:
    return isinstance(exc, OperationalError) and getattr(exc.orig, "sqlstate", None) == "55P03"


@dataclass(frozen=True, slots=True)
class Result:
    """What `IdempotencyGuard.run` produced: the response, and whether it is a replay."""

    response: StoredResponse
    replayed: bool


class IdempotencyGuard:
    """Claims idempotency keys; see the module docstring for the two modes.

    `ttl` is how long a phased claim may stay `processing` before a retry can take it
    over (longer than your slowest handler); `retention` how long a completed key is
    replayed before `outbox purge` may delete it (after which the key can run again).
    """

    def __init__(self, *, ttl: float = 60.0, retention: float = 86_400.0,
                 retry_after: int = 1, lock_timeout_ms: int = 2_000,
                 clock: Clock = database_clock) -> None:
        self.ttl = ttl
        self.retention = retention
        self.retry_after = retry_after
        self.lock_timeout_ms = lock_timeout_ms
        self.clock = clock

    # -- shared ----------------------------------------------------------------------

    def _check_existing(self, row: sql.KeyRow, fingerprint: str) -> StoredResponse | None:
        """Replay, refuse (422/409) or return None when the row is an expired claim."""
        if row.fingerprint != fingerprint:
            idempotency_requests.add(1, {"outcome": "mismatch"})
            raise KeyReused("this Idempotency-Key was used with a different request")
        if row.status == "completed":
            idempotency_requests.add(1, {"outcome": "replayed"})
            assert row.response_status is not None
            return StoredResponse(
                status=row.response_status,
                headers=tuple((k, v) for k, v in (row.response_headers or [])),
                body=row.response_body or b"",
            )
        if row.lock_expired:  # past the TTL its holder claimed it with
            return None
        idempotency_requests.add(1, {"outcome": "in_progress"})
        raise RequestInProgress(retry_after=self.retry_after)

    # -- atomic mode -----------------------------------------------------------------

    def begin(self, target: Connectable, scope: str, key: str, fingerprint: str
              ) -> Claim | StoredResponse:
        """Atomic mode, inside the caller's transaction: a Claim, or the cached answer.

        Raises RequestInProgress (a twin holds the key) or KeyReused (other request).
        """
        conn = _conn(target)
        if not sql.try_lock_key(conn, advisory_lock_id(scope, key)):
            idempotency_requests.add(1, {"outcome": "in_progress"})
            raise RequestInProgress(retry_after=self.retry_after)
        row = sql.get_key(conn, scope, key, now=self.clock())
        generation = uuid.uuid4()
        if row is not None:
            cached = self._check_existing(row, fingerprint)
            if cached is not None:
                return cached
            # An expired phased claim (its holder crashed): fence it out, take over,
            # keeping its generation so the retried request enqueues the same keys.
            assert row.lock_token is not None
            if not sql.release_key(conn, scope=scope, key=key, token=row.lock_token):
                raise RequestInProgress(retry_after=self.retry_after)
            idempotency_requests.add(1, {"outcome": "taken_over"})
            return Claim(scope, key, fingerprint, "atomic", uuid.uuid4(), taken_over=True,
                         generation=row.generation)
        return Claim(scope, key, fingerprint, "atomic", uuid.uuid4(), generation=generation)

    def complete(self, target: Connectable, claim: Claim, response: StoredResponse) -> None:
        """Store the response in the caller's transaction; it commits with the work.

        In phased mode the write is fenced by our token: ClaimLost means a retry took
        the key over, and letting it propagate rolls back this request's work.
        """
        conn = _conn(target)
        now = self.clock()
        if claim.mode == "atomic":
            stored = sql.insert_completed_key(
                conn, scope=claim.scope, key=claim.key, fingerprint=claim.fingerprint,
                status=response.status, headers=response.header_list(), body=response.body,
                retention_seconds=self.retention, generation=claim.generation, now=now)
        else:
            stored = sql.complete_claimed_key(
                conn, scope=claim.scope, key=claim.key, token=claim.token,
                status=response.status, headers=response.header_list(), body=response.body,
                now=now)
        if not stored:
            idempotency_requests.add(1, {"outcome": "claim_lost"})
            raise ClaimLost("the idempotency key was taken over; this request's work "
                            "must roll back")
        idempotency_requests.add(1, {"outcome": "executed"})

    # -- phased mode -----------------------------------------------------------------

    def claim(self, engine: Engine, scope: str, key: str, fingerprint: str
              ) -> Claim | StoredResponse:
        """Phased mode: commit a `processing` claim in its own short transaction."""
        token, generation = uuid.uuid4(), uuid.uuid4()
        try:
            with _read_committed(engine) as conn:
                sql.set_local_lock_timeout(conn, self.lock_timeout_ms)
                if not sql.try_lock_key(conn, advisory_lock_id(scope, key)):
                    idempotency_requests.add(1, {"outcome": "in_progress"})
                    raise RequestInProgress(retry_after=self.retry_after)
                now = self.clock()
                if sql.claim_key(conn, scope=scope, key=key, fingerprint=fingerprint,
                                 token=token, ttl_seconds=self.ttl,
                                 retention_seconds=self.retention, generation=generation,
                                 now=now):
                    return Claim(scope, key, fingerprint, "phased", token,
                                 generation=generation)
                row = sql.get_key(conn, scope, key, now=now)
                if row is None:  # purged between the insert and the read
                    raise RequestInProgress(retry_after=self.retry_after)
                cached = self._check_existing(row, fingerprint)
                if cached is not None:
                    return cached
                taken, kept = sql.take_over_key(conn, scope=scope, key=key, token=token,
                                                ttl_seconds=self.ttl, now=now)
                if taken:
                    idempotency_requests.add(1, {"outcome": "taken_over"})
                    return Claim(scope, key, fingerprint, "phased", token, taken_over=True,
                                 generation=kept)
                idempotency_requests.add(1, {"outcome": "in_progress"})
                raise RequestInProgress(retry_after=self.retry_after)
        except OperationalError as exc:
            if _is_lock_timeout(exc):
                raise RequestInProgress(retry_after=self.retry_after) from None
            raise

    def release(self, engine: Engine, claim: Claim) -> bool:
        """Drop our claim after a failure so the client's retry runs at once."""
        if claim.mode != "phased":
            return False
        with _read_committed(engine) as conn:
            released = sql.release_key(conn, scope=claim.scope, key=claim.key,
                                       token=claim.token)
        if released:
            idempotency_requests.add(1, {"outcome": "released"})
        return released

    # -- the whole protocol ------------------------------------------------------------

    def run(
        self,
        engine: Engine,
        scope: str,
        key: str,
        fingerprint: str,
        work: Callable[[Connection, Claim], StoredResponse],
        *,
        mode: Mode = "atomic",
        prepare: Callable[[Claim], None] | None = None,
    ) -> Result:
        """Run `work` at most once per key and return its (possibly replayed) response.

        `work(conn, claim)` writes business rows and `enqueue(conn, ..., claim=claim)`
        effects; it must not commit. In phased mode `prepare(claim)` runs first, outside
        any transaction, for outside I/O. A serialization failure or deadlock retries
        the transaction (at most 5 tries); any other exception releases the claim.
        """
        retrying = retry(
            retry=retry_if_exception(_is_transient),
            stop=stop_after_attempt(5),
            wait=wait_random_exponential(multiplier=0.01, max=0.2),
            reraise=True,
        )
        if mode == "atomic":
            @retrying
            def attempt_atomic() -> Result:
                with engine.begin() as conn:
                    begun = self.begin(conn, scope, key, fingerprint)
                    if isinstance(begun, StoredResponse):
                        return Result(begun, replayed=True)
                    response = work(conn, begun)
                    self.complete(conn, begun, response)
                    return Result(response, replayed=False)

            return attempt_atomic()

        claimed = self.claim(engine, scope, key, fingerprint)
        if isinstance(claimed, StoredResponse):
            return Result(claimed, replayed=True)
        try:
            if prepare is not None:
                prepare(claimed)

            @retrying
            def attempt_phased() -> StoredResponse:
                claimed._effect_counts.clear()
                with engine.begin() as conn:
                    response = work(conn, claimed)
                    self.complete(conn, claimed, response)
                    return response

            return Result(attempt_phased(), replayed=False)
        except ClaimLost:
            raise
        except BaseException:
            self.release(engine, claimed)
            raise
