"""Migrations produce exactly the models; the state machines are enforced by CHECKs."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from sqlalchemy import Engine, text
from sqlalchemy.exc import IntegrityError

from outbox import EffectStatus, KeyStatus
from outbox._migrate import alembic_config, current

ROOT = Path(__file__).resolve().parents[1]


def test_migrations_match_models(db_url: str) -> None:
    # `alembic check` raises if autogenerate still finds a difference.
    command.check(alembic_config(db_url))


def _head() -> str:
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head


def test_migrated_to_head(engine: Engine) -> None:
    with engine.connect() as conn:
        assert current(conn) == _head()


def test_alembic_cli_from_checkout(db_url: str) -> None:
    done = subprocess.run([str(Path(sys.executable).parent / "alembic"), "current"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env={"DATABASE_URL": db_url, "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert f"{_head()} (head)" in done.stdout


def test_queue_table_storage_settings(engine: Engine) -> None:
    with engine.connect() as conn:
        opts = conn.execute(text(
            "SELECT reloptions FROM pg_class WHERE oid = 'outbox.effects'::regclass")
        ).scalar_one()
    assert "fillfactor=80" in opts
    assert "autovacuum_vacuum_scale_factor=0.01" in opts


def _insert_effect(engine: Engine, **cols: object) -> None:
    base: dict[str, object] = {"effect_key": uuid.uuid4().hex, "kind": "k", "payload": "{}"}
    base.update(cols)
    names = ", ".join(base)
    values = ", ".join(f":{k}" for k in base)
    with engine.begin() as conn:
        conn.execute(text(f"INSERT INTO outbox.effects ({names}) VALUES ({values})"), base)


def _refused(refused: pytest.ExceptionInfo[IntegrityError], constraint: str, rule: str
             ) -> None:
    """A broken rule is check_violation naming the table's CHECK and the rule."""
    error = refused.value.orig
    assert getattr(error, "sqlstate", None) == "23514", error
    assert error.diag.constraint_name == constraint  # type: ignore[union-attr]
    assert f'violates check constraint "{constraint}", rule "{rule}"' in str(error)


@pytest.mark.parametrize(("cols", "rule"), [
    ({"status": "sent"}, "status"),                                  # not a state
    ({"status": "in_flight"}, "lease_iff_in_flight"),                # without a lease
    ({"status": "pending", "lease_token": uuid.uuid4()}, "lease_iff_in_flight"),
    ({"status": "in_flight", "lease_token": uuid.uuid4(),            # half a lease
      "lease_expires_at": "2030-01-01T00:00:00Z"}, "lease_iff_in_flight"),
    ({"status": "delivered"}, "delivered_at"),                       # without a time
    ({"status": "failed"}, "finished_at"),                           # finished, no time
    ({"status": "pending", "finished_at": "2030-01-01T00:00:00Z"}, "finished_at"),
    ({"effect_key": ""}, "effect_key_length"),                       # empty key
    ({"effect_key": "x" * 256}, "effect_key_length"),                # over the limit
    ({"max_attempts": 0}, "attempts"),
    ({"attempts": -1}, "attempts"),
    # the delivered attempt kept on the row (0006): only on a delivered row, with its start
    ({"delivered_by": "w", "delivered_started_at": "2030-01-01T00:00:00Z"},
     "delivered_attempt"),
    ({"status": "delivered", "delivered_at": "2030-01-01T00:00:00Z",
      "finished_at": "2030-01-01T00:00:00Z", "delivered_by": "w"}, "delivered_attempt"),
])
def test_effect_state_machine_checks(engine: Engine, cols: dict[str, object], rule: str
                                     ) -> None:
    with pytest.raises(IntegrityError) as refused:
        _insert_effect(engine, **cols)
    _refused(refused, "effects_row_check", rule)


def test_effect_rules_hold_on_update(engine: Engine) -> None:
    """The CHECK is evaluated on every write, as the seven it replaced were."""
    key = uuid.uuid4().hex
    _insert_effect(engine, effect_key=key)
    with pytest.raises(IntegrityError) as refused, engine.begin() as conn:
        conn.execute(text("UPDATE outbox.effects SET status = 'in_flight'"
                          " WHERE effect_key = :k"), {"k": key})
    _refused(refused, "effects_row_check", "lease_iff_in_flight")


