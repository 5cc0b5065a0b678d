"""Statements on `outbox.idempotency_keys` (see docs/architecture.md, "Idempotency keys").

Each function returns a `Query`: `.run(handle)` on any sync handle, `await .arun(handle)`
on an async one (outbox/_driver.py); the guard yields them from one sans-IO protocol.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, TypeVar

from psycopg.types.json import Jsonb

from outbox._driver import Query, Result, Statement, nothing, rowcount, sql
from outbox.sql import effects

_NOW = "coalesce(CAST(:now AS timestamptz), now())"
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class KeyRow:
    status: str
    fingerprint: str
    lock_token: uuid.UUID | None
    age: timedelta | None
    lock_expired: bool            # a `processing` claim past its holder's TTL
    generation: uuid.UUID | None  # None only for rows written before migration 0002
    response_status: int | None
    response_headers: list[list[str]] | None
    response_body: bytes | None


_TRY_LOCK = sql("SELECT pg_try_advisory_xact_lock(:lock_id)")


def try_lock_key(lock_id: int) -> Query[bool]:
    """Take the key's advisory lock for this transaction without waiting."""
    return Query(_TRY_LOCK, {"lock_id": lock_id}, lambda r: bool(r.scalar()))


_SET_LOCK_TIMEOUT = sql("SELECT set_config('lock_timeout', :timeout, true)")


def set_local_lock_timeout(milliseconds: int) -> Query[None]:
    """Bound lock waits for the rest of this transaction (F10: 409, never a hang)."""
    return Query(_SET_LOCK_TIMEOUT, {"timeout": f"{int(milliseconds)}ms"}, nothing)


_GET = sql(
    f"""
    SELECT status, fingerprint, lock_token, {_NOW} - locked_at AS age,
           coalesce(lock_expires_at <= {_NOW}, false) AS lock_expired, generation,
           response_status, response_headers, response_body
      FROM outbox.idempotency_keys
     WHERE scope = :scope AND key = :key
    """
)


def get_key(scope: str, key: str, now: datetime | None = None) -> Query[KeyRow | None]:
    return Query(_GET, {"scope": scope, "key": key, "now": now}, _key_row)


def _key_row(result: Result) -> KeyRow | None:
    row = result.first()
    return None if row is None else _as_key_row(row)


def _as_key_row(values: Sequence[Any]) -> KeyRow:
    """KeyRow from its columns in order (`_GET`'s, `_LOCK_AND_READ`'s after `locked`)."""
    (status, fingerprint, lock_token, age, lock_expired, generation, response_status,
     response_headers, body) = values
    return KeyRow(status, fingerprint, lock_token, age, lock_expired, generation,
                  response_status, response_headers,
                  bytes(body) if body is not None else None)


# The atomic guard's first statement (migration 0009): the key's advisory lock, then its
# row read on a snapshot taken after the lock, in one round trip. Rows are read by
# position (tuples): `locked` first, then KeyRow's fields in order.
_LOCK_AND_READ = sql(
    """
    SELECT locked, status, fingerprint, lock_token, age, lock_expired, generation,
           response_status, response_headers, response_body
      FROM outbox.lock_and_read_key(:lock_id, :scope, :key, CAST(:now AS timestamptz))
    """,
    tuples=True,
)


@dataclass(frozen=True, slots=True)
class Locked:
    """What `lock_and_read_key` found: the lock (False: a twin holds it) and the row."""

    locked: bool
    row: KeyRow | None


_NEW_KEY = Locked(True, None)
_HELD = Locked(False, None)


def lock_and_read_key(lock_id: int, scope: str, key: str,
                      now: datetime | None = None) -> Query[Locked]:
    """Take the key's advisory lock without waiting and, if ours, read the key's row.

    The read runs after the lock (a fresh snapshot inside the function), so a twin that
    committed before we got the lock is seen: one round trip for what took two.
    """
    return Query(_LOCK_AND_READ, {"lock_id": lock_id, "scope": scope, "key": key,
                                  "now": now}, _locked)


def _locked(result: Result) -> Locked:
    if not result.rows:
        return _NEW_KEY
    locked, *columns = result.rows[0]
    return Locked(True, _as_key_row(columns)) if locked else _HELD


