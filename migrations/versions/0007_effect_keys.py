"""Effect keys are unique in a table of their own, written once per effect.

Issue 17 ("a history that does not tax the hot path") and 11. The unique index on
`outbox.effects.effect_key` took a new entry at every update of an effect row: the
claim and the record are not HOT updates (`status` is in the partial indexes'
predicates), so each wrote one more entry into the largest index of the table, at a
random place (keys are random), and with millions of finished rows that index no
longer fits in memory: the hot path read and dirtied a random page of it twice per
effect. `outbox.effect_keys (effect_key PRIMARY KEY, effect_id)` is now the arbiter of
uniqueness: enqueue inserts the key there (ON CONFLICT DO NOTHING, as before, one
statement) and the effect row only for a new key, with the id it reserved; the claim and
the record touch no key index at all. Retention deletes an effect's key with it.

`effects.effect_key` stays (what every reader shows); lookups by key go through
`effect_keys` (trace, the console's key-prefix filter, the enqueue's conflict check).

The backfill copies every existing key (one pass over the table: on a large, busy
outbox run it at a quiet time). The old unique index is dropped at the end.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

S = "outbox"


def upgrade() -> None:
    op.create_table(
        "effect_keys",
        sa.Column("effect_key", sa.Text, nullable=False),
        sa.Column("effect_id", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("effect_key", name="effect_keys_pkey"),
        sa.CheckConstraint("length(effect_key) BETWEEN 1 AND 255",
                           name="effect_keys_effect_key_length_check"),
        schema=S,
    )
    op.execute("INSERT INTO outbox.effect_keys (effect_key, effect_id)"
               " SELECT effect_key, id FROM outbox.effects")
    op.drop_constraint("effects_effect_key_key", "effects", schema=S, type_="unique")


def downgrade() -> None:
    op.create_unique_constraint("effects_effect_key_key", "effects", ["effect_key"],
                                schema=S)
    op.drop_table("effect_keys", schema=S)
