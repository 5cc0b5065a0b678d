"""Idempotency keys, effects (the outbox), attempts and the inbox.

Revision ID: 0001
Revises:
Create Date: 2026-11-29
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql as pg

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

S = "outbox"
TS = sa.DateTime(timezone=True)
NOW = sa.text("now()")


def upgrade() -> None:
    op.execute(f"CREATE SCHEMA IF NOT EXISTS {S}")
    op.create_table(
        "idempotency_keys",
        sa.Column("scope", sa.Text, nullable=False),
        sa.Column("key", sa.Text, nullable=False),
        sa.Column("fingerprint", sa.Text, nullable=False),
        sa.Column("status", sa.Text, nullable=False),
        sa.Column("lock_token", pg.UUID(as_uuid=True)),
        sa.Column("locked_at", TS),
        sa.Column("response_status", sa.Integer),
        sa.Column("response_headers", pg.JSONB),
        sa.Column("response_body", sa.LargeBinary),
        sa.Column("created_at", TS, nullable=False, server_default=NOW),
        sa.Column("completed_at", TS),
        sa.Column("expires_at", TS, nullable=False),
        sa.PrimaryKeyConstraint("scope", "key", name="idempotency_keys_pkey"),
        sa.CheckConstraint("status IN ('processing', 'completed')",
                           name="idempotency_keys_status_check"),
        sa.CheckConstraint("length(key) BETWEEN 1 AND 255",
                           name="idempotency_keys_key_length_check"),
        sa.CheckConstraint(
            "(status = 'processing' AND lock_token IS NOT NULL AND locked_at IS NOT NULL"
            " AND response_status IS NULL AND completed_at IS NULL)"
            " OR (status = 'completed' AND response_status IS NOT NULL"
            " AND completed_at IS NOT NULL)",
            name="idempotency_keys_status_columns_check",
        ),
        schema=S,
    )
    op.create_index("idempotency_keys_expires_at_idx", "idempotency_keys", ["expires_at"],
                    schema=S)

    op.create_table(
        "effects",
        sa.Column("id", sa.BigInteger, sa.Identity(always=False), primary_key=True),
        sa.Column("effect_key", sa.Text, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("payload", pg.JSONB, nullable=False),
        sa.Column("headers", pg.JSONB, nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("ordering_key", sa.Text),
        sa.Column("queue", sa.Text, nullable=False, server_default=sa.text("'default'")),
        sa.Column("status", sa.Text, nullable=False, server_default=sa.text("'pending'")),
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("max_attempts", sa.Integer, nullable=False, server_default=sa.text("25")),
        sa.Column("available_at", TS, nullable=False, server_default=NOW),
        sa.Column("retry_until", TS),
        sa.Column("lease_owner", sa.Text),
        sa.Column("lease_token", pg.UUID(as_uuid=True)),
        sa.Column("lease_expires_at", TS),
        sa.Column("created_at", TS, nullable=False, server_default=NOW),
        sa.Column("delivered_at", TS),
        sa.Column("finished_at", TS),
        sa.Column("last_error", sa.Text),
        sa.Column("result", pg.JSONB),
        sa.PrimaryKeyConstraint("id", name="effects_pkey"),
        sa.UniqueConstraint("effect_key", name="effects_effect_key_key"),
        sa.CheckConstraint(
            "status IN ('pending', 'in_flight', 'delivered', 'failed', 'cancelled',"
            " 'needs_review')",
            name="effects_status_check"),
        sa.CheckConstraint("length(effect_key) BETWEEN 1 AND 255",
                           name="effects_effect_key_length_check"),
        sa.CheckConstraint("attempts >= 0 AND max_attempts >= 1", name="effects_attempts_check"),
        sa.CheckConstraint(
            "(status = 'in_flight') = (lease_token IS NOT NULL)"
            " AND (lease_token IS NULL) = (lease_expires_at IS NULL)"
            " AND (lease_token IS NULL) = (lease_owner IS NULL)",
            name="effects_lease_iff_in_flight_check"),
        sa.CheckConstraint("(status = 'delivered') = (delivered_at IS NOT NULL)",
                           name="effects_delivered_at_check"),
        sa.CheckConstraint(
            "(status IN ('delivered', 'failed', 'cancelled', 'needs_review'))"
            " = (finished_at IS NOT NULL)",
            name="effects_finished_at_check"),
        schema=S,
    )
    # A queue table: leave room on each page for HOT updates of the same row, and
    # vacuum after 1% churn instead of the default 20%.
    op.execute(
        f"ALTER TABLE {S}.effects SET (fillfactor = 80,"
        " autovacuum_vacuum_scale_factor = 0.01,"
        " autovacuum_vacuum_insert_scale_factor = 0.01,"
        " autovacuum_analyze_scale_factor = 0.02,"
        " autovacuum_vacuum_cost_delay = 1)"
    )
    op.create_index("effects_pending_idx", "effects", ["queue", "available_at", "id"],
                    schema=S, postgresql_where=sa.text("status = 'pending'"))
    op.create_index("effects_in_flight_idx", "effects", ["queue"], schema=S,
                    postgresql_where=sa.text("status = 'in_flight'"))
    op.create_index(
        "effects_ordering_idx", "effects", ["ordering_key", "id"], schema=S,
        postgresql_where=sa.text(
            "ordering_key IS NOT NULL"
            " AND status IN ('pending', 'in_flight', 'failed', 'needs_review')"))
    op.create_index("effects_finished_at_idx", "effects", ["finished_at"], schema=S,
                    postgresql_where=sa.text("finished_at IS NOT NULL"))

    op.create_table(
        "attempts",
        sa.Column("id", sa.BigInteger, sa.Identity(always=False), primary_key=True),
        sa.Column("effect_id", sa.BigInteger, nullable=False),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("worker", sa.Text, nullable=False),
        sa.Column("started_at", TS, nullable=False),
        sa.Column("finished_at", TS, nullable=False, server_default=NOW),
        sa.Column("outcome", sa.Text, nullable=False),
        sa.Column("http_status", sa.Integer),
        sa.Column("error", sa.Text),
        sa.Column("trace_id", sa.Text),
        sa.PrimaryKeyConstraint("id", name="attempts_pkey"),
        sa.ForeignKeyConstraint(["effect_id"], [f"{S}.effects.id"], ondelete="CASCADE",
                                name="attempts_effect_id_fkey"),
        sa.CheckConstraint(
            "outcome IN ('delivered', 'retry', 'failed', 'lease_lost', 'ambiguous')",
            name="attempts_outcome_check"),
        schema=S,
    )
    op.create_index("attempts_effect_id_idx", "attempts", ["effect_id", "attempt"], schema=S)

    op.create_table(
        "inbox",
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("event_id", sa.Text, nullable=False),
        sa.Column("fingerprint", sa.Text, nullable=False),
        sa.Column("version", sa.BigInteger),
        sa.Column("entity", sa.Text),
        sa.Column("payload", pg.JSONB, nullable=False),
        sa.Column("received_at", TS, nullable=False, server_default=NOW),
        sa.Column("processed_at", TS),
        sa.Column("duplicates", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("conflicts", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.PrimaryKeyConstraint("source", "event_id", name="inbox_pkey"),
        sa.CheckConstraint("length(event_id) BETWEEN 1 AND 255",
                           name="inbox_event_id_length_check"),
        sa.CheckConstraint("length(source) BETWEEN 1 AND 255", name="inbox_source_length_check"),
        sa.CheckConstraint("version IS NULL OR version >= 0", name="inbox_version_check"),
        schema=S,
    )
    op.create_index("inbox_received_at_idx", "inbox", ["received_at"], schema=S)

    op.create_table(
        "inbox_conflicts",
        sa.Column("id", sa.BigInteger, sa.Identity(always=False), primary_key=True),
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("event_id", sa.Text, nullable=False),
        sa.Column("fingerprint", sa.Text, nullable=False),
        sa.Column("payload", pg.JSONB, nullable=False),
        sa.Column("received_at", TS, nullable=False, server_default=NOW),
        sa.PrimaryKeyConstraint("id", name="inbox_conflicts_pkey"),
        schema=S,
    )
    op.create_index("inbox_conflicts_source_idx", "inbox_conflicts", ["source", "event_id"],
                    schema=S)

    op.create_table(
        "entity_versions",
        sa.Column("source", sa.Text, nullable=False),
        sa.Column("entity", sa.Text, nullable=False),
        sa.Column("version", sa.BigInteger, nullable=False),
        sa.Column("event_id", sa.Text, nullable=False),
        sa.Column("fingerprint", sa.Text, nullable=False),
        sa.Column("updated_at", TS, nullable=False, server_default=NOW),
        sa.PrimaryKeyConstraint("source", "entity", name="entity_versions_pkey"),
        sa.CheckConstraint("version >= 0", name="entity_versions_version_check"),
        schema=S,
    )


def downgrade() -> None:
    for table in ("entity_versions", "inbox_conflicts", "inbox", "attempts", "effects",
                  "idempotency_keys"):
        op.drop_table(table, schema=S)
