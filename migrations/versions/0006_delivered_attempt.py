"""A delivered attempt is recorded on the effect row, not as an attempts row.

Issue 11 ("write less per effect on the success path") and 17 (the history's weight).
Recording a delivery made two writes: the effect row's UPDATE and an INSERT into
`outbox.attempts` (a heap tuple and two index entries). The delivered attempt is now
kept in four columns of the effect row the record UPDATE writes anyway
(`delivered_by`, `delivered_started_at`, `delivered_http_status`,
`delivered_trace_id`); `outbox.attempts` keeps every other attempt (retries,
failures, ambiguous outcomes, lost leases). Delivery is terminal (nothing requeues a
delivered effect), so one set of columns holds it.

`outbox.attempt_history` is the whole history as before: `outbox.attempts` and, for each
delivered effect recorded this way, its delivered attempt (id = -effect id, so ids stay
unique). `outbox trace`, the console, the Django admin and the example read it. Effects
delivered before this migration keep their attempts rows (delivered_by NULL).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

S = "outbox"

# The whole history of attempts (docs/architecture.md); read by `outbox trace`, the
# console, the Django admin and the tests.
VIEW = """
CREATE VIEW outbox.attempt_history AS
SELECT id, effect_id, attempt, worker, started_at, finished_at, outcome, http_status,
       error, trace_id
  FROM outbox.attempts
UNION ALL
SELECT -e.id, e.id, e.attempts, e.delivered_by, e.delivered_started_at, e.finished_at,
       'delivered', e.delivered_http_status, NULL, e.delivered_trace_id
  FROM outbox.effects e
 WHERE e.delivered_by IS NOT NULL
"""


def upgrade() -> None:
    # Nullable columns with no default: a catalog change only, no table rewrite.
    op.add_column("effects", sa.Column("delivered_by", sa.Text), schema=S)
    op.add_column("effects", sa.Column("delivered_started_at", sa.DateTime(timezone=True)),
                  schema=S)
    op.add_column("effects", sa.Column("delivered_http_status", sa.Integer), schema=S)
    op.add_column("effects", sa.Column("delivered_trace_id", sa.Text), schema=S)
    # Every existing row passes (delivered_by is new and NULL). The migration runs in one
    # transaction, so the validating scan runs under the ADD COLUMN's exclusive lock:
    # writers wait about a second per million effects (NOT VALID alone would skip the
    # scan, but Alembic's reflection of a NOT VALID check breaks `alembic check`).
    op.execute("ALTER TABLE outbox.effects ADD CONSTRAINT effects_delivered_attempt_check"
               " CHECK (delivered_by IS NULL OR (status = 'delivered'"
               " AND delivered_started_at IS NOT NULL)) NOT VALID")
    op.execute("ALTER TABLE outbox.effects VALIDATE CONSTRAINT"
               " effects_delivered_attempt_check")
    op.execute(VIEW)


def downgrade() -> None:
    op.execute("DROP VIEW outbox.attempt_history")
    # The delivered attempts recorded on effect rows go back to outbox.attempts.
    op.execute("INSERT INTO outbox.attempts (effect_id, attempt, worker, started_at,"
               " finished_at, outcome, http_status, trace_id)"
               " SELECT id, attempts, delivered_by, delivered_started_at, finished_at,"
               " 'delivered', delivered_http_status, delivered_trace_id"
               " FROM outbox.effects WHERE delivered_by IS NOT NULL")
    op.execute("ALTER TABLE outbox.effects DROP CONSTRAINT effects_delivered_attempt_check")
    for column in ("delivered_trace_id", "delivered_http_status", "delivered_started_at",
                   "delivered_by"):
        op.drop_column("effects", column, schema=S)
