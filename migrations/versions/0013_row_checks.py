"""Each state machine's rules in one CHECK that calls a PL/pgSQL function.

Issue 11. PostgreSQL rebuilds a table's CHECK expressions for every statement that
writes it: `ExecRelCheck` parses each stored expression (`stringToNode`) and plans it
(`ExecPrepareExpr`) before the first row. Nothing caches that across statements. For
`outbox.effects` (seven CHECKs) this was about 30 µs of server CPU per statement, and
for `outbox.idempotency_keys` (three) about 10. That is 14.6 % of PostgreSQL's CPU
under `bench/bench_guard_cpu.py` (perf, `ExecConstraints`), paid by every enqueue,
key write, claim and record.

The rules are unchanged and still enforced by the database. Each table now has one
CHECK, `effects_row_check` / `idempotency_keys_row_check`, calling
`outbox.effect_row_ok(...)` / `outbox.key_row_ok(...)`. The statement's part is then a
call node, and PL/pgSQL keeps the compiled rules for the session. Per row the call
costs about what the seven expressions did: the same at 100 rows per statement,
5-6 times less at one.

The functions have no `SET search_path`: a SET clause costs a GUC save and restore on
every call, 2.5 µs a row. Instead every function and operator in their bodies is
schema-qualified (`OPERATOR(pg_catalog.=)`, `_qualified` below), and so are the types
of its variables. A CHECK stores its
operators resolved; a PL/pgSQL body resolves them in the writing session, on that
session's search_path: unqualified, a role allowed to write the table and to create an
operator in a schema of its own could put that schema first and write rows the rules
refuse (reviewed; tests/test_schema.py). EXECUTE on both functions is granted to
PUBLIC explicitly: PostgreSQL checks it for every role that writes the table, and a
database that revokes EXECUTE from PUBLIC by default would otherwise stop every writer.

A row that breaks a rule raises check_violation (23514), as before; the message names
the constraint and the rule (the old constraint's name without the table's prefix).

Deploy: this migration checks every existing row once, holding ACCESS EXCLUSIVE on both
tables meanwhile (enqueues and claims wait), about a second per million effects here.
It locks them in the order a guarded request does (keys, then effects), so a request
waits for it instead of deadlocking with it. Code of the previous release runs
unchanged against it.

Changing a rule later: a new revision that drops the CHECK, replaces the function and
adds the CHECK again (so existing rows are checked); `CREATE OR REPLACE` alone would
check new writes only. A rule's column cannot change type while the function takes it.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-05
"""

from __future__ import annotations

import re

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

# (the rule's name, the CHECK it was before this revision, its text), in the order a
# refused row reports them (the first broken one).
_EFFECT_RULES = (
    ("status", "effects_effects_status_check_check",
     "status IN ('pending', 'in_flight', 'delivered', 'failed', 'cancelled',"
     " 'needs_review')"),
    ("effect_key_length", "effects_effects_effect_key_length_check_check",
     "pg_catalog.length(effect_key) BETWEEN 1 AND 255"),
    ("attempts", "effects_effects_attempts_check_check",
     "attempts >= 0 AND max_attempts >= 1"),
    ("lease_iff_in_flight", "effects_effects_lease_iff_in_flight_check_check",
     "(status = 'in_flight') = (lease_token IS NOT NULL)"
     " AND (lease_token IS NULL) = (lease_expires_at IS NULL)"
     " AND (lease_token IS NULL) = (lease_owner IS NULL)"),
    ("delivered_at", "effects_effects_delivered_at_check_check",
     "(status = 'delivered') = (delivered_at IS NOT NULL)"),
    ("delivered_attempt", "effects_delivered_attempt_check",
     "delivered_by IS NULL OR (status = 'delivered' AND delivered_started_at IS NOT NULL)"),
    ("finished_at", "effects_effects_finished_at_check_check",
     "(status IN ('delivered', 'failed', 'cancelled', 'needs_review'))"
     " = (finished_at IS NOT NULL)"),
)
_EFFECT_ARGS = (("status", "text"), ("effect_key", "text"), ("attempts", "int4"),
                ("max_attempts", "int4"), ("lease_token", "uuid"),
                ("lease_expires_at", "timestamptz"), ("lease_owner", "text"),
                ("delivered_at", "timestamptz"), ("finished_at", "timestamptz"),
                ("delivered_by", "text"), ("delivered_started_at", "timestamptz"))

_KEY_RULES = (
    ("status", "idempotency_keys_idempotency_keys_status_check_check",
     "status IN ('processing', 'completed')"),
    ("key_length", "idempotency_keys_idempotency_keys_key_length_check_check",
     "pg_catalog.length(key) BETWEEN 1 AND 255"),
    ("status_columns",
     "idempotency_keys_idempotency_keys_status_columns_check_check",
     "(status = 'processing' AND lock_token IS NOT NULL AND locked_at IS NOT NULL"
     " AND lock_expires_at IS NOT NULL AND response_status IS NULL"
     " AND completed_at IS NULL)"
     " OR (status = 'completed' AND response_status IS NOT NULL"
     " AND completed_at IS NOT NULL AND lock_expires_at IS NULL)"),
)
_KEY_ARGS = (("status", "text"), ("key", "text"), ("lock_token", "uuid"),
             ("locked_at", "timestamptz"), ("lock_expires_at", "timestamptz"),
             ("response_status", "int4"), ("completed_at", "timestamptz"))

