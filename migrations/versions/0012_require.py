"""`outbox.require(ok, code, what)`: a statement refuses, so the COMMIT after it is not run.

Issue 11 ("one commit, fewer round trips"). `IdempotencyGuard.run` owns its transaction,
so it sends the COMMIT in the same round trip as its last statement, the key's write
with the request's deferred effects (libpq pipeline mode: outbox/_driver.py). The
COMMIT must then run only if that write is the plain case: the key written (no twin's
row, the phased claim still ours) and every effect new. Anything else needs the guard's
answer (a replay, ClaimLost, a duplicate effect or EffectKeyConflict) before anything
commits. So the pipelined form of the statement calls `outbox.require` on that
condition: false or null raises SQLSTATE OB001, the transaction is aborted, PostgreSQL
skips the COMMIT, and the guard runs the request again with the write and the COMMIT
apart, where its usual checks decide (docs/architecture.md, "Round trips").

Deploy order: migrate before deploying code that calls it.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

_REQUIRE = """
CREATE FUNCTION outbox.require(p_ok boolean, p_code text, p_what text) RETURNS boolean
LANGUAGE plpgsql VOLATILE SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF p_ok THEN
        RETURN true;
    END IF;
    RAISE EXCEPTION USING ERRCODE = p_code, MESSAGE = 'outbox: not committed: ' || p_what;
END $$
"""


def upgrade() -> None:
    op.execute(_REQUIRE)


def downgrade() -> None:
    op.execute("DROP FUNCTION outbox.require(boolean, text, text)")
