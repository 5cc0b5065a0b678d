"""The retention purger's lock: at most one purge at a time, whatever runs it.

Workers, Celery children and `outbox purge` may all decide to purge at once; the
deletes themselves would be safe in parallel (each batch is one short transaction), but
several purgers only multiply the load for the same result. A session-level advisory
lock, tried without waiting, on a connection the purger keeps for its whole run; a
purger that dies takes its lock with its session.

The two-int form lives apart from the one-bigint form the idempotency keys lock
(`keys.try_lock_key`), so the two can never collide.
"""

from __future__ import annotations

from sqlalchemy import Connection, text

# 'outb' and 16 (the issue that made retention run by itself).
LOCK_NAMESPACE = 0x6F757462
LOCK_ID = 16

_TRY_LOCK = text("SELECT pg_try_advisory_lock(CAST(:ns AS int4), CAST(:id AS int4))")
_UNLOCK = text("SELECT pg_advisory_unlock(CAST(:ns AS int4), CAST(:id AS int4))")


def try_lock_purger(conn: Connection) -> bool:
    """Take the purger lock for this session if no other session holds it."""
    return bool(conn.execute(_TRY_LOCK, {"ns": LOCK_NAMESPACE, "id": LOCK_ID}).scalar())


def unlock_purger(conn: Connection) -> bool:
    """Release the purger lock this session holds (False if it held none)."""
    return bool(conn.execute(_UNLOCK, {"ns": LOCK_NAMESPACE, "id": LOCK_ID}).scalar())