_INSERT_COMPLETED_ROW = f"""
    INSERT INTO outbox.idempotency_keys
           (scope, key, fingerprint, status, response_status, response_headers,
            response_body, created_at, completed_at, expires_at, generation)
    VALUES (:scope, :key, :fingerprint, 'completed', :status, :headers, :body,
            {_NOW}, {_NOW}, {_NOW} + make_interval(secs => :retention), :generation)
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING 1
"""
_INSERT_COMPLETED = sql(_INSERT_COMPLETED_ROW, tuples=True)


def insert_completed_key(
    *,
    scope: str,
    key: str,
    fingerprint: str,
    status: int,
    headers: list[list[str]],
    body: bytes,
    retention_seconds: float,
    generation: uuid.UUID | None,
    now: datetime | None = None,
) -> Query[bool]:
    """Atomic mode's single write; False if a row appeared (the unique backstop)."""
    params: dict[str, Any] = {
        "scope": scope, "key": key, "fingerprint": fingerprint, "status": status,
        "headers": Jsonb(headers), "body": body, "retention": retention_seconds,
        "generation": generation, "now": now,
    }
    return Query(_INSERT_COMPLETED, params, returned)


def returned(result: Result) -> bool:
    """Whether the statement returned a row (the key was written)."""
    return bool(result.rows)


# The same business request under another key (issue 15): the statement that writes a
# key with a business hash also reads the newest other keys of its scope with that hash
# inside the window, so noticing them costs no round trip. The read runs on the
# statement's snapshot: keys committed before it are seen (never our own row, and not
# a concurrent request's uncommitted one). It never locks or refuses anything.
_SUSPECTS_CTE = f"""
    suspects AS (
        SELECT key, created_at FROM outbox.idempotency_keys
         WHERE scope = :scope AND business_hash = :business_hash
           AND created_at >= {_NOW} - make_interval(secs => :window)
           AND key <> :key
         ORDER BY created_at DESC
         LIMIT :cap)
"""
_SUSPECTS_COLUMNS = """
           (SELECT count(*) FROM suspects) AS suspects,
           (SELECT key FROM suspects ORDER BY created_at DESC LIMIT 1) AS latest_key
"""
_WRITTEN = "EXISTS (SELECT 1 FROM written)"
_SUSPECTS = f"""{_SUSPECTS_CTE}
    SELECT {_WRITTEN} AS written, {_SUSPECTS_COLUMNS}
"""

#: At most this many other keys are counted (and read) per write.
SUSPECTS_CAP = 100


@dataclass(frozen=True, slots=True)
class KeyWrite:
    """A key write that also looked for the same business request under other keys."""

    written: bool
    suspects: int             # other keys of the scope with the hash (at most the cap)
    latest_key: str | None    # the newest of them (same scope only)


def _key_write(result: Result) -> KeyWrite:
    written, suspects, latest_key = result.one()  # by position (tuples)
    return KeyWrite(bool(written), int(suspects), latest_key)


_INSERT_COMPLETED_HASHED_ROW = f"""
        INSERT INTO outbox.idempotency_keys
               (scope, key, fingerprint, status, response_status, response_headers,
                response_body, created_at, completed_at, expires_at, generation,
                business_hash)
        VALUES (:scope, :key, :fingerprint, 'completed', :status, :headers, :body,
                {_NOW}, {_NOW}, {_NOW} + make_interval(secs => :retention), :generation,
                :business_hash)
        ON CONFLICT (scope, key) DO NOTHING
        RETURNING 1
"""
_INSERT_COMPLETED_WITH_SUSPECTS = sql(
    f"WITH written AS ({_INSERT_COMPLETED_HASHED_ROW}), {_SUSPECTS}", tuples=True)