_FINISHED: dict[str, object] = {"finished_at": "2030-01-01T00:00:00Z"}
_VALID_ROWS: dict[EffectStatus, dict[str, object]] = {
    EffectStatus.PENDING: {},
    EffectStatus.IN_FLIGHT: {"lease_token": uuid.uuid4(), "lease_owner": "w",
                             "lease_expires_at": "2030-01-01T00:00:00Z"},
    EffectStatus.DELIVERED: {"delivered_at": "2030-01-01T00:00:00Z", **_FINISHED,
                             "delivered_by": "w",
                             "delivered_started_at": "2030-01-01T00:00:00Z"},
    EffectStatus.FAILED: _FINISHED,
    EffectStatus.CANCELLED: _FINISHED,
    EffectStatus.NEEDS_REVIEW: _FINISHED,
}


def test_effect_valid_states_accepted(engine: Engine) -> None:
    """Every status of the Python enum is one the database accepts (and no other is:
    test_effect_state_machine_checks), each with the columns it needs."""
    assert set(_VALID_ROWS) == set(EffectStatus)
    queue = f"valid-{uuid.uuid4().hex[:8]}"
    for status, cols in _VALID_ROWS.items():
        _insert_effect(engine, status=status.value, queue=queue, **cols)
    with engine.connect() as conn:
        statuses = set(conn.execute(text("SELECT status FROM outbox.effects WHERE queue = :q"),
                                    {"q": queue}).scalars())
    assert statuses == {s.value for s in EffectStatus}


_KEY_INSERT = ("INSERT INTO outbox.idempotency_keys (scope, key, fingerprint, status,"
               " expires_at) VALUES ('s', :key, 'f', :status, now())")


@pytest.mark.parametrize(("key", "status", "rule"), [
    ("k", "processing", "status_columns"),   # processing without a token
    ("k", "completed", "status_columns"),    # completed without a response
    ("k", "unknown", "status"),
    ("", "completed", "key_length"),
])
def test_key_state_machine_checks(engine: Engine, key: str, status: str, rule: str) -> None:
    assert {s.value for s in KeyStatus} == {"processing", "completed"}
    with pytest.raises(IntegrityError) as refused, engine.begin() as conn:
        conn.execute(text(_KEY_INSERT), {"key": key, "status": status})
    _refused(refused, "idempotency_keys_row_check", rule)


def test_key_valid_states_accepted(engine: Engine) -> None:
    scope = f"valid-{uuid.uuid4().hex[:8]}"
    with engine.begin() as conn:
        conn.execute(text(
            "INSERT INTO outbox.idempotency_keys (scope, key, fingerprint, status, lock_token,"
            " locked_at, lock_expires_at, expires_at) VALUES (:s, 'p', 'f', :st, :t, now(),"
            " now(), now())"), {"s": scope, "st": KeyStatus.PROCESSING.value,
                                "t": uuid.uuid4()})
        conn.execute(text(
            "INSERT INTO outbox.idempotency_keys (scope, key, fingerprint, status,"
            " response_status, completed_at, expires_at) VALUES (:s, 'c', 'f', :st, 201,"
            " now(), now())"), {"s": scope, "st": KeyStatus.COMPLETED.value})
        statuses = set(conn.execute(text(
            "SELECT status FROM outbox.idempotency_keys WHERE scope = :s"), {"s": scope}
        ).scalars())
    assert statuses == {s.value for s in KeyStatus}


def test_0008_triggers_and_its_downgrade_round_trip(db_url: str) -> None:
    """`alembic check` cannot see triggers: here, on a scratch database, head has the two
    cascade triggers and no foreign key to effects; downgrading to 0007 brings the
    foreign keys back (after deleting rows a missing effect orphaned) and removes the
    triggers; upgrading again restores head, which still matches the models."""
    from outbox._migrate import upgrade

    with _scratch_database(db_url, "outbox_rt") as (url, scratch):
        def state() -> tuple[list[str], list[str]]:
            with scratch.connect() as conn:
                triggers = conn.execute(text(
                    "SELECT tgname FROM pg_trigger WHERE tgrelid = 'outbox.effects'::regclass"
                    " AND NOT tgisinternal ORDER BY tgname")).scalars().all()
                fks = conn.execute(text(
                    "SELECT conname FROM pg_constraint WHERE contype = 'f'"
                    " AND confrelid = 'outbox.effects'::regclass ORDER BY conname")
                ).scalars().all()
            return list(triggers), list(fks)

        upgrade(url)
        assert state() == (["effects_deleted", "effects_truncated"], [])
        with scratch.begin() as conn:  # a key whose effect is gone (written by hand)
            conn.execute(text("INSERT INTO outbox.effect_keys VALUES ('orphan', 999)"))
        command.downgrade(alembic_config(url), "0007")
        assert state() == ([], ["attempts_effect_id_fkey", "effect_keys_effect_id_fkey"])
        upgrade(url)
        assert state() == (["effects_deleted", "effects_truncated"], [])
        command.check(alembic_config(url))


