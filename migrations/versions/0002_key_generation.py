"""Idempotency-key records: a generation (effect keys derive from it) and a claim TTL.

A key purged and then reused starts a new generation, so its effects get new effect
keys (the old rows, or the receiver's memory of the old key, cannot swallow them); a
take-over of a crashed claim keeps the generation, so a retried request still
enqueues the same effect keys.

`lock_expires_at` stores the TTL a phased claim was taken with: take-overs, the stale
key gauge and `outbox status` read the claim's own deadline instead of assuming one.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Rows written before this migration keep a NULL generation: their effects were
    # keyed without one, and a retry of such a request must still derive those keys.
    op.add_column("idempotency_keys", sa.Column("generation", pg.UUID(as_uuid=True)),
                  schema="outbox")
    op.add_column("idempotency_keys", sa.Column("lock_expires_at", sa.DateTime(timezone=True)),
                  schema="outbox")
    # Claims taken before this migration: the guard's default TTL (60 s).
    op.execute("UPDATE outbox.idempotency_keys SET lock_expires_at = locked_at + interval '60 s'"
               " WHERE status = 'processing'")
    op.drop_constraint("idempotency_keys_status_columns_check", "idempotency_keys",
                       schema="outbox", type_="check")
    op.create_check_constraint(
        "idempotency_keys_status_columns_check", "idempotency_keys",
        "(status = 'processing' AND lock_token IS NOT NULL AND locked_at IS NOT NULL"
        " AND lock_expires_at IS NOT NULL AND response_status IS NULL"
        " AND completed_at IS NULL)"
        " OR (status = 'completed' AND response_status IS NOT NULL"
        " AND completed_at IS NOT NULL AND lock_expires_at IS NULL)",
        schema="outbox")


def downgrade() -> None:
    op.drop_constraint("idempotency_keys_status_columns_check", "idempotency_keys",
                       schema="outbox", type_="check")
    op.create_check_constraint(
        "idempotency_keys_status_columns_check", "idempotency_keys",
        "(status = 'processing' AND lock_token IS NOT NULL AND locked_at IS NOT NULL"
        " AND response_status IS NULL AND completed_at IS NULL)"
        " OR (status = 'completed' AND response_status IS NOT NULL"
        " AND completed_at IS NOT NULL)",
        schema="outbox")
    op.drop_column("idempotency_keys", "lock_expires_at", schema="outbox")
    op.drop_column("idempotency_keys", "generation", schema="outbox")
