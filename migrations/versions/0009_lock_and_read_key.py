"""The atomic guard's lock and key read in one round trip (issue 11).

The atomic guard took the key's advisory lock and then read the key in two statements:
in one statement the read's snapshot would predate its lock, and a twin that committed
in between would run the request again (tried and reverted in session 3). A VOLATILE
function gets a fresh snapshot for each query it runs (READ COMMITTED), so the read it
makes after taking the lock sees every twin that committed before the lock was ours:
the same protocol, one round trip instead of two.

It returns no row when the lock is ours and the key is new, one row with
`locked = false` when a twin holds the lock, and the key's row (`locked = true`) when
the key exists. `p_now` is the injectable clock (NULL: the database's now()).

SECURITY INVOKER (the default): it reads what its caller may read. At REPEATABLE READ
its query runs on the transaction's snapshot, as the two statements did; the guard's
completing INSERT ... ON CONFLICT is the backstop there (outbox/_idempotency.py).

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

from __future__ import annotations

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

_LOCK_AND_READ = """
CREATE FUNCTION outbox.lock_and_read_key(p_lock_id bigint, p_scope text, p_key text,
                                         p_now timestamptz)
RETURNS TABLE (locked boolean, status text, fingerprint text, lock_token uuid,
               age interval, lock_expired boolean, generation uuid, response_status integer,
               response_headers jsonb, response_body bytea)
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    v_now timestamptz := coalesce(p_now, now());
BEGIN
    IF NOT pg_try_advisory_xact_lock(p_lock_id) THEN
        locked := false;
        RETURN NEXT;
        RETURN;
    END IF;
    -- A query of its own: a snapshot taken now, after the lock is ours.
    RETURN QUERY
        SELECT true, k.status, k.fingerprint, k.lock_token, v_now - k.locked_at,
               coalesce(k.lock_expires_at <= v_now, false), k.generation,
               k.response_status, k.response_headers, k.response_body
          FROM outbox.idempotency_keys k
         WHERE k.scope = p_scope AND k.key = p_key;
END $$
"""


def upgrade() -> None:
    op.execute(_LOCK_AND_READ)


def downgrade() -> None:
    op.execute("DROP FUNCTION outbox.lock_and_read_key(bigint, text, text, timestamptz)")
