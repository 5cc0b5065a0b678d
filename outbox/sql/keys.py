"""Statements on `outbox.idempotency_keys` (see docs/architecture.md, "Idempotency keys")."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, bindparam, text
from sqlalchemy.dialects.postgresql import JSONB

_NOW = "coalesce(CAST(:now AS timestamptz), now())"


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


_TRY_LOCK = text("SELECT pg_try_advisory_xact_lock(:lock_id)")


def try_lock_key(conn: Connection, lock_id: int) -> bool:
    """Take the key's advisory lock for this transaction without waiting."""
    return bool(conn.execute(_TRY_LOCK, {"lock_id": lock_id}).scalar_one())


_SET_LOCK_TIMEOUT = text("SELECT set_config('lock_timeout', :timeout, true)")


def set_local_lock_timeout(conn: Connection, milliseconds: int) -> None:
    """Bound lock waits for the rest of this transaction (F10: 409, never a hang)."""
    conn.execute(_SET_LOCK_TIMEOUT, {"timeout": f"{int(milliseconds)}ms"})


_GET = text(
    f"""
    SELECT status, fingerprint, lock_token, {_NOW} - locked_at AS age,
           coalesce(lock_expires_at <= {_NOW}, false) AS lock_expired, generation,
           response_status, response_headers, response_body
      FROM outbox.idempotency_keys
     WHERE scope = :scope AND key = :key
    """
)


def get_key(conn: Connection, scope: str, key: str, now: datetime | None = None) -> KeyRow | None:
    row = conn.execute(_GET, {"scope": scope, "key": key, "now": now}).one_or_none()
    if row is None:
        return None
    body = row.response_body
    return KeyRow(
        status=row.status,
        fingerprint=row.fingerprint,
        lock_token=row.lock_token,
        age=row.age,
        lock_expired=row.lock_expired,
        generation=row.generation,
        response_status=row.response_status,
        response_headers=row.response_headers,
        response_body=bytes(body) if body is not None else None,
    )


_JSON_HEADERS = bindparam("headers", type_=JSONB)

_INSERT_COMPLETED = text(
    f"""
    INSERT INTO outbox.idempotency_keys
           (scope, key, fingerprint, status, response_status, response_headers,
            response_body, created_at, completed_at, expires_at, generation)
    VALUES (:scope, :key, :fingerprint, 'completed', :status, :headers, :body,
            {_NOW}, {_NOW}, {_NOW} + make_interval(secs => :retention), :generation)
    ON CONFLICT (scope, key) DO NOTHING
    RETURNING 1
    """
).bindparams(_JSON_HEADERS)


def insert_completed_key(
    conn: Connection,
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
) -> bool:
    """Atomic mode's single write; False if a row appeared (the unique backstop)."""
    params: dict[str, Any] = {
        "scope": scope, "key": key, "fingerprint": fingerprint, "status": status,
        "headers": headers, "body": body, "retention": retention_seconds,
        "generation": generation, "now": now,
    }
    return conn.execute(_INSERT_COMPLETED, params).first() is not None


_CLAIM = text(
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
    conn: Connection,
    *,
    scope: str,
    key: str,
    fingerprint: str,
    token: uuid.UUID,
    ttl_seconds: float,
    retention_seconds: float,
    generation: uuid.UUID,
    now: datetime | None = None,
) -> bool:
    """Phased mode: insert a `processing` claim; False if the key already exists.

    `ttl_seconds` is stored with the claim (`lock_expires_at`): how long its holder may
    take is the holder's setting, and every retaker and `outbox status` reads it there.
    """
    params = {
        "scope": scope, "key": key, "fingerprint": fingerprint, "token": token,
        "ttl": ttl_seconds, "retention": retention_seconds, "generation": generation,
        "now": now,
    }
    return conn.execute(_CLAIM, params).first() is not None


_TAKE_OVER = text(
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
    conn: Connection,
    *,
    scope: str,
    key: str,
    token: uuid.UUID,
    ttl_seconds: float,
    now: datetime | None = None,
) -> tuple[bool, uuid.UUID | None]:
    """Fenced takeover of an expired claim: exactly one racing retaker gets True.

    Also returns the record's generation: the retaken request keeps its effect keys.
    """
    params = {"scope": scope, "key": key, "token": token, "ttl": ttl_seconds, "now": now}
    row = conn.execute(_TAKE_OVER, params).first()
    return (row is not None, row.generation if row is not None else None)


_COMPLETE = text(
    f"""
    UPDATE outbox.idempotency_keys
       SET status = 'completed', lock_token = NULL, locked_at = NULL, lock_expires_at = NULL,
           response_status = :status, response_headers = :headers, response_body = :body,
           completed_at = {_NOW}
     WHERE scope = :scope AND key = :key AND status = 'processing' AND lock_token = :token
    RETURNING 1
    """
).bindparams(_JSON_HEADERS)


def complete_claimed_key(
    conn: Connection,
    *,
    scope: str,
    key: str,
    token: uuid.UUID,
    status: int,
    headers: list[list[str]],
    body: bytes,
    now: datetime | None = None,
) -> bool:
    """Phased mode: store the response iff we still hold the claim (the fence)."""
    params: dict[str, Any] = {
        "scope": scope, "key": key, "token": token, "status": status,
        "headers": headers, "body": body, "now": now,
    }
    return conn.execute(_COMPLETE, params).first() is not None


_RELEASE = text(
    """
    DELETE FROM outbox.idempotency_keys
     WHERE scope = :scope AND key = :key AND status = 'processing' AND lock_token = :token
    RETURNING 1
    """
)


def release_key(conn: Connection, *, scope: str, key: str, token: uuid.UUID) -> bool:
    """Drop our own claim so the client's retry runs at once (never someone else's)."""
    params = {"scope": scope, "key": key, "token": token}
    return conn.execute(_RELEASE, params).first() is not None


_PURGE_EXPIRED = text(
    f"""
    DELETE FROM outbox.idempotency_keys
     WHERE ctid = ANY(ARRAY(
           SELECT ctid FROM outbox.idempotency_keys
            WHERE expires_at < {_NOW} AND status = 'completed'
            LIMIT :batch))
       AND status = 'completed'
    """
)


def purge_expired_keys(conn: Connection, batch: int, now: datetime | None = None) -> int:
    """Delete up to `batch` completed keys past retention; a purged key may run again.

    Never a `processing` claim (F11), however old: its work may still commit, and
    deleting it would let a retry run the request a second time. A crashed claim is
    taken over by the next retry after its TTL instead. The status test is repeated on
    the DELETE because READ COMMITTED re-checks only the DELETE's own WHERE.
    """
    return conn.execute(_PURGE_EXPIRED, {"batch": batch, "now": now}).rowcount


_COUNT_BY_STATUS = text(
    f"""
    SELECT status, count(*) AS n,
           count(*) FILTER (WHERE status = 'processing'
                            AND lock_expires_at <= {_NOW}) AS stale
      FROM outbox.idempotency_keys GROUP BY status
    """
)


def count_keys(conn: Connection, now: datetime | None = None) -> dict[str, int]:
    """Keys by status, plus `stale_processing`: claims past their holder's own TTL."""
    out: dict[str, int] = {"processing": 0, "completed": 0, "stale_processing": 0}
    for row in conn.execute(_COUNT_BY_STATUS, {"now": now}):
        out[row.status] = row.n
        out["stale_processing"] += row.stale
    return out
