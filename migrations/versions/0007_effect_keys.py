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

`effect_keys.effect_id` references `effects.id` ON DELETE CASCADE: a key never outlives
its effect, however the effect goes (retention, a hand-written DELETE), so a key can
always be enqueued again once its effect is gone. The foreign key is checked at the end
of the enqueue statement (after the effect row is in) and at deletes; the claim and the
record do not change `id` and never fire it.

Deploying it: stop the processes of the previous version that enqueue or purge first
(their `ON CONFLICT (effect_key)` has no index to match after this revision), then
migrate, then start the new version. The migration takes SHARE ROW EXCLUSIVE on
`outbox.effects` before copying the keys, so no effect can be written between the copy
and the drop of the old unique index; enqueues and dispatchers wait for the migration
(the copy is one pass over the table: about a second per million effects here).

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
    # No writer may slip an effect in between the copy and the drop (reviewed: without
    # the lock a key written meanwhile had no effect_keys row, and could be enqueued
    # twice). Readers go on.
    op.execute("LOCK TABLE outbox.effects IN SHARE ROW EXCLUSIVE MODE")
    op.create_table(
        "effect_keys",
        sa.Column("effect_key", sa.Text, nullable=False),
        sa.Column("effect_id", sa.BigInteger, nullable=False),
        sa.PrimaryKeyConstraint("effect_key", name="effect_keys_pkey"),
        sa.ForeignKeyConstraint(["effect_id"], [f"{S}.effects.id"], ondelete="CASCADE",
                                name="effect_keys_effect_id_fkey"),
        sa.CheckConstraint("length(effect_key) BETWEEN 1 AND 255",
                           name="effect_keys_effect_key_length_check"),
        schema=S,
    )
    op.execute("INSERT INTO outbox.effect_keys (effect_key, effect_id)"
               " SELECT effect_key, id FROM outbox.effects")
    # The cascade from effects, and the console's key filter probing by effect.
    op.create_index("effect_keys_effect_id_idx", "effect_keys", ["effect_id"], schema=S)
    op.drop_constraint("effects_effect_key_key", "effects", schema=S, type_="unique")


def downgrade() -> None:
    op.create_unique_constraint("effects_effect_key_key", "effects", ["effect_key"],
                                schema=S)
    op.drop_table("effect_keys", schema=S)
