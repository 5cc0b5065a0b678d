"""An effect's key and attempts go with it in one set-based delete per statement.

Issues 17 (retention beside the hot path) and 11 (enqueue cost). The two foreign keys
to `outbox.effects` (`effect_keys.effect_id`, `attempts.effect_id`, both ON DELETE
CASCADE) made PostgreSQL run its referential-integrity triggers once per row: at every
enqueue a `SELECT ... FOR KEY SHARE` of the new effect row (a lock record in the WAL),
and at every purged effect two more statements through SPI, one per referencing table.
Measured on 100k finished effects (PostgreSQL 15, this box): one purge batch of 100k
took 1.07-1.22 s with the foreign keys and 0.44-0.57 s with the statement-level
triggers below.

What replaces them keeps the guarantee that a key never outlives its effect, however the
effect goes (an attempt neither, with one exception below):

- AFTER DELETE ... FOR EACH STATEMENT with the deleted rows as a transition table: one
  DELETE of their keys and one of their attempts per statement (retention, `outbox
  purge`, a DELETE written by hand);
- AFTER TRUNCATE: truncating the effects truncates their keys and attempts (a foreign
  key refused a TRUNCATE of effects alone; now it does what the user meant). When the
  same TRUNCATE names them as well, PostgreSQL refuses a nested TRUNCATE of a table in
  use; the function then DELETEs what is left (nothing, or the table it did not name).

The functions are SECURITY DEFINER, as the foreign key's cascade ran as the owner of the
tables: a role allowed to delete effects need not be allowed to delete keys. So that
nobody else can use them, EXECUTE is revoked from PUBLIC (PostgreSQL checks it when a
trigger is created, not when it fires) and each refuses to run for another table.
The enqueue writes an effect and its key in the same statement (outbox/sql/effects.py),
so no key is ever written without its effect, and no insert needs a check. The one
attempt that can outlive its effect: a stale worker's lease_lost row, recorded while a
DELETE of that effect is under way (the record checks the effect exists, without a lock:
waiting behind an open DELETE would stall the worker's outcomes). It is an audit row of a
deleted effect; nothing is delivered twice or lost.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01
"""

from __future__ import annotations

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

S = "outbox"

_FREE = """
CREATE FUNCTION outbox.effects_deleted() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_RELID <> 'outbox.effects'::regclass THEN
        RAISE EXCEPTION 'outbox.effects_deleted() serves outbox.effects only';
    END IF;
    DELETE FROM outbox.effect_keys k USING gone g WHERE k.effect_id = g.id;
    DELETE FROM outbox.attempts a USING gone g WHERE a.effect_id = g.id;
    RETURN NULL;
END $$
"""

_TRUNCATED = """
CREATE FUNCTION outbox.effects_truncated() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF TG_RELID <> 'outbox.effects'::regclass THEN
        RAISE EXCEPTION 'outbox.effects_truncated() serves outbox.effects only';
    END IF;
    TRUNCATE outbox.effect_keys, outbox.attempts;
    RETURN NULL;
EXCEPTION WHEN object_in_use THEN
    -- The same TRUNCATE named them too (`TRUNCATE effects, effect_keys, attempts`),
    -- so they are empty already; what it did not name, this empties.
    DELETE FROM outbox.effect_keys;
    DELETE FROM outbox.attempts;
    RETURN NULL;
END $$
"""


def upgrade() -> None:
    op.drop_constraint("effect_keys_effect_id_fkey", "effect_keys", schema=S,
                       type_="foreignkey")
    op.drop_constraint("attempts_effect_id_fkey", "attempts", schema=S, type_="foreignkey")
    op.execute(_FREE)
    op.execute(_TRUNCATED)
    # EXECUTE is checked when a trigger is created, not when it fires: left to PUBLIC,
    # any role could hang these owner-privileged functions on a table of its own and
    # empty the key table (reviewed). Nobody but the owner needs it; the triggers fire
    # for every role that deletes or truncates effects.
    op.execute("REVOKE EXECUTE ON FUNCTION outbox.effects_deleted() FROM PUBLIC")
    op.execute("REVOKE EXECUTE ON FUNCTION outbox.effects_truncated() FROM PUBLIC")
    op.execute("CREATE TRIGGER effects_deleted AFTER DELETE ON outbox.effects"
               " REFERENCING OLD TABLE AS gone FOR EACH STATEMENT"
               " EXECUTE FUNCTION outbox.effects_deleted()")
    op.execute("CREATE TRIGGER effects_truncated AFTER TRUNCATE ON outbox.effects"
               " FOR EACH STATEMENT EXECUTE FUNCTION outbox.effects_truncated()")


def downgrade() -> None:
    op.execute("DROP TRIGGER effects_truncated ON outbox.effects")
    op.execute("DROP TRIGGER effects_deleted ON outbox.effects")
    op.execute("DROP FUNCTION outbox.effects_truncated()")
    op.execute("DROP FUNCTION outbox.effects_deleted()")
    # Rows that lost their effect while no key bound them would fail the constraints.
    op.execute("DELETE FROM outbox.effect_keys k WHERE NOT EXISTS"
               " (SELECT 1 FROM outbox.effects e WHERE e.id = k.effect_id)")
    op.execute("DELETE FROM outbox.attempts a WHERE NOT EXISTS"
               " (SELECT 1 FROM outbox.effects e WHERE e.id = a.effect_id)")
    op.create_foreign_key("attempts_effect_id_fkey", "attempts", "effects", ["effect_id"],
                          ["id"], source_schema=S, referent_schema=S, ondelete="CASCADE")
    op.create_foreign_key("effect_keys_effect_id_fkey", "effect_keys", "effects",
                          ["effect_id"], ["id"], source_schema=S, referent_schema=S,
                          ondelete="CASCADE")