@contextlib.contextmanager
def _scratch_database(db_url: str, prefix: str) -> Iterator[tuple[str, Engine]]:
    """A database of its own on the tests' server (its URL and an engine), dropped after."""
    from sqlalchemy import create_engine, make_url
    from sqlalchemy.pool import NullPool

    base = make_url(db_url)
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    admin = create_engine(base.set(database="postgres"), isolation_level="AUTOCOMMIT",
                          poolclass=NullPool)
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    url = base.set(database=name).render_as_string(hide_password=False)
    scratch = create_engine(url, poolclass=NullPool)
    try:
        yield url, scratch
    finally:
        scratch.dispose()
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _migration_0013() -> Any:
    import importlib.util

    path = ROOT / "migrations" / "versions" / "0013_row_checks.py"
    spec = importlib.util.spec_from_file_location("migration_0013", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Values for each rule column: NULL, and ones that pass and break each rule.
_TS = "'2030-01-01T00:00:00Z'::timestamptz"
_KEY_TEXT = ("NULL", "''", "'k'", "repeat('x', 256)")
_EFFECT_GRID: dict[str, tuple[str, ...]] = {
    "status": ("NULL", *(f"'{s.value}'" for s in EffectStatus), "'sent'"),
    "effect_key": _KEY_TEXT,
    "attempts": ("NULL", "-1", "0"),
    "max_attempts": ("NULL", "0", "1"),
    "lease_token": ("NULL", "gen_random_uuid()"),
    "lease_expires_at": ("NULL", _TS),
    "lease_owner": ("NULL", "'w'"),
    "delivered_at": ("NULL", _TS),
    "finished_at": ("NULL", _TS),
    "delivered_by": ("NULL", "'w'"),
    "delivered_started_at": ("NULL", _TS),
}
_KEY_GRID: dict[str, tuple[str, ...]] = {
    "status": ("NULL", *(f"'{s.value}'" for s in KeyStatus), "'unknown'"),
    "key": _KEY_TEXT,
    "lock_token": ("NULL", "gen_random_uuid()"),
    "locked_at": ("NULL", _TS),
    "lock_expires_at": ("NULL", _TS),
    "response_status": ("NULL", "201"),
    "completed_at": ("NULL", _TS),
}


@pytest.mark.parametrize(("table", "size"), [("effects", 36_864), ("keys", 512)])
def test_the_rules_are_the_checks_they_replaced(engine: Engine, table: str, size: int
                                                ) -> None:
    """Every combination of the grid above (NULLs included: a CHECK passes unless its
    rule is false): the function refuses exactly the rows the CHECKs of revision 0012
    refused (seven on effects, three on keys), and names the first rule a row broke."""
    from outbox._schema import EFFECT_RULE_COLUMNS, KEY_RULE_COLUMNS

    migration = _migration_0013()
    if table == "effects":
        grid_values, args, rules = (_EFFECT_GRID, migration._EFFECT_ARGS,
                                    migration._EFFECT_RULES)
        function, rule_columns = "effect_row_ok", EFFECT_RULE_COLUMNS
    else:
        grid_values, args, rules = _KEY_GRID, migration._KEY_ARGS, migration._KEY_RULES
        function, rule_columns = "key_row_ok", KEY_RULE_COLUMNS
    assert tuple(arg for arg, _ in args) == rule_columns == tuple(grid_values)
    old_verdict = " AND ".join(f"({rule}) IS NOT FALSE" for _, _, rule in rules)
    first_broken = "CASE " + " ".join(
        f"WHEN ({rule}) IS FALSE THEN '{label}'" for label, _, rule in rules) + " END"
    columns = ", ".join(rule_columns)
    grid = " CROSS JOIN ".join(
        f"(VALUES {', '.join(f'({v})' for v in values)}) AS g_{name}({name})"
        for name, values in grid_values.items())
    with engine.begin() as conn:
        conn.execute(text(f"""
            CREATE FUNCTION pg_temp.refused({', '.join(f'{a} {k}' for a, k in args)})
            RETURNS text LANGUAGE plpgsql AS $$
            BEGIN
                PERFORM outbox.{function}({columns});
                RETURN NULL;
            EXCEPTION WHEN check_violation THEN
                RETURN substring(SQLERRM from 'rule "([a-z_]+)"');
            END $$"""))
        mismatches = conn.execute(text(f"""
            SELECT {columns}, old_ok, old_rule, new_rule FROM (
                SELECT *, {old_verdict} AS old_ok, {first_broken} AS old_rule,
                       pg_temp.refused({columns}) AS new_rule
                  FROM {grid}) AS cases
             WHERE old_ok <> (new_rule IS NULL) OR old_rule IS DISTINCT FROM new_rule
             LIMIT 5""")).all()
        total = conn.execute(text(f"SELECT count(*) FROM {grid}")).scalar_one()
    assert total == size
    assert mismatches == []


@pytest.mark.parametrize(("operator", "types", "insert"), [
    (">=", "int4, int4", "INSERT INTO outbox.effects (effect_key, kind, payload, attempts,"
     " max_attempts) VALUES (:key, 'k', '{}', -5, 0)"),
    # an in-flight row with no lease, no times: each rule compares two booleans
    ("=", "boolean, boolean", "INSERT INTO outbox.effects (effect_key, kind, payload,"
     " status) VALUES (:key, 'k', '{}', 'in_flight')"),
])
def test_a_writer_cannot_slip_its_own_operator_into_the_rules(
        engine: Engine, operator: str, types: str, insert: str) -> None:
    """The rules run in the writing session, on its search_path: an operator of the
    writer's own, in a schema it puts first, must not be the one they use (reviewed:
    unqualified, each of these INSERTs of a refused row went in)."""
    left, right = (t.strip() for t in types.split(","))
    with pytest.raises(IntegrityError) as refused, engine.begin() as conn:
        conn.execute(text("CREATE SCHEMA rogue_ops"))
        conn.execute(text(f"CREATE FUNCTION rogue_ops.yes({types}) RETURNS boolean"
                          " LANGUAGE sql IMMUTABLE AS 'SELECT true'"))
        conn.execute(text(f"CREATE OPERATOR rogue_ops.{operator} (LEFTARG = {left},"
                          f" RIGHTARG = {right}, FUNCTION = rogue_ops.yes)"))
        conn.execute(text("SET LOCAL search_path = rogue_ops, pg_catalog, public"))
        conn.execute(text(insert), {"key": uuid.uuid4().hex})
    assert getattr(refused.value.orig, "sqlstate", None) == "23514"
    with engine.connect() as conn:  # the transaction rolled back: nothing stayed
        assert conn.execute(text("SELECT count(*) FROM pg_namespace"
                                 " WHERE nspname = 'rogue_ops'")).scalar_one() == 0


def test_every_writer_may_run_the_rules(db_url: str) -> None:
    """PostgreSQL checks EXECUTE on a CHECK's function for each role that writes the
    table. On a database whose functions are created without EXECUTE for PUBLIC
    (`ALTER DEFAULT PRIVILEGES ... REVOKE`, a common hardening), a role allowed to
    insert effects still can: migration 0013 grants EXECUTE on the rules itself."""
    from outbox._migrate import upgrade

    role = f"outbox_writer_{uuid.uuid4().hex[:8]}"
    with _scratch_database(db_url, "outbox_grant") as (url, scratch):
        with scratch.begin() as conn:
            conn.execute(text(f'CREATE ROLE "{role}"'))
            conn.execute(text("ALTER DEFAULT PRIVILEGES REVOKE EXECUTE ON FUNCTIONS"
                              " FROM PUBLIC"))
        try:
            upgrade(url)
            with scratch.begin() as conn:
                conn.execute(text(f'GRANT USAGE ON SCHEMA outbox TO "{role}"'))
                conn.execute(text(f'GRANT INSERT ON outbox.effects TO "{role}"'))
                conn.execute(text(f'GRANT USAGE ON SEQUENCE outbox.effects_id_seq'
                                  f' TO "{role}"'))
                conn.execute(text(f'SET LOCAL ROLE "{role}"'))
                conn.execute(text("INSERT INTO outbox.effects (effect_key, kind, payload)"
                                  " VALUES ('k', 'k', '{}')"))
        finally:
            with scratch.begin() as conn:  # its grants, then the role (cluster-wide)
                conn.execute(text(f'DROP OWNED BY "{role}"'))
                conn.execute(text(f'DROP ROLE "{role}"'))