def insert_completed_key_with_suspects(
    *,
    scope: str,
    key: str,
    fingerprint: str,
    status: int,
    headers: list[list[str]],
    body: bytes,
    retention_seconds: float,
    generation: uuid.UUID | None,
    business_hash: str,
    window_seconds: float,
    cap: int = SUSPECTS_CAP,
    now: datetime | None = None,
) -> Query[KeyWrite]:
    """`insert_completed_key` storing `business_hash`, and in the same statement the
    other keys of `scope` with that hash created within `window_seconds`."""
    params: dict[str, Any] = {
        "scope": scope, "key": key, "fingerprint": fingerprint, "status": status,
        "headers": Jsonb(headers), "body": body, "retention": retention_seconds,
        "generation": generation, "business_hash": business_hash,
        "window": window_seconds, "cap": cap, "now": now,
    }
    return Query(_INSERT_COMPLETED_WITH_SUSPECTS, params, _key_write)


_CLAIM = sql(
    f"""
    INSERT INTO outbox.idempotency_keys
           (scope, key, fingerprint, status, lock_token, locked_at, lock_expires_at,
            created_at, expires_at, generation)
    VALUES (:scope, :key, :fingerprint, 'processing', :token, {_NOW},
            {_NOW} + make_interval(secs => :ttl), {_NOW},
            {_NOW} + make_interval(secs => :retention), :generation)
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING 1
    """
)


def claim_key(
    *,
    scope: str,
    key: str,
    fingerprint: str,
    token: uuid.UUID,
    ttl_seconds: float,
    retention_seconds: float,
    generation: uuid.UUID,
    now: datetime | None = None,
) -> Query[bool]:
    """Phased mode: insert a `processing` claim; False if the key already exists.

    `ttl_seconds` is stored with the claim (`lock_expires_at`): how long its holder may
    take is the holder's setting, and every retaker and `outbox status` reads it there.
    """
    params = {
        "scope": scope, "key": key, "fingerprint": fingerprint, "token": token,
        "ttl": ttl_seconds, "retention": retention_seconds, "generation": generation,
        "now": now,
    }
    return Query(_CLAIM, params, returned)


_CLAIM_WITH_SUSPECTS = sql(
    f"""
    WITH written AS (
        INSERT INTO outbox.idempotency_keys
               (scope, key, fingerprint, status, lock_token, locked_at, lock_expires_at,
                created_at, expires_at, generation, business_hash)
        VALUES (:scope, :key, :fingerprint, 'processing', :token, {_NOW},
                {_NOW} + make_interval(secs => :ttl), {_NOW},
                {_NOW} + make_interval(secs => :retention), :generation, :business_hash)
        ON CONFLICT (scope, key) DO NOTHING
        RETURNING 1),
    {_SUSPECTS}
    """,
    tuples=True,
)


def claim_key_with_suspects(
    *,
    scope: str,
    key: str,
    fingerprint: str,
    token: uuid.UUID,
    ttl_seconds: float,
    retention_seconds: float,
    generation: uuid.UUID,
    business_hash: str,
    window_seconds: float,
    cap: int = SUSPECTS_CAP,
    now: datetime | None = None,
) -> Query[KeyWrite]:
    """`claim_key` storing `business_hash`, and in the same statement the other keys of
    `scope` with that hash created within `window_seconds`."""
    params = {
        "scope": scope, "key": key, "fingerprint": fingerprint, "token": token,
        "ttl": ttl_seconds, "retention": retention_seconds, "generation": generation,
        "business_hash": business_hash, "window": window_seconds, "cap": cap, "now": now,
    }
    return Query(_CLAIM_WITH_SUSPECTS, params, _key_write)


_TAKE_OVER = sql(
    f"""
    UPDATE outbox.idempotency_keys
       SET lock_token = :token, locked_at = {_NOW},
           lock_expires_at = {_NOW} + make_interval(secs => :ttl)
     WHERE scope = :scope AND key = :key
       AND status = 'processing'
       AND lock_expires_at <= {_NOW}
    RETURNING generation
    """
)


def take_over_key(
    *,
    scope: str,
    key: str,
    token: uuid.UUID,
    ttl_seconds: float,
    now: datetime | None = None,
) -> Query[tuple[bool, uuid.UUID | None]]:
    """Fenced takeover of an expired claim: exactly one racing retaker gets True.

    Also returns the record's generation: the retaken request keeps its effect keys.
    """
    params = {"scope": scope, "key": key, "token": token, "ttl": ttl_seconds, "now": now}
    return Query(_TAKE_OVER, params, _taken)


