"""The business identity of a request, to notice the same request under another key.

`idempotency_keys.business_hash` holds a hash of what the application declared makes
two requests "the same business request" (`IdempotencyGuard(same_request=...)`; for a
payment, say, customer + amount + currency). The statement that writes a key also looks
for another key of the same scope with the same hash within a window, and reports it
(metric, span event, optional header and log line) without ever refusing the request:
a client that makes up a new key for every retry defeats idempotency, and nothing else
would tell anyone. NULL when the application declared nothing (the default).

`idempotency_keys_business_idx` (scope, business_hash, created_at) covers only rows with
a hash, so requests without one write no entry; the look-up reads the newest entries of
one (scope, hash) and stops at a cap.

The index is created with IF NOT EXISTS: on a large, busy table build it first with
CREATE INDEX CONCURRENTLY under the same name, then migrate.

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-05
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

S = "outbox"


def upgrade() -> None:
    op.add_column("idempotency_keys", sa.Column("business_hash", sa.Text), schema=S)
    op.create_index(
        "idempotency_keys_business_idx", "idempotency_keys",
        ["scope", "business_hash", "created_at"], schema=S, if_not_exists=True,
        postgresql_where=sa.text("business_hash IS NOT NULL"))


def downgrade() -> None:
    op.drop_index("idempotency_keys_business_idx", "idempotency_keys", schema=S)
    op.drop_column("idempotency_keys", "business_hash", schema=S)
