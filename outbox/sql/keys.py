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
        response_status=row.response_status,
        response_headers=row.response_headers,
        response_body=bytes(body) if body is not None else None,
    )


_JSON_HEADERS = bindparam("headers", type_=JSONB)

_INSERT_COMPLETED = text(
    f"""
    INSERT INTO outbox.idempotency_keys
           (scope, key, fingerprint, status, response_status, response_headers,
            response_body, created_at, completed_at, expires_at)
    VALUES (:scope, :key, :fingerprint, 'completed', :status, :headers, :body,
            {_NOW}, {_NOW}, {_NOW} + make_interval(secs => :retention))
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
    now: datetime | None = None,
) -> bool:
    """Atomic mode's single write; False if a row appeared (the unique backstop)."""
    params: dict[str, Any] = {
        "scope": scope, "key": key, "fingerprint": fingerprint, "status": status,
        "headers": headers, "body": body, "retention": retention_seconds, "now": now,
    }
    return conn.execute(_INSERT_COMPLETED, params).first() is not None


_CLAIM = text(
    f"""
    INSERT INTO outbox.idempotency_keys
           (scope, key, fingerprint, status, lock_token, locked_at, created_at, expires_at)
    VALUES (:scope, :key, :fingerprint, 'processing', :token, {_NOW}, {_NOW},
            {_NOW} + make_interval(secs => :retention))
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
    retention_seconds: float,
    now: datetime | None = None,
) -> bool:
    """Phased mode: insert a `processing` claim; False if the key already exists."""
    params = {
        "scope": scope, "key": key, "fingerprint": fingerprint, "token": token,
        "retention": retention_seconds, "now": now,
    }
    return conn.execute(_CLAIM, params).first() is not None


_TAKE_OVER = text(
    f"""
    UPDATE outbox.idempotency_keys
       SET lock_token = :token, locked_at = {_NOW}
     WHERE scope = :scope AND key = :key
       AND status = 'processing'
       AND locked_at <= {_NOW} - make_interval(secs => :ttl)
    RETURNING 1
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
) -> bool:
    """Fenced takeover of an expired claim: exactly one racing retaker gets True."""
    params = {"scope": scope, "key": key, "token": token, "ttl": ttl_seconds, "now": now}
    return conn.execute(_TAKE_OVER, params).first() is not None


_COMPLETE = text(
    f"""
    UPDATE outbox.idempotency_keys
       SET status = 'completed', lock_token = NULL, locked_at = NULL,
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
            WHERE expires_at < {_NOW}
            LIMIT :batch))
    """
)


def purge_expired_keys(conn: Connection, batch: int, now: datetime | None = None) -> int:
    """Delete up to `batch` expired keys; a purged key may be processed again."""
    return conn.execute(_PURGE_EXPIRED, {"batch": batch, "now": now}).rowcount


_COUNT_BY_STATUS = text(
    f"""
    SELECT status, count(*) AS n,
           count(*) FILTER (WHERE status = 'processing'
                            AND locked_at <= {_NOW} - make_interval(secs => :ttl)) AS stale
      FROM outbox.idempotency_keys GROUP BY status
    """
)


def count_keys(conn: Connection, ttl_seconds: float, now: datetime | None = None
               ) -> dict[str, int]:
    """Keys by status, plus `stale_processing`: claims older than the TTL."""
    out: dict[str, int] = {"processing": 0, "completed": 0, "stale_processing": 0}
    for row in conn.execute(_COUNT_BY_STATUS, {"ttl": ttl_seconds, "now": now}):
        out[row.status] = row.n
        out["stale_processing"] += row.stale
    return out