def _taken(result: Result) -> tuple[bool, uuid.UUID | None]:
    row = result.first()
    return (row is not None, row.generation if row is not None else None)


_COMPLETE_ROW = f"""
    UPDATE outbox.idempotency_keys
       SET status = 'completed', lock_token = NULL, locked_at = NULL, lock_expires_at = NULL,
           response_status = :status, response_headers = :headers, response_body = :body,
           completed_at = {_NOW}
     WHERE scope = :scope AND key = :key AND status = 'processing' AND lock_token = :token
    RETURNING 1
"""
_COMPLETE = sql(_COMPLETE_ROW, tuples=True)


def complete_claimed_key(
    *,
    scope: str,
    key: str,
    token: uuid.UUID,
    status: int,
    headers: list[list[str]],
    body: bytes,
    now: datetime | None = None,
) -> Query[bool]:
    """Phased mode: store the response iff we still hold the claim (the fence)."""
    params: dict[str, Any] = {
        "scope": scope, "key": key, "token": token, "status": status,
        "headers": Jsonb(headers), "body": body, "now": now,
    }
    return Query(_COMPLETE, params, returned)


# A key's completion carrying its request's deferred effects (`Claim.enqueue`): the key
# write is the `written` CTE, the effects are written only if it wrote the key (a twin's
# row there, or a phased claim taken over: no effect of ours is written), and the
# doorbell rings for their queues at commit. One statement for what took two.
_GATE = _WRITTEN
_EFFECTS_COLUMNS = """
           ARRAY(SELECT effect_key FROM ins) AS inserted,
           (SELECT count(*) FROM bell) AS rang
"""


def _carrying(row: str, *, suspects: bool, written: str = _WRITTEN) -> Statement:
    extra = f", {_SUSPECTS_CTE}" if suspects else ""
    columns = f"{_SUSPECTS_COLUMNS}," if suspects else ""
    return sql(f"WITH written AS ({row}), {effects.EFFECT_CTES.format(gate=_GATE)}{extra}"
               f" SELECT {written} AS written, {columns}"
               f" {_EFFECTS_COLUMNS}", tuples=True)


_CARRYING: dict[Statement, Statement] = {
    _INSERT_COMPLETED: _carrying(_INSERT_COMPLETED_ROW, suspects=False),
    _INSERT_COMPLETED_WITH_SUSPECTS: _carrying(_INSERT_COMPLETED_HASHED_ROW, suspects=True),
    _COMPLETE: _carrying(_COMPLETE_ROW, suspects=False),
}

# The key's completing write when the COMMIT rides in its round trip (`then_commit`,
# migration 0012): the same statement and result, but it raises (and the COMMIT after
# it is not run) unless it is the plain case, all that may commit without the guard's
# look at the result: the key written (else NOT_WRITTEN) and, carrying effects, every
# one of them new (else EFFECT_EXISTED). The two cannot fail together (no key written,
# no effect tried), so the order PostgreSQL evaluates them in does not matter.
NOT_WRITTEN, EFFECT_EXISTED = "OB001", "OB002"
_PLAIN = f"outbox.require({_GATE}, '{NOT_WRITTEN}', 'the key was not written')"
_PLAIN_WITH_EFFECTS = (
    f"{_PLAIN} AND outbox.require((SELECT count(*) FROM ins) = (SELECT count(*) FROM t),"
    f" '{EFFECT_EXISTED}', 'an effect key existed')")


def _required(row: str) -> Statement:
    """`row` (an INSERT or UPDATE ... RETURNING 1): one row if written, else
    NOT_WRITTEN."""
    return sql(f"WITH written AS ({row}) SELECT 1 WHERE {_PLAIN}", tuples=True)


