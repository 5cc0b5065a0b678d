"""A generation per idempotency-key record: effect keys derive from it.

A key purged and then reused starts a new generation, so its effects get new effect
keys (the old rows, or the receiver's memory of the old key, cannot swallow them); a
take-over of a crashed claim keeps the generation, so a retried request still
enqueues the same effect keys.

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


def downgrade() -> None:
    op.drop_column("idempotency_keys", "generation", schema="outbox")