# table, function, its arguments, its rules, the new constraint
_TABLES = (
    ("effects", "effect_row_ok", _EFFECT_ARGS, _EFFECT_RULES, "effects_row_check"),
    ("idempotency_keys", "key_row_ok", _KEY_ARGS, _KEY_RULES,
     "idempotency_keys_row_check"),
)


def _qualified(rule: str) -> str:
    """`rule` with every operator schema-qualified, as the function runs it: `x IN
    (...)` becomes `= ANY (ARRAY[...])` and `BETWEEN` two comparisons, since neither
    takes a qualified operator. Only the forms the rules above use, each comparison
    in parentheses or between AND/OR: `OPERATOR(...)` binds as any other operator, not
    as `=` does (`a = b || c` would change meaning), and string literals are not
    spared. A rule added later must keep to that; tests/test_schema.py compares the
    result with the readable rule over every combination of values."""
    rule = re.sub(r"(\w+) IN \(([^()]*)\)", r"\1 = ANY (ARRAY[\2])", rule)
    rule = re.sub(r"(pg_catalog\.length\(\w+\)) BETWEEN (\d+) AND (\d+)",
                  r"\1 >= \2 AND \1 <= \3", rule)
    rule = re.sub(r" (=|>=|<=) ", r" OPERATOR(pg_catalog.\1) ", rule)
    left = re.sub(r"OPERATOR\(pg_catalog\.[=<>]+\)|'[^']*'", "", rule)
    if re.search(r"[=<>!|+*/-]|\b(IN|BETWEEN|DISTINCT|NULLIF|CASE)\b", left):
        raise ValueError(f"a rule form _qualified does not handle: {rule}")
    return rule


def _function(table: str, name: str, args: tuple[tuple[str, str], ...],
              rules: tuple[tuple[str, str, str], ...], constraint: str) -> str:
    """A CHECK passes unless its rule is false (null passes), so does each rule here.
    The fast path is one expression; only a refused row looks for the rule to name."""
    every = "\n       AND ".join(f"({_qualified(rule)}) IS NOT FALSE"
                                 for _, _, rule in rules)
    which = "\n".join(
        f"    IF ({_qualified(rule)}) IS FALSE THEN\n"
        f"        v_rule := '{label}';\n"
        f"        v_text := {_literal(rule)};\n"
        f"    END IF;"
        for label, _, rule in reversed(rules))  # the first rule broken is the one reported
    params = ", ".join(f"{arg} {kind}" for arg, kind in args)
    return f"""
CREATE FUNCTION outbox.{name}({params}) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $fn$
DECLARE
    v_rule pg_catalog.text;
    v_text pg_catalog.text;
BEGIN
    IF {every} THEN
        RETURN true;
    END IF;
{which}
    RAISE EXCEPTION USING
        ERRCODE = 'check_violation',
        MESSAGE = pg_catalog.format('new row for relation "{table}" violates check'
                                    ' constraint "{constraint}", rule "%s"', v_rule),
        DETAIL = pg_catalog.format('Failing rule: %s', v_text),
        SCHEMA = 'outbox', TABLE = '{table}', CONSTRAINT = '{constraint}';
END $fn$
"""


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _call(name: str, args: tuple[tuple[str, str], ...]) -> str:
    return f"outbox.{name}({', '.join(arg for arg, _ in args)})"


def _signature(name: str, args: tuple[tuple[str, str], ...]) -> str:
    return f"outbox.{name}({', '.join(kind for _, kind in args)})"


# The order a guarded request takes them in: the key, then its effects.
_LOCK = "LOCK TABLE outbox.idempotency_keys, outbox.effects IN ACCESS EXCLUSIVE MODE"


def upgrade() -> None:
    op.execute(_LOCK)
    for table, name, args, rules, constraint in _TABLES:
        op.execute(_function(table, name, args, rules, constraint))
        op.execute(f"GRANT EXECUTE ON FUNCTION {_signature(name, args)} TO PUBLIC")
        for _, old, _ in rules:
            op.execute(f"ALTER TABLE outbox.{table} DROP CONSTRAINT {old}")
        op.execute(f"ALTER TABLE outbox.{table} ADD CONSTRAINT {constraint}"
                   f" CHECK ({_call(name, args)})")


def downgrade() -> None:
    op.execute(_LOCK)
    for table, name, args, rules, constraint in _TABLES:
        op.execute(f"ALTER TABLE outbox.{table} DROP CONSTRAINT {constraint}")
        for _, old, rule in rules:
            op.execute(f"ALTER TABLE outbox.{table} ADD CONSTRAINT {old} CHECK ({rule})")
        op.execute(f"DROP FUNCTION {_signature(name, args)}")