_THEN_COMMIT: dict[Statement, Statement] = {
    _INSERT_COMPLETED: _required(_INSERT_COMPLETED_ROW),
    _COMPLETE: _required(_COMPLETE_ROW),
    _INSERT_COMPLETED_WITH_SUSPECTS: sql(
        f"WITH written AS ({_INSERT_COMPLETED_HASHED_ROW}), "
        f"{_SUSPECTS.replace(f'{_WRITTEN} AS written', f'{_PLAIN} AS written')}",
        tuples=True),
    **{carrying: _carrying(row, suspects=suspects, written=_PLAIN_WITH_EFFECTS)
       for carrying, row, suspects in (
           (_CARRYING[_INSERT_COMPLETED], _INSERT_COMPLETED_ROW, False),
           (_CARRYING[_INSERT_COMPLETED_WITH_SUSPECTS], _INSERT_COMPLETED_HASHED_ROW, True),
           (_CARRYING[_COMPLETE], _COMPLETE_ROW, False))},
}


def then_commit(write: Query[T]) -> Query[T]:
    """`write` (a completing key write, with effects or not) sent with the COMMIT of
    its transaction: it commits only the plain case, else raises NOT_WRITTEN or
    EFFECT_EXISTED."""
    return Query(_THEN_COMMIT[write.statement], write.params, write.parse, commit=True)


@dataclass(frozen=True, slots=True)
class Completed:
    """A key written with effects: the key write (as the detecting statements tell it;
    no suspects for the others) and the effect keys that were new."""

    key_write: KeyWrite
    inserted: frozenset[str]


def with_effects(write: Query[Any], rows: Sequence[dict[str, Any]], channel: str
                 ) -> Query[Completed]:
    """`write` (a completing key write) carrying `rows` (as `insert_effects` takes them)."""
    statement = _CARRYING[write.statement]
    params = {**write.params, **effects.effect_params(rows, channel)}
    return Query(statement, params, _completed)


def _completed(result: Result) -> Completed:
    row = result.one()  # written, [suspects, latest_key,] inserted, rang: by position
    suspects, latest_key = (int(row[1]), row[2]) if len(row) == 5 else (0, None)
    return Completed(KeyWrite(bool(row[0]), suspects, latest_key), frozenset(row[-2] or ()))


_RELEASE = sql(
    """
    DELETE FROM outbox.idempotency_keys
     WHERE scope = :scope AND key = :key AND status = 'processing' AND lock_token = :token
    RETURNING 1
    """
)


def release_key(*, scope: str, key: str, token: uuid.UUID) -> Query[bool]:
    """Drop our own claim so the client's retry runs at once (never someone else's)."""
    return Query(_RELEASE, {"scope": scope, "key": key, "token": token}, returned)


_PURGE_EXPIRED = sql(
    f"""
    DELETE FROM outbox.idempotency_keys
     WHERE ctid = ANY(ARRAY(
           SELECT ctid FROM outbox.idempotency_keys
            WHERE expires_at < {_NOW} AND status = 'completed'
            LIMIT :batch))
       AND status = 'completed'
    """
)


def purge_expired_keys(batch: int, now: datetime | None = None) -> Query[int]:
    """Delete up to `batch` completed keys past retention; a purged key may run again.

    Never a `processing` claim (F11), however old: its work may still commit, and
    deleting it would let a retry run the request a second time. A crashed claim is
    taken over by the next retry after its TTL instead. The status test is repeated on
    the DELETE because READ COMMITTED re-checks only the DELETE's own WHERE.
    """
    return Query(_PURGE_EXPIRED, {"batch": batch, "now": now}, rowcount)


_COUNT_BY_STATUS = sql(
    f"""
    SELECT status, count(*) AS n,
           count(*) FILTER (WHERE status = 'processing'
                            AND lock_expires_at <= {_NOW}) AS stale
      FROM outbox.idempotency_keys GROUP BY status
    """
)


def count_keys(now: datetime | None = None) -> Query[dict[str, int]]:
    """Keys by status, plus `stale_processing`: claims past their holder's own TTL."""
    return Query(_COUNT_BY_STATUS, {"now": now}, _key_counts)


def _key_counts(result: Result) -> dict[str, int]:
    out: dict[str, int] = {"processing": 0, "completed": 0, "stale_processing": 0}
    for row in result:
        out[row.status] = row.n
        out["stale_processing"] += row.stale
    return out
