"""When an effect was first claimed: the earliest its receiver can have seen its key.

`Registry.register(kind, ..., key_retention=)` says how long the receiver remembers an
Idempotency-Key (Stripe: 24 h). No attempt of such an effect is sent later than 90 %
of that after its first claim (dispatcher/executor.py, F24): past it, the receiver
may have forgotten the key and would apply the effect again.

`first_claimed_at` is set by the claim that first takes the row (the database's
clock) and kept by every later claim, lease rescue, bulk redrive and retry; only
`outbox retry <id>` of an effect parked because the retention had passed clears it,
so its next attempt counts as a first contact. Counting from the first claim rather
than `created_at` keeps a delayed or backlogged effect's retries. No index: the
claim's UPDATE is not HOT anyway, and nothing looks rows up by it.

A row attempted without it (before this revision, or by a worker of the previous
release during a rolling deploy) gets `created_at` at its next claim: earlier than any
real first contact, so never late. Dead letters and parked rows get it here, through
the console's partial index (they are few; pending and in-flight rows are left to
their next claim): a bulk redrive resets their attempts. Nullable, no default: adding
it rewrites nothing.

Deploy order: migrate before deploying code that claims with it.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05
"""

from __future__ import annotations

from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE outbox.effects ADD COLUMN first_claimed_at timestamptz")
    op.execute("UPDATE outbox.effects SET first_claimed_at = created_at"
               " WHERE status IN ('failed', 'needs_review') AND attempts > 0")


def downgrade() -> None:
    op.execute("ALTER TABLE outbox.effects DROP COLUMN first_claimed_at")
