"""The web console: its indexes and the audit of its actions.

- `effects_console_idx` (status, id) INCLUDE (queue), only over pending, failed,
  needs_review and cancelled rows: the effect list pages through one status in id
  order, and the overview counts them, without touching the delivered bulk. In-flight
  rows (bounded by the workers' slots) and delivered ones get no entry, so a claim or
  a delivery writes nothing to it; an enqueue writes one entry.
- `attempts_finished_at_idx`, a BRIN index: attempts are appended in time order, so a
  few hundred bytes find the last hour's attempts for the per-minute chart.
- `idempotency_keys_processing_idx`: phased claims only (atomic mode never writes a
  `processing` row), for the stale-claim count and list.
- `console_actions`: one row per retry, cancel or redrive asked in the console (who,
  what, which ids it changed, done or refused).

Each index is created with IF NOT EXISTS: on a large, busy table build it first with
CREATE INDEX CONCURRENTLY under the same name (docs/console.md), then migrate.

Revision ID: 0004
Revises: 0002
Create Date: 2026-12-03
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

revision = "0004"
down_revision = "0002"
branch_labels = None
depends_on = None

S = "outbox"


def upgrade() -> None:
    op.create_index(
        "effects_console_idx", "effects", ["status", "id"], schema=S,
        postgresql_include=["queue"], if_not_exists=True,
        postgresql_where=sa.text(
            "status IN ('pending', 'failed', 'needs_review', 'cancelled')"))
    op.create_index(
        "attempts_finished_at_idx", "attempts", ["finished_at"], schema=S,
        postgresql_using="brin", postgresql_with={"pages_per_range": 32},
        if_not_exists=True)
    op.create_index(
        "idempotency_keys_processing_idx", "idempotency_keys", ["lock_expires_at"],
        schema=S, if_not_exists=True,
        postgresql_where=sa.text("status = 'processing'"))
    op.create_table(
        "console_actions",
        sa.Column("id", sa.BigInteger, sa.Identity(always=False), primary_key=True),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False,
                  server_default=sa.text("now()")),
        sa.Column("actor", sa.Text, nullable=False),
        sa.Column("action", sa.Text, nullable=False),
        sa.Column("outcome", sa.Text, nullable=False),
        sa.Column("effect_ids", pg.ARRAY(sa.BigInteger), nullable=False,
                  server_default=sa.text("'{}'::bigint[]")),
        sa.Column("request", pg.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.PrimaryKeyConstraint("id", name="console_actions_pkey"),
        sa.CheckConstraint("action IN ('retry', 'cancel', 'redrive')",
                           name="console_actions_action_check"),
        sa.CheckConstraint("outcome IN ('done', 'refused')",
                           name="console_actions_outcome_check"),
        schema=S,
    )


def downgrade() -> None:
    op.drop_table("console_actions", schema=S)
    op.drop_index("idempotency_keys_processing_idx", "idempotency_keys", schema=S)
    op.drop_index("attempts_finished_at_idx", "attempts", schema=S)
    op.drop_index("effects_console_idx", "effects", schema=S)
